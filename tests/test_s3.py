"""Every verb and the Checkpointer against a real S3 wire protocol: moto's server on
127.0.0.1, reached over HTTP through boto3 (AWS_ENDPOINT_URL), plus a fault-injecting proxy."""

from __future__ import annotations

import os
from typing import Iterator

import boto3
import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.cli.app import app
from ckptctl.errors import SaveFailed, StorageError
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.ops.transfer.copy import copy_checkpoint, restore_latest
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints
from s3_fault_proxy import FaultProxy

MiB = 1 << 20


def _bucket_prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix


def _raw(s3_server: str):
    return boto3.client("s3", endpoint_url=s3_server)


def _state(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.arange(n // 10, dtype=torch.int64) * step},
        "extra": {"step": step, "note": "s3"},
    }


def _empty_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {}}


def _shard_key(url: str, step: int) -> str:
    store = open_storage(url).sub(step_dir(step))
    name = next(i.key for i in store.list() if i.key.endswith(".safetensors"))
    bucket, prefix = _bucket_prefix(url)
    return f"{prefix}/{step_dir(step)}/{name}"


def _corrupt_object(s3_server: str, url: str, step: int) -> str:
    """Replace a shard behind the tool's back: same size, one byte of tensor data flipped."""
    raw = _raw(s3_server)
    bucket, _ = _bucket_prefix(url)
    key = _shard_key(url, step)
    data = bytearray(raw.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-10] ^= 0xFF
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    return key


def _uploads(s3_server: str, url: str) -> list:
    return _raw(s3_server).list_multipart_uploads(Bucket=_bucket_prefix(url)[0]).get("Uploads", [])


# --- the Checkpointer and every verb on a bucket -----------------------------------------


def test_checkpointer_saves_to_s3_and_loads_back_bitwise(s3_url):
    state = _state(5)
    with Checkpointer(s3_url) as ck:
        url = ck.save(5, state).wait()
    assert url == f"{s3_url}/{step_dir(5)}"
    loaded = _empty_like(state)
    with Checkpointer(s3_url) as ck:
        assert ck.load_latest(loaded) == 5
    for k in state["model"]:
        assert torch.equal(loaded["model"][k], state["model"][k])
    assert loaded["extra"] == state["extra"]


def test_verbs_work_on_a_bucket_as_on_a_path(s3_url, tmp_path):
    with Checkpointer(s3_url) as ck:
        for s in (10, 20):
            ck.save(s, _state(s)).wait()
    rows = cli("ls", s3_url, "--json").json()["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [(10, "committed"), (20, "committed")]
    doc = cli("inspect", f"{s3_url}/{step_dir(20)}", "--json").json()
    assert doc["step"] == 20 and doc["world_size"] == 1
    v = cli("verify", f"{s3_url}/{step_dir(20)}", "--json")
    assert v.exit_code == 0 and v.json()["ok"]
    assert cli("verify", s3_url, "--all").exit_code == 0
    assert cli("latest", s3_url).stdout.strip() == f"{s3_url}/{step_dir(20)}"
    r = cli("restore", s3_url, str(tmp_path))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == ckpt_dir(str(tmp_path), 20)
    assert cli("verify", r.stdout.strip()).exit_code == 0
    state, loaded = _state(20), _empty_like(_state(20))
    Checkpointer(str(tmp_path)).load(r.stdout.strip(), loaded)
    assert all(torch.equal(loaded["model"][k], state["model"][k]) for k in state["model"])


def test_cp_local_to_s3_and_back(s3_url, tmp_path):
    local = str(tmp_path / "local")
    make_checkpoints(local, [3])
    up = cli("cp", ckpt_dir(local, 3), s3_url)
    assert up.exit_code == 0, up.stderr
    assert up.stdout.strip() == f"{s3_url}/{step_dir(3)}"
    assert cli("verify", up.stdout.strip()).exit_code == 0
    again = cli("cp", ckpt_dir(local, 3), s3_url)
    assert again.exit_code == 0 and "left as is" in again.stderr
    down = cli("cp", up.stdout.strip(), str(tmp_path / "back" / step_dir(3)))
    assert down.exit_code == 0, down.stderr
    for name in os.listdir(ckpt_dir(local, 3)):
        with open(os.path.join(ckpt_dir(local, 3), name), "rb") as a, open(os.path.join(down.stdout.strip(), name), "rb") as b:
            assert a.read() == b.read(), name


@pytest.mark.skipif("prune" not in {c.name for c in app.registered_commands}, reason="ckptctl prune is not registered")
def test_prune_on_a_bucket(s3_url):
    with Checkpointer(s3_url) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, _state(s, 100)).wait()
    r = cli("prune", s3_url, "--keep-last", "2", "--yes")
    assert r.exit_code == 0, r.stderr
    assert [row["step"] for row in cli("ls", s3_url, "--json").json()["checkpoints"]] == [3, 4]


def test_shard_larger_than_the_multipart_threshold(s3_url, s3_server, tmp_path):
    small_parts = open_storage(s3_url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    state = {"model": {"big": torch.randn(3 * MiB)}}  # 12 MiB: three parts
    with Checkpointer(s3_url, storage=small_parts) as ck:
        ck.save(1, state).wait()
    bucket, _ = _bucket_prefix(s3_url)
    head = _raw(s3_server).head_object(Bucket=bucket, Key=_shard_key(s3_url, 1))
    assert head["ContentLength"] > 12 * MiB and head["ETag"].strip('"').endswith("-3")  # multipart
    assert _uploads(s3_server, s3_url) == []
    loaded = {"model": {"big": torch.zeros(3 * MiB)}}
    with Checkpointer(s3_url) as ck:
        assert ck.load_latest(loaded) == 1
    assert torch.equal(loaded["model"]["big"], state["model"]["big"])
    # And the copy path: a local checkpoint uploaded in parts, then restored in ranged GETs.
    local = str(tmp_path / "local")
    with Checkpointer(local) as ck:
        ck.save(2, state).wait()
    result = copy_checkpoint(open_storage(ckpt_dir(local, 2)), small_parts.sub(step_dir(2)))
    assert result.status == "copied"
    head = _raw(s3_server).head_object(Bucket=bucket, Key=_shard_key(s3_url, 2))
    assert head["ETag"].strip('"').endswith("-3")
    reader_small = open_storage(s3_url, read_chunk_size=1 * MiB)
    restored = restore_latest(reader_small, open_storage(str(tmp_path / "restored")))
    assert restored.step == 2 and cli("verify", restored.path).exit_code == 0


def test_a_writer_told_the_size_ahead_commits_what_it_got_and_aborts_cleanly(s3_url, s3_server):
    # ``expect`` creates the multipart upload before a byte is written; the bytes actually
    # written still decide the object, and an abort leaves no upload behind.
    st = open_storage(s3_url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    data = os.urandom(1 * MiB)
    w = st.open_writer("short")
    w.expect(12 * MiB)  # fewer bytes come after all: one short part
    w.write(data)
    w.commit()
    assert st.read("short") == data and _uploads(s3_server, s3_url) == []
    w = st.open_writer("dropped")
    w.expect(12 * MiB)
    w.write(os.urandom(6 * MiB))
    w.abort()
    assert st.stat("dropped") is None and _uploads(s3_server, s3_url) == []


# --- corruption behind the tool's back ---------------------------------------------------


def test_corrupted_object_is_caught_and_restore_falls_back(s3_url, s3_server, tmp_path):
    with Checkpointer(s3_url) as ck:
        for s in (100, 200):
            ck.save(s, _state(s)).wait()
    _corrupt_object(s3_server, s3_url, 200)
    v = cli("verify", f"{s3_url}/{step_dir(200)}")
    assert v.exit_code == 1 and "does not match" in v.stdout and "model/" in v.stdout
    assert cli("latest", s3_url).stdout.strip() == f"{s3_url}/{step_dir(100)}"
    r = cli("restore", s3_url, str(tmp_path))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == ckpt_dir(str(tmp_path), 100)
    assert "skipping step 200" in r.stderr and "does not match" in r.stderr
    assert not os.path.exists(os.path.join(ckpt_dir(str(tmp_path), 200), MARKER))
    pinned = cli("restore", s3_url, str(tmp_path / "pinned"), "--step", "200")
    assert pinned.exit_code == 1 and "invalid checkpoint" in pinned.stderr


# --- faults on the wire --------------------------------------------------------------------


@pytest.fixture
def proxy(s3_server: str, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """Route the code under test through a fault-injecting proxy (boto3 config only)."""
    p = FaultProxy(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    # Fewer, faster attempts keep the persistent-fault tests short; transient faults below
    # never hit one request more than twice.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    try:
        yield p
    finally:
        p.stop()


def test_transient_faults_are_retried(proxy, s3_url, s3_server, tmp_path):
    counts: dict[str, int] = {}

    def flaky(method: str, path: str) -> str | None:
        # The first attempt of every part upload, the second of every PUT and GET: a mix of
        # throttling, dropped connections and bodies cut off mid-stream.
        kind = "part" if "partNumber=" in path else method
        counts[kind] = counts.get(kind, 0) + 1
        n = counts[kind]
        if kind == "part":
            return "503" if n % 2 else None
        if method == "PUT" and n % 3 == 2:
            return "drop"
        if method == "GET" and "list-type" not in path and n % 3 == 2:
            return "cut" if n % 2 else "503"
        return None

    proxy.rule = flaky
    small_parts = open_storage(s3_url, multipart_threshold=5 * MiB, part_size=5 * MiB, read_chunk_size=2 * MiB)
    state = {"model": {"big": torch.randn(3 * MiB), "small": torch.arange(10.0)}}
    with Checkpointer(s3_url, storage=small_parts) as ck:
        ck.save(1, state).wait()
    restored = restore_latest(small_parts, open_storage(str(tmp_path)))
    actions = {a for a, _, _ in proxy.injected}
    assert {"503", "drop", "cut"} <= actions, proxy.injected
    assert restored.step == 1 and cli("verify", restored.path).exit_code == 0
    loaded = {"model": {"big": torch.zeros(3 * MiB), "small": torch.zeros(10)}}
    Checkpointer(str(tmp_path)).load(restored.path, loaded)
    assert torch.equal(loaded["model"]["big"], state["model"]["big"])
    assert _uploads(s3_server, s3_url) == []


def test_persistent_fault_fails_cleanly_and_aborts_the_upload(proxy, s3_url, s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # a fault that persists: no need to wait long
    proxy.rule = lambda method, path: "503" if "partNumber=" in path else None
    small_parts = open_storage(s3_url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    with Checkpointer(s3_url, storage=small_parts) as ck:
        with pytest.raises(SaveFailed) as info:
            ck.save(1, {"model": {"big": torch.randn(3 * MiB)}}).wait()
    assert isinstance(info.value.__cause__, StorageError) and "after retries" in str(info.value.__cause__)
    assert _uploads(s3_server, s3_url) == []
    assert open_storage(s3_url).sub(step_dir(1)).stat(MARKER) is None
    # The same through `cp`: exit 3, nothing committed, no parts left behind.
    local = str(tmp_path / "local")
    with Checkpointer(local) as ck:
        ck.save(2, {"model": {"big": torch.randn(3 * MiB)}}).wait()
    with pytest.raises(StorageError):
        copy_checkpoint(open_storage(ckpt_dir(local, 2)), small_parts.sub(step_dir(2)))
    assert _uploads(s3_server, s3_url) == []
    assert small_parts.sub(step_dir(2)).stat(MARKER) is None


def test_unreachable_endpoint_is_exit_3(s3_url, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    r = cli("restore", s3_url, str(tmp_path))
    assert r.exit_code == 3 and "storage error" in r.stderr


def test_restore_and_latest_find_the_newest_among_more_than_1000(s3_url, s3_server, tmp_path):
    """Listing a bucket pages at 1,000 keys: the newest of 1,002 step prefixes is still found."""
    from concurrent.futures import ThreadPoolExecutor

    raw = _raw(s3_server)
    bucket, prefix = _bucket_prefix(s3_url)
    # 1,000 abandoned saves (no marker) below the two real checkpoints, step-sorted after them
    # as strings but before them as integers: only integer order finds the newest.
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: raw.put_object(Bucket=bucket, Key=f"{prefix}/{step_dir(s)}/rank-00000-of-00001.safetensors", Body=b"x"),
                      range(1, 1001)))
    with Checkpointer(s3_url) as ck:
        for s in (5000, 6000):
            ck.save(s, _state(s, 100)).wait()
    assert cli("latest", s3_url).stdout.strip() == f"{s3_url}/{step_dir(6000)}"
    r = cli("restore", s3_url, str(tmp_path))
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(str(tmp_path), 6000)


def test_restore_from_a_failing_store_is_exit_3_and_commits_nothing(proxy, s3_url, tmp_path, monkeypatch):
    with Checkpointer(s3_url) as ck:
        ck.save(1, _state(1)).wait()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    # Listing and metadata work; every read of shard data fails for good.
    proxy.rule = lambda method, path: "503" if method == "GET" and ".safetensors" in path else None
    r = cli("restore", s3_url, str(tmp_path))
    assert r.exit_code == 3 and "storage error" in r.stderr and ".safetensors" in r.stderr
    assert not os.path.exists(os.path.join(ckpt_dir(str(tmp_path), 1), MARKER))
    proxy.rule = lambda method, path: None
    again = cli("restore", s3_url, str(tmp_path))
    assert again.exit_code == 0 and again.stdout.strip() == ckpt_dir(str(tmp_path), 1)


@pytest.mark.parametrize("verb", [("ls",), ("latest",), ("verify", "--latest"), ("du",), ("inspect",)])
def test_a_bucket_name_s3_refuses_is_a_usage_error(s3_url, verb):
    """`s3://Bad_Bucket/x` (issue 30): the README promises exit 2 for a bucket name S3 refuses;
    botocore lets it through and the store says there is no such bucket. A well-formed name
    that does not exist stays an operational error (exit 3: the endpoint may be the wrong one)."""
    r = cli(verb[0], "s3://Bad_Bucket/x", *verb[1:])
    assert r.exit_code == 2, r.stderr
    assert "bucket Bad_Bucket does not exist, and 'Bad_Bucket' is not a name S3 allows" in r.stderr
    r = cli(verb[0], "s3://no-such-bucket-here/x", *verb[1:])
    assert r.exit_code == 3, r.stderr
    assert "bucket no-such-bucket-here does not exist" in r.stderr


def test_a_directory_bucket_name_without_its_zone_is_a_usage_error(s3_server, monkeypatch):
    # botocore's endpoint rules refuse a name ending --x-s3 that lacks the zone (no request is
    # sent): exit 3 "check the AWS configuration" before, though the URL is what is wrong.
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    r = cli("ls", "s3://ckpts--x-s3/run7")
    assert r.exit_code == 2, r.stderr
    assert "Unrecognized S3Express bucket name format" in r.stderr and "ckpts--usw2-az1--x-s3" in r.stderr
