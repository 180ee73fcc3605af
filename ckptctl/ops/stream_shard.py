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
(``PIECE``), so memory is that buffer, not even a whole tensor. Re-reads are cheap when the
source sits in the page cache; ``scripts/bench_reshard.py`` measures the cost (reshard also
verifies its result, one more read, because it promises it). Reshard's pass 1 is
``checked_source_checksums``: it reads whole source chunks, checks each against its source
checksum and hashes the target chunks from the same bytes, so verifying the source costs no
read of its own.

Measured on the development machine (2 CPUs, ext4, 2 GiB in 64 MiB tensors), and kept or
dropped accordingly: 4 MiB pieces instead of whole chunks, 2.5x faster (cache-sized pieces);
pass 1 for all of a rank's chunks on 4 threads (``with_checksums``), ~8% faster; a reader
thread prefetching the next piece during pass 2, ~15% slower (two cores already busy with
the kernel's copies), so not kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes
from ckptctl.format.checksum import Hasher, file_checksum
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard import Chunk, build_header
from ckptctl.interop.base import TensorBuffer, byte_view
from ckptctl.storage.base import Storage

WRITE_PIECE = 64 << 20


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

PIECE = 4 << 20  # measured: 4 MiB pieces stay in cache; 64 MiB ones ran 2.5x slower end to end


@dataclass
class ShardWritten:
    file: FileEntry
    chunks: list[Chunk] = field(default_factory=list)
    bytes_read: int = 0  # source bytes read, both passes


def layout(specs: Sequence[ChunkSpec]) -> list[ChunkSpec]:
    """Largest element size first, then by name and offsets: every chunk's byte offset is a
    multiple of its element size (as in ``save.plan``), and the order is reproducible."""
    return sorted(specs, key=lambda s: (-dtypes.itemsize(s.dtype), s.name, s.offsets))


class ChunkBuffer(TensorBuffer):
    """One reusable byte buffer, viewed as each piece of each chunk."""


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


def with_checksums(specs: Sequence[ChunkSpec], fill: Fill, *, threads: int = 4, piece_bytes: int = PIECE) -> list[ChunkSpec]:
    """Pass 1 for many chunks at once: the checksum of every spec that lacks one, computed by
    ``threads`` workers (preads and hashing release the GIL), each with one piece buffer."""
    import dataclasses
    import threading
    from concurrent.futures import ThreadPoolExecutor

    local = threading.local()

    def one(spec: ChunkSpec) -> ChunkSpec:
        if spec.checksum is not None:
            return spec
        buf = getattr(local, "buf", None) or TensorBuffer()
        local.buf = buf
        h = Hasher()
        for row, out in pieces(spec, buf, piece_bytes):
            fill(spec, out, row)
            h.update(byte_view(out))
        return dataclasses.replace(spec, checksum=h.hexdigest())

    with ThreadPoolExecutor(threads, thread_name_prefix="ckptctl-hash") as pool:
        return list(pool.map(one, specs))


def write_shard_streaming(
    storage: Storage,
    name: str,
    specs: Sequence[ChunkSpec],
    fill: Fill,
    *,
    rank: int,
    rank_state: dict[str, Any] | None = None,
    buffer: ChunkBuffer | None = None,
    piece_bytes: int | None = PIECE,
) -> ShardWritten:
    """Write shard ``name`` holding ``specs``, reading each chunk through ``fill`` in pieces of
    whole rows (``piece_bytes=None``: whole chunks, for sources that read whole tensors only)."""
    buf = buffer or ChunkBuffer()
    ordered = layout(specs)
    result = ShardWritten(FileEntry(name, 0, "", rank, 0))
    checksums: list[str] = []
    for s in ordered:  # pass 1: checksums only
        if s.checksum is None:
            h = Hasher()
            for row, out in pieces(s, buf, piece_bytes):
                fill(s, out, row)
                h.update(byte_view(out))
            result.bytes_read += s.nbytes
            checksums.append(h.hexdigest())
        else:
            checksums.append(s.checksum)
    pos, chunks = 0, []
    for s, c in zip(ordered, checksums):
        chunks.append(Chunk(s.name, s.dtype, s.shape, s.offsets, pos, pos + s.nbytes, c))
        pos += s.nbytes
    header = build_header(chunks, rank=rank, rank_state=rank_state)
    with storage.open_writer(name) as w:  # an exception aborts: no partial file is published
        w.write(header)
        for s, c in zip(ordered, chunks):  # pass 2: read again, write, check
            h = Hasher()
            for row, out in pieces(s, buf, piece_bytes):
                fill(s, out, row)
                data = byte_view(out)
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
    result.file = FileEntry(name, len(header) + pos, file_checksum(header, checksums), rank, len(chunks))
    result.chunks = chunks
    return result


def checked_source_checksums(reader: Any, specs: Sequence[ChunkSpec], *, threads: int = 4, piece_bytes: int = PIECE,
                             progress: Callable[[int], None] | None = None) -> tuple[list[ChunkSpec], int]:
    """Pass 1 folded with the source check: ``specs`` with every missing checksum filled in,
    and the number of source bytes read. ``reader`` is an open ``CheckpointReader``.

    Every source chunk that overlaps a spec lacking a checksum is read once, whole, in
    ``piece_bytes`` pieces, and its digest is checked against the source chunk's checksum
    (``InvalidCheckpoint`` otherwise); the target checksums are hashed from the same bytes.
    Specs that already carry a checksum (whole source chunks) are not read here: pass 2 checks
    them against that same source checksum before the result is committed.

    When a tensor's target chunks and source chunks are all runs of whole rows (dim-0 splits,
    and whole tensors) each target chunk is a contiguous byte range of the tensor's row-major
    bytes, so its hasher is fed from the source pieces in order: one read in all. Other
    tensors (column splits, 0-d) check their source chunks the same way, then hash the target
    chunks through ``fill``-style region reads, as ``with_checksums`` does: two reads.
    Memory: one ``piece_bytes`` buffer per thread; work is spread over threads by tensor
    (a tensor's source chunks are read in order, so its target hashers see bytes in order).
    """
    import dataclasses
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ckptctl.load.reader import ReadJob

    local = threading.local()
    todo: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        if s.checksum is None:
            todo.setdefault(s.name, []).append(i)
    out = list(specs)

    def buffer(n: int) -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < n:
            buf = local.buf = bytearray(n)
        return memoryview(buf)[:n]

    def check_chunk(loc: Any, feed: Callable[[int, memoryview], None] | None) -> int:
        """Read source chunk ``loc`` whole, piece by piece; ``feed(byte offset in chunk, piece)``."""
        c = loc.chunk
        size = c.end - c.begin
        h = Hasher()
        for p in range(0, size, piece_bytes):
            view = buffer(min(piece_bytes, size - p))
            reader._pread(loc.file, loc.data_start + c.begin + p, view)
            h.update(view)
            if feed is not None:
                feed(p, view)
            if progress:
                progress(len(view))
        # A chunk without a checksum (an old writer's) is covered by its file checksum instead:
        # reshard verifies such a source in full before this pass.
        if c.checksum is not None and h.hexdigest() != c.checksum:
            raise InvalidCheckpoint(
                f"{reader.storage.url}: the source failed verification: {loc.file}: tensor {c.name!r} "
                f"(bytes {loc.data_start + c.begin}-{loc.data_start + c.end}) does not match its checksum",
                hint="run `ckptctl verify` on it; reshard a good checkpoint instead (`ckptctl latest`)",
            )
        return size

    def overlaps(c: Any, s: ChunkSpec) -> bool:
        return all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(c.offsets, c.shape, s.offsets, s.shape)) if s.shape else True

    def one(name: str) -> int:
        idx = todo[name]
        t = reader.manifest.tensors[name]
        locs = sorted(reader.index.get(name, []), key=lambda loc: tuple(loc.chunk.offsets))
        rest = tuple(t.shape[1:])
        rowwise = len(t.shape) >= 1 and all(tuple(specs[i].shape[1:]) == rest and not any(specs[i].offsets[1:]) for i in idx) \
            and all(tuple(loc.chunk.shape[1:]) == rest and not any(loc.chunk.offsets[1:]) for loc in locs)
        if rowwise:  # the source chunks must tile the rows exactly, in order
            row = 0
            for loc in locs:
                rowwise = rowwise and loc.chunk.offsets[0] == row
                row = loc.chunk.offsets[0] + loc.chunk.shape[0]
            rowwise = rowwise and row == t.shape[0]
        nread = 0
        if not rowwise:
            for loc in locs:
                if any(overlaps(loc.chunk, specs[i]) for i in idx):
                    nread += check_chunk(loc, None)
            buf = TensorBuffer()
            for i in idx:
                s = specs[i]
                h = Hasher()
                for r, view in pieces(s, buf, piece_bytes):
                    offsets = (s.offsets[0] + r, *s.offsets[1:]) if s.offsets else s.offsets
                    reader.read_into(ReadJob(s.name, view, offsets))
                    h.update(byte_view(view))
                nread += s.nbytes
                out[i] = dataclasses.replace(s, checksum=h.hexdigest())
            return nread
        row_bytes = math.prod(rest) * dtypes.itemsize(t.dtype)
        # Each target chunk as a byte range [lo, hi) of the tensor's row-major bytes.
        ranges = [(specs[i].offsets[0] * row_bytes, (specs[i].offsets[0] + specs[i].shape[0]) * row_bytes, i) for i in idx]
        hashers = {i: Hasher() for i in idx}
        fed = {i: 0 for i in idx}
        for loc in locs:
            base = loc.chunk.offsets[0] * row_bytes
            end = base + loc.chunk.shape[0] * row_bytes
            mine = [(lo, hi, i) for lo, hi, i in ranges if max(lo, base) < min(hi, end) or (lo == hi == base)]
            if not any(lo < hi for lo, hi, _ in mine):
                continue  # no byte of this chunk is used here (another rank's, or an empty one)

            def feed(p: int, view: memoryview, base: int = base, mine: list = mine) -> None:
                a0, a1 = base + p, base + p + len(view)
                for lo, hi, i in mine:
                    a, b = max(lo, a0), min(hi, a1)
                    if a < b:
                        hashers[i].update(view[a - a0 : b - a0])
                        fed[i] += b - a

            nread += check_chunk(loc, feed)
        for lo, hi, i in ranges:
            if fed[i] != hi - lo:  # cannot happen once the rows tile; never write a wrong checksum
                raise InvalidCheckpoint(f"{reader.storage.url}: tensor {name!r}: source chunks cover {fed[i]} of {hi - lo} bytes")
            out[i] = dataclasses.replace(specs[i], checksum=hashers[i].hexdigest())
        return nread

    names = sorted(todo, key=lambda n: -sum(specs[i].nbytes for i in todo[n]))  # largest first: balanced threads
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptctl-hash") as pool:
        nread = sum(pool.map(one, names))
    return out, nread
