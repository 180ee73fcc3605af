"""A load from object storage fetches each byte it needs once (``load.spool``), against moto's
S3 server over HTTP: bytes on the wire counted through botocore's event hooks, corruption
injected by rewriting an object behind the tool's back, a full spool disk made with a real,
tiny tmpfs."""

from __future__ import annotations

import logging
import os
from typing import Iterator

import boto3
import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.layout import step_dir
from ckptctl.load.loader import load_checkpoint
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.load.spool import Spool, coalesce
from ckptctl.storage import open_storage
from helpers import tmpfs

MiB = 1 << 20


def _state(seed: int) -> dict:
    """About 22 MiB over several tensors; ``big`` alone (20 MiB) is larger than one spool piece
    (``settings.VERIFY_PIECE``), so a chunk spans two coalesced GETs."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(5 * MiB, generator=g),
            "rows": torch.randn(256, 1024, generator=g),
            "half": torch.randn(512, 512, generator=g).to(torch.bfloat16),
            "ints": torch.arange(1000, dtype=torch.int64) * seed,
        },
        "extra": {"seed": seed},
    }


def _sentinel_like(state: dict) -> dict:
    return {"model": {k: torch.full_like(v, 7) for k, v in state["model"].items()}, "extra": {}}


def _assert_equal(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


class _GetBytes:
    """Bytes in every GetObject response of the process's shared S3 client, while active."""

    def __init__(self, url: str) -> None:
        self.client = open_storage(url)._client.s3  # the client every verb shares
        self.bytes = 0
        self.gets = 0

    def _count(self, parsed: dict, **_kw: object) -> None:
        self.gets += 1
        self.bytes += int(parsed.get("ContentLength", 0))

    def __enter__(self) -> "_GetBytes":
        self.client.meta.events.register("after-call.s3.GetObject", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.meta.events.unregister("after-call.s3.GetObject", self._count)


def _object_sizes(s3_server: str, url: str) -> dict[str, int]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    listed = boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"]: o["Size"] for o in listed.get("Contents", [])}


def _save(url: str, step: int, state: dict) -> str:
    with Checkpointer(url) as ck:
        ck.save(step, state).wait()
    return f"{url}/{step_dir(step)}"


@pytest.fixture
def spool_dir(tmp_path) -> Iterator[str]:
    d = tmp_path / "spool"
    d.mkdir()
    yield str(d)
    assert os.listdir(d) == [], "a spool file was left behind"


# --- each byte once ------------------------------------------------------------------------


def test_a_load_from_s3_fetches_each_byte_once(s3_url, s3_server, spool_dir):
    state = _state(1)
    ckpt = _save(s3_url, 1, state)
    needed = sum(_object_sizes(s3_server, s3_url).values())  # a whole load needs every object
    loaded = _sentinel_like(state)
    with _GetBytes(s3_url) as got:
        assert load_checkpoint(open_storage(ckpt), loaded, spool_dir=spool_dir) == 1
    _assert_equal(loaded, state)
    # Two passes fetched every data byte twice (2x); once, plus a few header bytes, is ~1x.
    assert got.bytes <= 1.1 * needed, (got.bytes, needed)
    # Adjacent chunks share GETs: 22 MiB in 16 MiB pieces, plus marker, manifest, header reads.
    assert got.gets <= 8, got.gets


def test_load_latest_from_s3_fetches_each_byte_once(s3_url, s3_server):
    state = _state(2)
    _save(s3_url, 2, state)
    needed = sum(_object_sizes(s3_server, s3_url).values())
    loaded = _sentinel_like(state)
    with _GetBytes(s3_url) as got, Checkpointer(s3_url) as ck:
        assert ck.load_latest(loaded, prepare=False) == 2
    _assert_equal(loaded, state)
    assert got.bytes <= 1.1 * needed, (got.bytes, needed)


def test_a_tiered_resume_from_s3_spools_on_the_first_tier_not_tmpdir(s3_url, s3_server, tmp_path, monkeypatch, caplog):
    """A node that lost its NVMe resumes from S3: the spool goes on the first tier's disk, not
    $TMPDIR (often a tmpfs, so RAM the size of the rank's share). $TMPDIR here is a directory
    that does not exist: a spool there would fail and every byte would be fetched twice."""
    import tempfile

    from ckptctl import Tier

    state = _state(6)
    _save(s3_url, 6, state)
    needed = sum(_object_sizes(s3_server, s3_url).values())
    nvme = tmp_path / "nvme"
    nvme.mkdir()  # the replaced node's empty disk
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmpdir"))
    loaded = _sentinel_like(state)
    with caplog.at_level(logging.WARNING, logger="ckptctl"), _GetBytes(s3_url) as got:
        with Checkpointer(tiers=[Tier(str(nvme)), Tier(s3_url)]) as ck:
            assert ck.load_latest(loaded, prepare=False) == 6
    _assert_equal(loaded, state)
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "ckptctl" and "spool" in r.getMessage()]
    assert not fallbacks, fallbacks
    assert got.bytes <= 1.1 * needed, (got.bytes, needed)
    assert os.listdir(nvme) == [], "a spool file was left on the first tier"


def test_a_region_fetches_only_the_chunks_it_needs(s3_url, spool_dir):
    """Re-sharding: a rank reading rows 64-128 of one tensor fetches that tensor's chunk (its
    checksum covers all of it), not the rest of the shard."""
    state = _state(3)
    ckpt = _save(s3_url, 3, state)
    with CheckpointReader(open_storage(ckpt), spool_dir=spool_dir) as r:
        r.prefetch([ReadJob("model/rows", torch.empty(0))])
        chunk = r.chunks("model/rows")[0].chunk
        target = torch.full((64, 1024), 7.0)
        job = ReadJob("model/rows", target, (64, 0))
        with _GetBytes(s3_url) as got:
            r.verify_many([job])
            r.read_many([job])
    assert torch.equal(target, state["model"]["rows"][64:128])
    assert chunk.nbytes <= got.bytes <= 1.1 * chunk.nbytes, (got.bytes, chunk.nbytes)
    assert got.gets == 1, got.gets


# --- all or nothing ------------------------------------------------------------------------


def test_a_bit_flip_in_an_s3_shard_leaves_the_state_untouched(s3_url, s3_server, spool_dir):
    state = _state(4)
    ckpt = _save(s3_url, 4, state)
    raw = boto3.client("s3", endpoint_url=s3_server)
    bucket = s3_url[len("s3://"):].partition("/")[0]
    shard = next(k for k in _object_sizes(s3_server, s3_url) if k.endswith(".safetensors"))
    data = bytearray(raw.get_object(Bucket=bucket, Key=shard)["Body"].read())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the data section
    raw.put_object(Bucket=bucket, Key=shard, Body=bytes(data))
    loaded = _sentinel_like(state)
    before = {k: v.clone() for k, v in loaded["model"].items()}
    with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
        load_checkpoint(open_storage(ckpt), loaded, spool_dir=spool_dir)
    for k, v in before.items():
        assert torch.equal(loaded["model"][k], v), f"{k} was written before the checkpoint was proven"


# --- the spool's disk ----------------------------------------------------------------------


def test_a_full_spool_disk_falls_back_to_two_passes_and_still_loads(s3_url, s3_server, caplog):
    state = _state(5)
    ckpt = _save(s3_url, 5, state)
    needed = sum(_object_sizes(s3_server, s3_url).values())
    loaded = _sentinel_like(state)
    with tmpfs("1m") as small, _GetBytes(s3_url) as got, caplog.at_level(logging.WARNING, logger="ckptctl"):
        assert load_checkpoint(open_storage(ckpt), loaded, spool_dir=small) == 5
        assert os.listdir(small) == []
    _assert_equal(loaded, state)
    assert any("reading the" in r.getMessage() and "twice" in r.getMessage() for r in caplog.records), caplog.text
    assert got.bytes > 1.5 * needed, "the fallback is the two-pass read"


def test_an_unusable_spool_directory_falls_back_too(s3_url, tmp_path, caplog):
    state = _state(6)
    ckpt = _save(s3_url, 6, state)
    loaded = _sentinel_like(state)
    with caplog.at_level(logging.WARNING, logger="ckptctl"):
        load_checkpoint(open_storage(ckpt), loaded, spool_dir=str(tmp_path / "missing"))
    _assert_equal(loaded, state)
    assert "cannot create a spool file" in caplog.text


def test_a_local_load_does_not_spool(tmp_path, caplog):
    """Locally the second pass reads the page cache: nothing is spooled, so a spool directory
    that does not exist is never even looked at."""
    state = _state(7)
    with Checkpointer(str(tmp_path / "ck")) as ck:
        url = ck.save(7, state).wait()
    loaded = _sentinel_like(state)
    with caplog.at_level(logging.WARNING, logger="ckptctl"):
        load_checkpoint(open_storage(url), loaded, spool_dir=str(tmp_path / "missing"))
    _assert_equal(loaded, state)
    assert "spool" not in caplog.text


# --- the spool on its own ------------------------------------------------------------------


def test_coalesce_merges_touching_ranges_and_caps_each_piece():
    pieces = coalesce([("a", 10, 20), ("a", 0, 10), ("b", 0, 5), ("a", 30, 65), ("a", 20, 25)], cap=16)
    assert [(p.file, p.lo, p.hi) for p in pieces] == [
        ("a", 0, 16), ("a", 16, 25), ("a", 30, 46), ("a", 46, 62), ("a", 62, 65), ("b", 0, 5),
    ]
    assert [p.at for p in pieces] == [0, 16, 25, 41, 57, 60]  # end to end in the spool


def test_a_spool_serves_what_it_holds_across_pieces_and_nothing_else(tmp_path, s3_url):
    store = open_storage(s3_url)
    blob = os.urandom(100)
    store.write_atomic("obj", blob)
    with Spool(str(tmp_path)) as spool:
        spool.fetch(coalesce([("obj", 10, 40), ("obj", 60, 70)], cap=8), store.open_reader)
        out = bytearray(25)
        assert spool.read_into("obj", 12, memoryview(out)) and bytes(out) == blob[12:37]
        assert not spool.read_into("obj", 35, memoryview(bytearray(10)))  # runs into a hole
        assert not spool.read_into("other", 0, memoryview(bytearray(1)))
        assert os.listdir(tmp_path) == []  # unlinked from the start
