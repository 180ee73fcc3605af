"""Writing a ckptctl shard with bounded memory: one piece of one chunk in memory at a time.

The checkpointer's ``write_shard`` takes a whole staging buffer, which offline verbs cannot
afford (a shard may be far larger than memory). The catch is the format: a shard is a
safetensors file, whose header comes first and carries each chunk's checksum. So every
checksum must be known before the first data byte is written. The options weighed:

1. spill: write the data to a temporary object while hashing, then header + a copy of it.
   Reads the source once but writes every byte twice and needs scratch space as large as the
   biggest shard (a 1-rank target of a 1 TB checkpoint needs 1 TB of scratch).
2. reserve the header and seek back: the header's length is known in advance (checksums are
   fixed-width), but ``Storage.open_writer`` streams (S3 multipart cannot rewrite its first
   5 MiB part), so this only works on POSIX and splits the code in two.
3. two passes (chosen): pass 1 reads each chunk into one reusable buffer and keeps only its
   8-byte checksum; pass 2 writes the header, then reads each chunk again into the same buffer,
   checks it against the pass-1 checksum (what is written is exactly what was checksummed, even
   if the source changed underneath) and writes it. Chunks whose checksum is already known (a
   chunk that is a whole, already-verified source chunk) skip pass 1 entirely.

Option 3 reads the source at most twice, writes once, needs no scratch space, works the same
on every backend. Each chunk streams through one small buffer in pieces of whole rows
(``settings.STREAM_PIECE``, sized to stay in the CPU cache between copying and hashing), so
memory is that buffer, not even a whole tensor. Re-reads are cheap when the source sits in the
page cache; ``scripts/bench_reshard.py`` measures the cost. Reshard's pass 1, which also
checks the source chunks it reads, is ``ops.transform.reshard_source.checked_source_checksums``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ckptctl.errors import InvalidCheckpoint, RefusedForSafety
from ckptctl.format import dtypes
from ckptctl.format.layout import attempt_name, new_save_id
from ckptctl.format.checksum import Hasher, file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import Chunk, build_header
from ckptctl.settings import STREAM_PIECE, WRITE_PIECE
from ckptctl.state.buffers import TensorBuffer, tensor_bytes
from ckptctl.storage.base import Storage


@dataclass(frozen=True)
class ChunkSpec:
    """One region of a global tensor that a target shard will hold."""

    name: str
    dtype: str  # manifest dtype name
    shape: tuple[int, ...]  # the chunk's shape
    offsets: tuple[int, ...]  # where it starts in the global tensor
    checksum: str | None = None  # known already (a whole verified source chunk): no pass 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


# Fills ``out`` with the chunk's rows ``[row, row + len(out))`` (all of it for a 0-d chunk):
# ``out`` is contiguous, of the spec's dtype, shaped ``(rows, *spec.shape[1:])``.
Fill = Callable[[ChunkSpec, torch.Tensor, int], None]


@dataclass
class ShardWritten:
    file: FileEntry
    chunks: list[Chunk] = field(default_factory=list)
    bytes_read: int = 0  # source bytes read, both passes


def layout(specs: Sequence[ChunkSpec]) -> list[ChunkSpec]:
    """Largest element size first, then by name and offsets: every chunk's byte offset is a
    multiple of its element size (as in ``save.plan``), and the order is reproducible."""
    return sorted(specs, key=lambda s: (-dtypes.itemsize(s.dtype), s.name, s.offsets))


def pieces(spec: ChunkSpec, buf: TensorBuffer, piece_bytes: int | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, buffer view) for each run of whole rows of about ``piece_bytes`` (whole
    chunk when None; at least one row, so a single huge row is one piece)."""
    if not spec.shape or piece_bytes is None:
        yield 0, buf.view(spec.dtype, spec.shape)
        return
    rows = spec.shape[0]
    row_bytes = max(spec.nbytes // max(rows, 1), 1)
    step = max(1, piece_bytes // row_bytes)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        yield r, buf.view(spec.dtype, (n, *spec.shape[1:]))
    if rows == 0:
        yield 0, buf.view(spec.dtype, spec.shape)


def write_shard_streaming(
    storage: Storage,
    name: str,
    specs: Sequence[ChunkSpec],
    fill: Fill,
    *,
    rank: int,
    rank_state: dict[str, Any] | None = None,
    buffer: TensorBuffer | None = None,
    piece_bytes: int | None = STREAM_PIECE,
) -> ShardWritten:
    """Write shard ``name`` holding ``specs``, reading each chunk through ``fill`` in pieces of
    whole rows (``piece_bytes=None``: whole chunks, for sources that read whole tensors only)."""
    buf = buffer or TensorBuffer()
    ordered = layout(specs)
    result = ShardWritten(FileEntry(name, 0, "", rank, 0))
    checksums: list[str] = []
    for s in ordered:  # pass 1: checksums only
        if s.checksum is None:
            h = Hasher()
            for row, out in pieces(s, buf, piece_bytes):
                fill(s, out, row)
                h.update(tensor_bytes(out))
            result.bytes_read += s.nbytes
            checksums.append(h.hexdigest())
        else:
            checksums.append(s.checksum)
    pos, chunks = 0, []
    for s, c in zip(ordered, checksums):
        chunks.append(Chunk(s.name, s.dtype, s.shape, s.offsets, pos, pos + s.nbytes, c))
        pos += s.nbytes
    header = build_header(chunks, rank=rank, rank_state=rank_state)
    w = storage.open_writer(name)
    try:
        w.write(header)
        for s, c in zip(ordered, chunks):  # pass 2: read again, write, check
            h = Hasher()
            for row, out in pieces(s, buf, piece_bytes):
                fill(s, out, row)
                data = tensor_bytes(out)
                h.update(data)
                for p in range(0, len(data), WRITE_PIECE):
                    w.write(data[p : p + WRITE_PIECE])
            result.bytes_read += s.nbytes
            if h.hexdigest() != c.checksum:  # raising aborts the writer: nothing is published
                raise InvalidCheckpoint(
                    f"tensor {s.name!r} at offsets {list(s.offsets)}: source bytes changed between "
                    f"reads, or do not match the source checksum, while writing {storage.url_of(name)}",
                    hint="the source is being modified or is corrupt; verify it and retry",
                )
        # Never replacing a file (``docs/protocol.md``, "Every writer of a step"): a name taken
        # by another attempt (an interrupted run's leftover, a concurrent writer) is left alone
        # and this shard takes its attempt's name, which the manifest then records.
        fallback = attempt_name(name, new_save_id())
        taken = w.publish([fallback])
    except BaseException:
        w.abort()
        raise
    if taken is None:  # S3 multipart: the key was fixed before the bytes went out
        raise RefusedForSafety(f"{storage.url_of(name)} already exists: another writer is writing {storage.url}; "
                               "nothing was replaced", hint="let the other writer finish, or write into a new directory")
    result.file = FileEntry((name, fallback)[taken], len(header) + pos, file_checksum(header, checksums), rank, len(chunks))
    result.chunks = chunks
    return result
