"""A load reads each byte from storage once, into the staging buffer, and still changes nothing
until every chunk has been checked (``load.staged``).

Counted, not assumed: ``/proc/self/io`` of this process around the load (``read_bytes``: what
reached the disk, with the checkpoint's files dropped from the page cache first; ``rchar``:
every byte any read call returned, page cache, sockets and spool files included), and on S3
(moto over HTTP) the bytes of every GetObject response. Two passes over a file, or a spool
written and read back, show in ``rchar`` even when the page cache hides them from the disk.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Iterator

import pytest
import torch
from torch import nn

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.load.reader import CheckpointReader
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.settings import READ_STEP, VERIFY_PIECE
from ckptctl.storage import open_storage

MiB = 1 << 20
IO = "/proc/self/io"
pytestmark = pytest.mark.skipif(not os.path.exists(IO), reason="needs Linux /proc/self/io")


def _io() -> dict[str, int]:
    with open(IO) as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


class _Counted:
    """This process's read counters over the block."""

    def __enter__(self) -> "_Counted":
        self._before = _io()
        return self

    def __exit__(self, *exc: object) -> None:
        after = _io()
        self.rchar = after["rchar"] - self._before["rchar"]
        self.read_bytes = after["read_bytes"] - self._before["read_bytes"]


def _job(seed: int) -> dict:
    """About 26 MiB: a model with a 20 MiB weight (more than one read piece) and small ones,
    its Adam state, a loader position and extra."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 5 * 1024), nn.LayerNorm(5 * 1024))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"seed": seed}}


def _tensors(state: dict) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in state["model"].parameters()]
    for per in state["optimizer"].state.values():
        out += [v.clone() for v in per.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _files(path: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]


def _drop_cache(path: str) -> None:
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture(scope="module")
def moto_process() -> Iterator[str]:
    """moto's S3 server in a process of its own: the session's runs in this one, where its
    reads of the objects it serves would count in this process's ``rchar``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("moto's server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture
def s3_apart(s3_server: str, moto_process: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on ``moto_process`` (the session's ``s3_server`` only sets the dummy
    credentials); yields ``s3://BUCKET/prefix``."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_process)
    bucket = f"ckptctl-once-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_process).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/prefix"


@pytest.fixture
def saved(tmp_path) -> Iterator[tuple[str, dict]]:
    root = str(tmp_path / "ck")
    state = _job(1)
    with Checkpointer(root) as ck:
        ck.save(1, state).wait()
    yield root, state


# --- each byte once ----------------------------------------------------------------------


def test_a_local_load_into_a_held_buffer_reads_each_byte_once(saved):
    """A Checkpointer holding its staging buffer (prepared, or kept from a save or an earlier
    load: a fallback, a reload) reads each byte into it once."""
    root, state = saved
    want = _tensors(state)
    size = sum(os.path.getsize(f) for f in _files(root))
    fresh = _job(3)
    with Checkpointer(root) as ck:
        ck.load_latest(_job(2))  # imports, first-use setup: not counted
        assert ck.prepare(fresh) or ck.staging_held
        _drop_cache(root)
        with _Counted() as n:
            assert ck.load_latest(fresh) == 1
    assert _same(_tensors(fresh), want)
    # Two passes read every data byte twice through read() (2x rchar), even when the second
    # comes from the page cache; once is the checkpoint plus nothing.
    assert n.rchar <= 1.05 * size, (n.rchar, size)
    if n.read_bytes:  # 0 where the kernel does not account block I/O per task
        assert n.read_bytes <= 1.05 * size, (n.read_bytes, size)


def test_a_new_process_loading_from_a_local_disk_reads_the_disk_once(saved):
    """With no buffer held yet, a local load checks every chunk, then reads it again into place
    from the page cache (faulting in a buffer the size of the share on the resume's critical
    path costs more: docs/decisions.md): the disk is read once."""
    root, state = saved
    size = sum(os.path.getsize(f) for f in _files(root))
    with Checkpointer(root) as ck:
        ck.load_latest(_job(2))  # imports: not counted
    _drop_cache(root)
    fresh = _job(3)
    with _Counted() as n, Checkpointer(root) as ck:
        assert ck.load_latest(fresh) == 1
    assert _same(_tensors(fresh), _tensors(state))
    if n.read_bytes:
        assert n.read_bytes <= 1.05 * size, (n.read_bytes, size)


def test_a_load_from_s3_reads_each_byte_once_and_spools_nothing(s3_apart):
    s3_url = s3_apart
    state = _job(4)
    want = _tensors(state)
    with Checkpointer(s3_url) as ck:
        ck.save(4, state).wait()
    store = open_storage(s3_url)
    size = sum(info.size for info in store.sub(step_dir(4)).list())
    s3 = store._client.s3  # the client every verb shares
    got = {"bytes": 0}

    def count(parsed: dict, **_kw: object) -> None:
        got["bytes"] += int(parsed.get("ContentLength", 0))

    with Checkpointer(s3_url) as ck:
        ck.load_latest(_job(5))  # imports, connections: not counted
    fresh = _job(6)
    s3.meta.events.register("after-call.s3.GetObject", count)
    try:
        with _Counted() as n, Checkpointer(s3_url) as ck:
            assert ck.load_latest(fresh) == 4
    finally:
        s3.meta.events.unregister("after-call.s3.GetObject", count)
    assert _same(_tensors(fresh), want)
    assert got["bytes"] <= 1.05 * size, (got["bytes"], size)  # on the wire
    # A spool file written and read back twice would add 2x; the socket reads are the 1x.
    assert n.rchar <= 1.05 * size, (n.rchar, size)


# --- still all or nothing ----------------------------------------------------------------


def test_a_flip_in_the_last_step_of_a_large_chunk_changes_nothing(saved):
    """The 20 MiB weight is read front to back in ``READ_STEP`` calls (a local file's run) and
    hashed once its last byte is in; a flipped bit in its last step is found before any tensor
    changes."""
    root, state = saved
    ckpt = os.path.join(root, step_dir(1))
    with CheckpointReader(open_storage(ckpt)) as r:
        loc = r.chunks("model/1.weight")[0]
    start, end = loc.byte_range
    assert end - start > VERIFY_PIECE
    shard = next(f for f in _files(ckpt) if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.seek(end - 3)
        b = f.read(1)
        f.seek(end - 3)
        f.write(bytes([b[0] ^ 0x04]))
    target = _job(7)
    before = _tensors(target)
    with Checkpointer(root) as ck:
        assert ck.prepare(target)  # a buffer held: the load reads into it, once
        with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
            ck.load(ckpt, target)
        assert ck.staging_held
    assert _same(_tensors(target), before)


def test_a_flip_in_the_last_piece_of_a_large_chunk_on_s3_changes_nothing(s3_apart):
    """From S3 the 20 MiB weight is fetched in ``VERIFY_PIECE`` ranged GETs by several threads
    and hashed once its last piece has landed; a flipped bit in that piece is found before any
    tensor changes."""
    import boto3

    state = _job(12)
    with Checkpointer(s3_apart) as ck:
        ck.save(1, state).wait()
    store = open_storage(s3_apart)
    with CheckpointReader(store.sub(step_dir(1))) as r:
        loc = r.chunks("model/1.weight")[0]
    start, end = loc.byte_range
    assert end - start > VERIFY_PIECE
    bucket, _, prefix = s3_apart[len("s3://"):].partition("/")
    raw = boto3.client("s3")
    key = f"{prefix}/{step_dir(1)}/{loc.file}"
    data = bytearray(raw.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[end - 3] ^= 0x04
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    target = _job(13)
    before = _tensors(target)
    with Checkpointer(s3_apart) as ck, pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
        ck.load(f"{s3_apart}/{step_dir(1)}", target)
    assert _same(_tensors(target), before)


def _odd_job(seed: int) -> dict:
    """Tensors whose sizes are not multiples of a page or of ``READ_STEP``: in a run read in
    ``READ_STEP`` calls, chunks begin and end inside a step and span step boundaries."""
    g = torch.Generator().manual_seed(seed)
    sizes = [700_001, 3, 1_300_007, 524_289, 17, 900_011]
    return {"t": {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}}


@pytest.mark.parametrize("held", [True, False], ids=["one pass, buffer held", "two passes"])
def test_flips_at_chunk_edges_inside_read_steps_change_nothing(tmp_path, held):
    """Every chunk's first and last byte, flipped one at a time: each load refuses the
    checkpoint and leaves every tensor as it was; unflipped, it loads bitwise."""
    root = str(tmp_path / "ck")
    state = _odd_job(1)
    with Checkpointer(root) as ck:
        ck.save(1, state).wait()
    ckpt = os.path.join(root, step_dir(1))
    with CheckpointReader(open_storage(ckpt)) as r:
        locs = [loc for name in sorted(state["t"]) for loc in r.chunks(f"t/{name}")]
    run = min(loc.byte_range[0] for loc in locs)  # the data section's start: one run, read in steps from there
    assert any((a - run) // READ_STEP != (b - 1 - run) // READ_STEP for a, b in (loc.byte_range for loc in locs))
    shard = os.path.join(ckpt, locs[0].file)
    with Checkpointer(root) as ck:
        for at in sorted({b for loc in locs for b in (loc.byte_range[0], loc.byte_range[1] - 1)}):
            with open(shard, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x80]))
            target = _odd_job(2)
            if held:
                assert ck.prepare(target) or ck.staging_held
            before = {k: v.clone() for k, v in target["t"].items()}
            with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
                ck.load(ckpt, target, prepare=held)
            assert all(torch.equal(target["t"][k], v) for k, v in before.items()), at
            with open(shard, "r+b") as f:
                f.seek(at)
                f.write(b)
        target = _odd_job(2)
        ck.load(ckpt, target, prepare=held)
    assert all(torch.equal(target["t"][k], v) for k, v in state["t"].items())


def test_a_load_waits_for_the_save_writing_the_buffer_it_borrows(tmp_path):
    """The load reads into the staging buffer: a save still writing from it must finish first,
    or its shard would hold the loaded bytes under the old checksums."""
    root = str(tmp_path / "ck")
    state = _job(8)
    with Checkpointer(root) as ck:
        ck.save(1, state).wait()
        other = _job(9)
        handle = ck.save(2, other)  # async: the writer reads the staging buffer
        ck.load(os.path.join(root, step_dir(1)), other)
        handle.wait()
    assert verify_checkpoint(open_storage(os.path.join(root, step_dir(2))), "checksums").ok
    assert _same(_tensors(other), _tensors(state))


# --- the buffer stays for the saves --------------------------------------------------------


def test_a_resume_from_s3_leaves_the_buffer_the_first_save_copies_into(s3_url):
    """From S3 the load maps the staging buffer and reads into it; the first save then copies
    into that same memory: no second buffer, no second fault-in."""
    state = _job(10)
    with Checkpointer(s3_url) as ck:
        ck.save(1, state).wait()
    fresh = _job(11)
    with Checkpointer(s3_url) as ck:
        assert ck.load_latest(fresh) == 1
        staging = ck._saver.staging
        assert ck.staging_held and staging.nbytes > 0
        ptr = staging.lend(0, None).tensor.data_ptr()
        ck.save(2, fresh).wait()
        assert staging.lend(0, None).tensor.data_ptr() == ptr  # the same memory, not a new one
    assert _same(_tensors(fresh), _tensors(state))


def test_nothing_to_resume_prepares_after_the_first_optimizer_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": opt}
    with Checkpointer(str(tmp_path / "empty")) as ck:
        assert ck.load_latest(state) is None
        assert not ck.staging_held  # Adam has no state yet: the size is not known
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        assert ck.staging_held  # made in the background right after the step
        opt.step()  # the hook fired once; a second step does not prepare again
        ck.save(1, state).wait()
    with Checkpointer(str(tmp_path / "eval")) as ck:
        assert ck.load_latest(state, prepare=False) is None
        opt.step()
        assert not ck.staging_held
    assert os.path.exists(os.path.join(str(tmp_path / "empty"), step_dir(1), MARKER))
