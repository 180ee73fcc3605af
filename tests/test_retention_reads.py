"""Library retention proves the new checkpoint without downloading it (issue 14 §2): after each
commit every rank re-reads the shard it wrote, rank 0 records the verification, and the prune's
anchor check finds it in the verification record, reading no shard data.

Reads are counted through a Storage subclass defined here (the real S3 backend against the moto
server, each ranged read noted with the thread that made it)."""

from __future__ import annotations

import json
import threading

import torch

from ckptctl import Checkpointer
from ckptctl.format.shard import HEADER_GUESS
from ckptctl.ops.verify.cache import CACHE_KEY
from ckptctl.storage import open_storage
from ckptctl.storage.base import Reader
from ckptctl.storage.s3 import S3Storage

READS: list[tuple[str, str, int]] = []  # (thread name, key, bytes)


class _CountingReader(Reader):
    def __init__(self, inner: Reader, key: str) -> None:
        self.inner, self.key, self.size = inner, key, inner.size

    def read_into(self, offset: int, out: memoryview) -> None:
        self.inner.read_into(offset, out)
        READS.append((threading.current_thread().name, self.key, out.nbytes))

    def close(self) -> None:
        self.inner.close()


class CountingS3(S3Storage):
    """The S3 backend, noting every byte read and which thread read it."""

    def sub(self, key: str) -> "CountingS3":
        child = super().sub(key)
        child.__class__ = CountingS3
        return child

    def open_reader(self, key: str) -> Reader:
        return _CountingReader(super().open_reader(key), self.url_of(key))


def _bytes(thread_prefix: str, suffix: str) -> int:
    return sum(n for t, k, n in READS if t.startswith(thread_prefix) and k.endswith(suffix))


def test_library_retention_on_s3_downloads_no_checkpoint(s3_url):
    READS.clear()
    state = {"w": torch.randn(1 << 20)}  # a 4 MiB shard per save
    with Checkpointer(s3_url, storage=CountingS3(s3_url), keep_last=1) as ckpt:
        for step in (1, 2, 3, 4):
            state["w"].add_(1.0)
            ckpt.save(step, state).wait()
    root = open_storage(s3_url)
    assert [c.key for c in root.children() if c.kind == "dir"] == ["step-0000000004"]
    record = json.loads(root.read(CACHE_KEY))["entries"]
    assert record["step-0000000004"]["level"] == "load"

    shard = 4 << 20
    # The prune (retention thread) read markers, manifests and the record: no shard at all.
    assert _bytes("ckptctl-retention", ".safetensors") == 0
    assert sum(n for t, _, n in READS if t.startswith("ckptctl-retention")) < 64 << 10
    # Each save's shard was read back exactly once, by its writer's check (one rank: the whole
    # checkpoint), never a second time to verify it for the prune; beside it only the header's
    # check, whose first read takes up to HEADER_GUESS bytes (one request for most headers).
    for step in (1, 2, 3, 4):
        read = sum(n for _, k, n in READS if f"/step-{step:010d}/" in k and k.endswith(".safetensors"))
        assert shard <= read < shard + HEADER_GUESS + (64 << 10), (step, read)
