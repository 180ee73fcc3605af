"""Writing one rank's shard from its staging buffer (runs on the background thread).

Every byte is hashed once (its chunk's checksum, which the file checksum is built from; see
``format.checksum``) and written once, straight from the staging buffer. XXH3 runs at tens of
GB/s and releases the GIL, so the training thread does not notice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ckptctl.format.checksum import digest, file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import Chunk, build_header
from ckptctl.save.plan import Plan, Slot
from ckptctl.storage.base import Storage

WRITE_PIECE = 64 << 20  # large sequential writes; also bounds how much one hash update covers


@dataclass(frozen=True)
class ShardReport:
    """What a rank tells the coordinator about its durable shard."""

    file: FileEntry
    slots: tuple[Slot, ...]  # which tensors (and which regions of them) the shard holds


def write_shard(ckpt: Storage, name: str, plan: Plan, buf: torch.Tensor, *, rank: int, rank_state: dict) -> ShardReport:
    data = memoryview(buf.numpy()).cast("B")[: plan.nbytes] if plan.nbytes else memoryview(b"")
    chunks = [
        Chunk(s.name, s.dtype, s.shape, s.offsets, s.begin, s.end, digest(data[s.begin : s.end]))
        for s in plan.slots
    ]
    header = build_header(chunks, rank=rank, rank_state=rank_state)
    with ckpt.open_writer(name) as w:
        w.write(header)
        for pos in range(0, plan.nbytes, WRITE_PIECE):
            w.write(data[pos : pos + WRITE_PIECE])
    checksum = file_checksum(header, (c.checksum for c in chunks if c.checksum))
    entry = FileEntry(name=name, size=len(header) + plan.nbytes, checksum=checksum, rank=rank, chunks=len(chunks))
    return ShardReport(entry, plan.slots)
