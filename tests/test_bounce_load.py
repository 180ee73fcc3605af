"""Loads onto GPU targets read the file straight into the bounce pool's page-locked buffers.

A GPU target of ``CheckpointReader`` is filled through a ``BouncePool``
(``load.fill._fill_through``): the needed rows of each chunk go from the file into a pinned
buffer and up, hashed there, with no pageable temporary of the tensor. On the CPU the same path
runs with a CPU pool: the reader routes a target to the pool registered for its device (the
table ``read_many`` builds for CUDA devices), page-locking goes through a recording registrar,
and everything else is real (a real checkpoint on disk, real reads and checksums).
``tests/test_gpu.py`` loads the same shapes onto a GPU.
"""

from __future__ import annotations

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.shard import parse_header
from ckptctl.load.bounce import BouncePool
from ckptctl.load.reader import CheckpointReader
from ckptctl.load.shard_index import ReadJob
from ckptctl.storage import open_storage

KiB = 1 << 10


class CountingRegistrar:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> str | None:
        self.live[ptr] = nbytes
        return None

    def unregister(self, ptr: int) -> str | None:
        return None if self.live.pop(ptr, None) is not None else "not registered"


@pytest.fixture()
def saved(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(1000, 37, generator=g),  # 148 000 bytes: many 16 KiB buffers
        "b16": torch.randn(333, generator=g).to(torch.bfloat16),
        "i": torch.arange(12345, dtype=torch.int64),
        "s": torch.tensor(7.5),
        "e": torch.empty(0, 4),
    }
    with Checkpointer(str(tmp_path)) as ck:
        path = ck.save(1, {"extra": tensors}).wait()
    return path, tensors


def _pool(reg: CountingRegistrar) -> BouncePool:
    return BouncePool("cpu", count=2, nbytes=16 * KiB, registrar=reg, register_chunk=4 * KiB)


def test_whole_tensors_partial_rows_and_column_splits_load_bitwise_through_the_pool(saved):
    path, tensors = saved
    reg = CountingRegistrar()
    pool = _pool(reg)
    with CheckpointReader(open_storage(path)) as r:
        r._bounce = {torch.device("cpu"): pool}  # where read_many puts a CUDA device's pool
        for name, t in tensors.items():
            out = torch.full_like(t, -3)
            r.read_into(ReadJob(f"extra/{name}", out))
            assert torch.equal(out, t), name
        rows = torch.empty(300, 37)
        r.read_into(ReadJob("extra/w", rows, (501, 0)))  # part of the chunk: the rest only hashed
        assert torch.equal(rows, tensors["w"][501:801])
        cols = torch.empty(1000, 5)
        r.read_into(ReadJob("extra/w", cols, (0, 30)))  # a column split: a temporary of the part
        assert torch.equal(cols, tensors["w"][:, 30:35])
        transposed = torch.empty(37, 1000).t()  # a non-contiguous target
        r.read_into(ReadJob("extra/w", transposed))
        assert torch.equal(transposed, tensors["w"])
    assert pool.stats.mapped <= 2 and pool.stats.chunks > 10
    pool.close()
    assert reg.live == {}


def test_a_corrupt_chunk_is_still_refused_on_the_pool_path(saved, tmp_path):
    path, tensors = saved
    shard = next(p for p in tmp_path.rglob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    header = parse_header(bytes(raw), len(raw), shard.name)
    chunk = next(c for c in header.chunks if c.name == "extra/i")
    raw[header.data_start + (chunk.begin + chunk.end) // 2] ^= 0x10  # one bit inside the int64 tensor
    shard.write_bytes(bytes(raw))
    with CheckpointReader(open_storage(path)) as r, _pool(CountingRegistrar()) as pool:
        r._bounce = {torch.device("cpu"): pool}
        with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
            r.read_into(ReadJob("extra/i", torch.empty(12345, dtype=torch.int64)))
