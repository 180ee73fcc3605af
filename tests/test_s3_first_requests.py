"""The requests ``restore``, ``latest`` and ``verify --latest`` send on S3 (moto over HTTP)
before their first data GET: each is a round trip in series, 15-50 ms on a real store. On the
code before this file they were 34, 19 and 19 for one ckptctl checkpoint: the root listed up to
six times, the other stacks' pointer files HEADed although the listing said they were absent,
the marker and manifest each stat'ed, HEADed and read twice, a shard's header after a LIST,
a HEAD and two ranged GETs (``scripts/s3_metadata_requests.py`` prints them with their stacks)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from ckptctl.errors import NotFound
from ckptctl.format.layout import MANIFEST, MARKER, step_dir
from ckptctl.storage import open_storage
from helpers import cli

MiB = 1 << 20
TRACKERS = ("latest_checkpointed_iteration.txt", "latest", "latest-rank0.pt.symlink")  # Megatron, DeepSpeed, Composer


@contextmanager
def sent(client: Any) -> Iterator[list[tuple[str, dict]]]:
    """Each request ``client`` sends inside the block, in order: (operation, parameters)."""
    log: list[tuple[str, dict]] = []
    lock = threading.Lock()

    def record(event_name: str, params: dict, **_kw: object) -> None:
        with lock:
            log.append((event_name.rsplit(".", 1)[-1], dict(params)))

    client.meta.events.register("provide-client-params.s3", record)
    try:
        yield log
    finally:
        client.meta.events.unregister("provide-client-params.s3", record)


def _is_data(op: str, params: dict) -> bool:
    """A GET of a shard's chunks: 1 MiB or more (a header's reads are far smaller)."""
    if op != "GetObject" or not params["Key"].endswith(".safetensors"):
        return False
    first, _, last = str(params.get("Range", "bytes=0-")).removeprefix("bytes=").partition("-")
    return not last or int(last) - int(first) + 1 >= MiB


def before_data(log: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """(operation, key or prefix) of each request before the first data GET."""
    with_data = [i for i, (op, params) in enumerate(log) if _is_data(op, params)]
    assert with_data, f"no data GET among {[op for op, _ in log]}"
    return [(op, params.get("Key") or params.get("Prefix", "")) for op, params in log[:with_data[0]]]


@pytest.fixture
def saved(s3_url: str) -> str:
    """A root on S3 holding one checkpoint the ``Checkpointer`` saved there (8 MiB: its data
    GETs are told apart from its header's)."""
    import torch

    from ckptctl import Checkpointer

    with Checkpointer(s3_url) as ck:
        ck.save(1, {"w": torch.arange(2 * MiB, dtype=torch.float32)}).wait()
    return s3_url


def _run(root: str, *args: str) -> list[tuple[str, str]]:
    client = open_storage(root)._client.s3  # type: ignore[attr-defined]  # the process's shared client
    with sent(client) as log:
        r = cli(*args)
    assert r.exit_code == 0, r.stdout + r.stderr
    return before_data(log)


def _read_once_each(asked: list[tuple[str, str]], root: str) -> None:
    prefix = root.split("/", 3)[3]
    ckpt = f"{prefix}/{step_dir(1)}"
    # The root listed once; no other stack's pointer asked for (the listing says none is there);
    # the record read once, one GET each (not a HEAD and a GET, twice; the marker's look that
    # decides whose the directory is remains, a LIST).
    assert asked.count(("ListObjectsV2", f"{prefix}/")) == 1, asked
    assert not [a for a in asked if a[1].rsplit("/", 1)[-1] in TRACKERS], asked
    for name in (MARKER, MANIFEST):
        read = [op for op, key in asked if key == f"{ckpt}/{name}" and op in ("GetObject", "HeadObject")]
        assert read == ["GetObject"], (name, asked)


def test_restore_sends_at_most_7_requests_before_its_first_data_get(saved, tmp_path):
    asked = _run(saved, "restore", saved, str(tmp_path / "dest"))
    # Was 34: classify twice (root stat, two listings, the seal's stat, three pointers' HEADs,
    # a third listing), the catalog's listing and the pointers again, the marker's stat, marker
    # and manifest read twice (HEAD + GET each), the shard's stat, HEAD and two header GETs,
    # then the scan's HEAD. Now: the root's stat and listing, the marker's stat, marker and
    # manifest, the shard's HEAD and header GET (the scan reads through the same reader).
    assert len(asked) <= 7, asked
    _read_once_each(asked, saved)
    assert cli("verify", str(tmp_path / "dest" / step_dir(1))).exit_code == 0


@pytest.mark.parametrize("verb", [["latest"], ["verify", "--latest"]], ids=["latest", "verify-latest"])
def test_latest_and_verify_latest_send_at_most_6_requests_before_their_first_data_get(saved, verb):
    asked = _run(saved, verb[0], saved, *verb[1:])
    # Was 19: the pointers' HEADs, the listing, the marker's stat, marker and manifest twice
    # (HEAD + GET each), the shard's stat, HEAD and two header GETs, the scan's HEADs (two
    # ranges at once). Now: the listing, the marker's stat, marker and manifest, the shard's
    # HEAD and header GET.
    assert len(asked) <= 6, asked
    _read_once_each(asked, saved)


def test_read_if_small_is_one_get_and_gives_only_the_size_of_a_larger_object(s3_url):
    st = open_storage(s3_url)
    st.write_atomic("small", b"x" * 100)
    st.write_atomic("empty", b"")
    client = st._client.s3  # type: ignore[attr-defined]
    with sent(client) as log:
        assert st.read_if_small("small", 100) == (b"x" * 100, 100)
        assert st.read_if_small("small", 99) == (None, 100)
        assert st.read_if_small("empty", 0) == (b"", 0)
        with pytest.raises(NotFound):
            st.read_if_small("absent", 10)
    assert [op for op, _ in log] == ["GetObject"] * 4, log  # no HEAD before any of them
    with pytest.raises(Exception, match="100 bytes is larger than the 99 allowed"):
        st.read("small", max_size=99)


def test_read_if_small_locally(tmp_path):
    st = open_storage(str(tmp_path))
    st.write_atomic("small", b"x" * 100)
    assert st.read_if_small("small", 100) == (b"x" * 100, 100)
    assert st.read_if_small("small", 99) == (None, 100)
    with pytest.raises(NotFound):
        st.read_if_small("absent", 10)


def _two_saves(s3_url: str) -> tuple[str, str]:
    """Roots ``a`` and ``b`` on S3, each holding a checkpoint of step 1 of other values (the same keys)."""
    import torch

    from ckptctl import Checkpointer

    roots = f"{s3_url}/a", f"{s3_url}/b"
    for i, root in enumerate(roots):
        with Checkpointer(root) as ck:
            ck.save(1, {"w": torch.full((2 * MiB,), float(i))}).wait()
    return roots


@contextmanager
def replaced_after_chosen(a: str, b: str, names: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, ``names`` of ``a``'s checkpoint are replaced by ``b``'s once the catalog
    has read ``a``'s manifest to choose it (the first answer to a GET of it)."""
    import boto3

    client = open_storage(a)._client.s3  # type: ignore[attr-defined]
    bucket, prefix_a = a[len("s3://"):].split("/", 1)
    prefix_b = b.split("/", 3)[3]
    manifest_key = f"{prefix_a}/{step_dir(1)}/{MANIFEST}"
    raw = boto3.client("s3")  # its own client: this hook does not see its requests
    done = threading.Event()

    def swap(event_name: str, context: dict, **_kw: object) -> None:
        if context.get("ckptctl-key") == manifest_key and not done.is_set():
            done.set()
            for name in names:
                raw.copy_object(Bucket=bucket, Key=f"{prefix_a}/{step_dir(1)}/{name}",
                                CopySource={"Bucket": bucket, "Key": f"{prefix_b}/{step_dir(1)}/{name}"})

    def key_of(params: dict, context: dict, **_kw: object) -> None:
        context["ckptctl-key"] = params.get("Key", "")

    client.meta.events.register("provide-client-params.s3.GetObject", key_of)
    client.meta.events.register("after-call.s3.GetObject", swap)
    try:
        yield
    finally:
        client.meta.events.unregister("provide-client-params.s3.GetObject", key_of)
        client.meta.events.unregister("after-call.s3.GetObject", swap)
    assert done.is_set()


def test_restore_copies_the_record_it_chose_by(s3_url, tmp_path):
    # The record the catalog read to choose the checkpoint is the one the copy checks the data
    # against and writes: replaced at the source just after, the copy still copies exactly the
    # checkpoint it chose (on the code before, the copy read the new record, found the data not
    # matching it and restored nothing).
    a, b = _two_saves(s3_url)
    chosen = open_storage(a).sub(step_dir(1)).read(MANIFEST)
    with replaced_after_chosen(a, b, (MARKER, MANIFEST)):
        r = cli("restore", a, str(tmp_path / "dest"))
    assert r.exit_code == 0, r.stdout + r.stderr
    dest = tmp_path / "dest" / step_dir(1)
    assert (dest / MANIFEST).read_bytes() == chosen
    assert cli("verify", str(dest)).exit_code == 0


def test_a_checkpoint_replaced_after_it_was_chosen_is_never_copied_mixed(s3_url, tmp_path):
    # Record and shard replaced by another save of the step just after the catalog chose it:
    # the copy checks the new shard against the record it chose, refuses it, and commits
    # nothing; never the chosen record over the other save's data. (The code before read the
    # record again and copied the other save whole, which is as safe: both are allowed here.)
    a, b = _two_saves(s3_url)
    other = open_storage(b).sub(step_dir(1)).read(MANIFEST)
    shard = next(k for k in open_storage(a).sub(step_dir(1)).children() if k.key.endswith(".safetensors")).key
    with replaced_after_chosen(a, b, (MARKER, MANIFEST, shard)):
        r = cli("restore", a, str(tmp_path / "dest"))
    dest = tmp_path / "dest" / step_dir(1)
    if r.exit_code == 0:
        assert (dest / MANIFEST).read_bytes() == other
        assert cli("verify", str(dest)).exit_code == 0
    else:
        assert r.exit_code == 1 and "none of 1 committed checkpoints verifies" in r.stderr, r.stderr
        assert not (dest / MARKER).exists()


def test_a_header_larger_than_the_first_guess_is_read_whole_and_checked(s3_url, tmp_path):
    """A shard whose header is larger than ``HEADER_GUESS`` (thousands of tensors) is read in a
    second request, whole: verify and restore pass, and a byte flipped in the header past the
    first read's end still fails both (the checked header is the streamed one)."""
    import boto3
    import torch

    from ckptctl import Checkpointer
    from ckptctl.format.shard import HEADER_GUESS

    state = {f"layer_{i:05d}.attention.query_key_value.weight": torch.full((4,), float(i)) for i in range(3000)}
    with Checkpointer(s3_url) as ck:
        ck.save(5, {"model": state}).wait()
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    raw = boto3.client("s3")
    key = next(o["Key"] for o in raw.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"] if "rank-" in o["Key"])
    body = bytearray(raw.get_object(Bucket=bucket, Key=key)["Body"].read())
    header_len = int.from_bytes(body[:8], "little")
    assert header_len > HEADER_GUESS, header_len  # else this test checks nothing new
    ckpt = f"{s3_url}/{step_dir(5)}"
    assert cli("verify", ckpt).exit_code == 0
    assert cli("restore", s3_url, str(tmp_path / "good")).exit_code == 0
    assert cli("verify", str(tmp_path / "good" / step_dir(5))).exit_code == 0

    at = HEADER_GUESS + (header_len - HEADER_GUESS) // 2  # inside the header, past the first read
    body[at] ^= 0x20  # in JSON text: stays printable
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    r = cli("verify", ckpt)
    assert r.exit_code == 1, r.stdout + r.stderr
    r = cli("restore", s3_url, str(tmp_path / "bad"))
    assert r.exit_code == 1, r.stdout + r.stderr
    assert not (tmp_path / "bad" / step_dir(5) / MARKER).exists()
