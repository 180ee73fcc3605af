"""Writing one rank's shard from its staging buffer (runs on the background thread).

Every byte is hashed once (its chunk's checksum, which the file checksum is built from; see
``format.checksum``) and written once, straight from the staging buffer. XXH3 runs at tens of
GB/s and releases the GIL, so the training thread does not notice.

The header comes first in the file and holds every chunk's checksum. Where the writer can
overwrite what it wrote (POSIX, ``LocalWriter.overwrite``), the header's length is known before
any checksum is: checksums are fixed-width, so a header built with placeholder checksums has
the final length. The writer reserves it, then hashes and writes the data section piece by
piece (each piece still in the CPU cache when it is written, and the disk busy from the first
piece on), then writes the real header over the placeholder. The file is fsynced after that,
so what becomes visible is exactly the bytes of the hash-first path. Object stores cannot
rewrite their first part, so there every chunk is hashed first, then header and data go out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ckptctl.format.checksum import Hasher, digest, file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import Chunk, build_header
from ckptctl.save.shard_layout import ShardLayout, Slot
from ckptctl.settings import STREAM_PIECE, WRITE_PIECE
from ckptctl.storage.base import Storage, Writer

# Any 16 hex digits: every XXH3-64 checksum is written with exactly this many.
_PLACEHOLDER = "0" * 16


@dataclass(frozen=True)
class ShardReport:
    """What a rank tells the coordinator about its durable shard."""

    file: FileEntry
    slots: tuple[Slot, ...]  # which tensors (and which regions of them) the shard holds


def write_shard(ckpt: Storage, name: str, layout: ShardLayout, buf: torch.Tensor, *, rank: int, rank_state: dict) -> ShardReport:
    """Write ``layout``'s bytes from ``buf`` as shard ``name`` and make it durable (the writer's
    commit); the report carries its size, checksum and chunk count for the manifest."""
    data = memoryview(buf.numpy()).cast("B")[: layout.nbytes] if layout.nbytes else memoryview(b"")
    chunks = [Chunk(s.name, s.dtype, s.shape, s.offsets, s.begin, s.end, None) for s in layout.slots]
    with ckpt.open_writer(name) as w:
        if callable(getattr(w, "overwrite", None)):
            header, chunks = _write_hashing_as_it_goes(w, chunks, data, rank, rank_state)
        else:
            chunks = [replace(c, checksum=digest(data[c.begin : c.end])) for c in chunks]
            header = build_header(chunks, rank=rank, rank_state=rank_state)
            w.write(header)
            for pos in range(0, layout.nbytes, WRITE_PIECE):
                w.write(data[pos : pos + WRITE_PIECE])
    checksum = file_checksum(header, (c.checksum for c in chunks if c.checksum))
    entry = FileEntry(name=name, size=len(header) + layout.nbytes, checksum=checksum, rank=rank, chunks=len(chunks))
    return ShardReport(entry, layout.slots)


def _write_hashing_as_it_goes(
    w: Writer, chunks: list[Chunk], data: memoryview, rank: int, rank_state: dict
) -> tuple[bytes, list[Chunk]]:
    """Reserve the header, write the data section while hashing it, then the real header over
    the reserved bytes. Returns the header and the chunks with their checksums."""
    reserved = build_header([replace(c, checksum=_PLACEHOLDER) for c in chunks], rank=rank, rank_state=rank_state)
    w.write(reserved)
    # The chunks tile the data section, so one pass in data order hands each piece's bytes to
    # the hashers of the chunks it covers, then writes the piece while it is still cached.
    order = sorted(range(len(chunks)), key=lambda k: (chunks[k].begin, chunks[k].end))
    hashers = [Hasher() for _ in chunks]
    i = 0
    for pos in range(0, len(data), STREAM_PIECE):
        end = min(pos + STREAM_PIECE, len(data))
        while i < len(order) and chunks[order[i]].begin < end:
            c = chunks[order[i]]
            hashers[order[i]].update(data[max(c.begin, pos) : min(c.end, end)])
            if c.end > end:
                break  # the chunk goes on in the next piece
            i += 1
        w.write(data[pos:end])
    done = [replace(c, checksum=h.hexdigest()) for c, h in zip(chunks, hashers)]
    header = build_header(done, rank=rank, rank_state=rank_state)
    if len(header) != len(reserved):  # cannot happen while checksums are fixed-width
        raise AssertionError(f"shard header changed length ({len(reserved)} -> {len(header)} bytes)")
    w.overwrite(0, header)  # type: ignore[attr-defined]
    return header, done
