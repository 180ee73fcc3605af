"""A copy streaming a shard from S3 keeps several ranged GETs in flight (moto over HTTP).

One S3 connection moves 50-100 MB/s; a store's throughput comes from many. A copy reads each
file front to back, hashing every piece before it writes it, and used to fetch only the next
piece while one was hashed: one GET at a time per file, so a `restore` of one large shard ran
at a single connection's speed (boto3's `download_file` keeps 10). Now the reader's
``reads_in_flight`` (``S3Storage(read_concurrency=...)``) pieces are in flight, still consumed
in order, still every chunk checked before its bytes are kept.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptctl.layouts.shard_scan as shard_scan
from ckptctl import Checkpointer
from ckptctl.format.layout import step_dir
from ckptctl.storage import open_storage
from helpers import cli
from s3_in_flight import in_flight

PIECE = 1 << 20  # the scan's piece, shrunk so that an 8 MiB shard is 8 pieces


def _one_shard_on_s3(s3_url: str) -> tuple[str, dict]:
    state = {"w": torch.randn(2 << 20)}  # 8 MiB: one shard
    with Checkpointer(s3_url) as ck:
        ck.save(3, state).wait()
    return s3_url, state


@pytest.mark.parametrize("concurrency", [1, 4])
def test_restore_keeps_the_readers_concurrency_of_gets_in_flight_and_checks_every_byte(tmp_path, s3_url, monkeypatch, concurrency):
    monkeypatch.setattr(shard_scan, "VERIFY_PIECE", PIECE)
    root, state = _one_shard_on_s3(s3_url)
    src = open_storage(root, read_concurrency=concurrency)
    client = src._client.s3  # the process's shared client: the verb uses it too
    dst = str(tmp_path / "local")
    from ckptctl.ops.transfer.copy import restore_latest

    with in_flight(client, "GetObject", hold_s=0.1, when=lambda p: "rank-" in p["Key"] and "Range" in p) as gets:
        restore_latest(src, open_storage(dst))
    # Before: one GET of the shard at a time whatever the reader could do.
    assert gets.most == concurrency, gets.most
    assert cli("verify", os.path.join(dst, step_dir(3))).exit_code == 0
    loaded = {"w": torch.zeros(2 << 20)}
    with Checkpointer(dst) as ck:
        assert ck.load_latest(loaded) == 3
    assert torch.equal(loaded["w"], state["w"])


def test_a_flipped_byte_in_a_late_piece_fails_the_restore_with_gets_in_flight(tmp_path, s3_url, monkeypatch):
    """Pieces read ahead are still each checked before the copy keeps them: a bad chunk in a
    piece fetched while earlier ones were hashed fails the copy, and nothing is committed."""
    import boto3

    monkeypatch.setattr(shard_scan, "VERIFY_PIECE", PIECE)
    root, _ = _one_shard_on_s3(s3_url)
    bucket, prefix = root[len("s3://"):].split("/", 1)
    raw = boto3.client("s3")
    key = next(o["Key"] for o in raw.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"] if "rank-" in o["Key"])
    body = bytearray(raw.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-(PIECE + 12345)] ^= 0x01  # in the second-to-last piece: read while earlier ones are hashed
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    dst = str(tmp_path / "local")
    r = cli("restore", root, dst)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "checksum" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(dst, step_dir(3), "COMMITTED"))
