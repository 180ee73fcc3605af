"""Filling one target region from the chunks of a checkpoint that overlap it, verifying every
chunk used: the core of ``CheckpointReader.read_into`` (see ``load.reader`` for how a read
chains to the marker and which bytes it reads).

It is a module of its own because it is one concept, the geometry of a fill (which rows of a
chunk are one run of the target, what is read only to be hashed, the GPU bounce path), apart
from the reader's opening of files and headers. Its functions take the reader as their first
argument; ``Source`` names what they use of it, because the reader imports this module and an
import back, even for a type hint, would be a cycle (``docs/architecture.md``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ckptctl.errors import InvalidCheckpoint, StateError
from ckptctl.format import dtypes
from ckptctl.format.checksum import Hasher
from ckptctl.format.geometry import Box, contiguous_in, fits, intersection
from ckptctl.format.manifest import TensorEntry
from ckptctl.load.bounce import BouncePool
from ckptctl.load.shard_index import Located, ReadJob, region_of
from ckptctl.settings import READ_STEP, STREAM_PIECE
from ckptctl.state.buffers import tensor_bytes
from ckptctl.storage.base import Storage

# Bytes of a chunk streamed at a time when only part of it is needed (the rest is read only to
# be hashed): cache-sized pieces, as reshard's, so hashing reads them from cache.
VERIFY_PIECE = STREAM_PIECE


class Source(Protocol):
    """What a fill uses of its ``load.reader.CheckpointReader``."""

    storage: Storage
    _bounce: dict[torch.device, BouncePool]  # GPU devices of the read_many in flight

    def tensor(self, name: str) -> TensorEntry: ...

    def locate(self, name: str, want: Box) -> list[Located]: ...

    def pread(self, file: str, offset: int, out: memoryview) -> None: ...

    def check_digest(self, loc: Located, got: str, name: str | None = None) -> None: ...

    def _piece(self, n: int) -> memoryview: ...


def check_target(reader: Source, job: ReadJob) -> None:
    entry = reader.tensor(job.name)
    target = job.target
    want = region_of(job)
    if target.dtype != dtypes.torch_dtype(entry.dtype):
        raise StateError(
            f"tensor {job.name!r}: checkpoint has {entry.dtype}, target is {dtypes.name_of(target.dtype)}",
            hint="cast after loading, or convert the checkpoint with `ckptctl convert --dtype`",
        )
    if not fits(want, entry.shape):
        raise StateError(
            f"tensor {job.name!r}: checkpoint shape {list(entry.shape)} does not fit the "
            f"target {list(target.shape)} at offsets {list(want.offsets)}",
            hint="the model's architecture differs from the checkpoint's; pass strict=False to skip mismatched tensors",
        )


def check_covered(reader: Source, job: ReadJob, covered: int) -> None:
    if covered != job.target.numel():
        raise InvalidCheckpoint(
            f"{reader.storage.url}: tensor {job.name!r}: saved chunks cover {covered} of the "
            f"{job.target.numel()} elements requested",
            hint="shards are missing from this checkpoint; run `ckptctl verify`",
        )


def fill_target(reader: Source, job: ReadJob, *, verify: bool) -> None:
    """Fill ``job.target`` from every chunk that overlaps its region, each chunk read whole and
    hashed when ``verify``, else only the bytes the target needs."""
    check_target(reader, job)
    target = job.target
    want = region_of(job)
    bounce = reader._bounce.get(target.device)
    if bounce is not None:
        _fill_through(reader, bounce, job, want, verify)
        return
    if target.device.type != "cpu" or not target.is_contiguous():
        # A bounce through host memory (pinned for a GPU target, so the copy is a DMA):
        # reads and hashing need contiguous CPU memory.
        pin = target.device.type == "cuda" and torch.cuda.is_available()
        host = torch.empty(target.shape, dtype=target.dtype, pin_memory=pin)
        fill_target(reader, ReadJob(job.name, host, want.offsets), verify=verify)
        target.copy_(host)
        return
    covered = 0
    for loc in reader.locate(job.name, want):
        part = intersection(loc.box, want)
        if part is not None:
            _copy_part(reader, job.name, loc, target, want, part, verify)
            covered += part.numel
    check_covered(reader, job, covered)


def _fill_through(reader: Source, bounce: BouncePool, job: ReadJob, want: Box, verify: bool) -> None:
    """A GPU target, through the pool's page-locked buffers: the rows of a chunk that are
    one run of the target are read from the file straight into those buffers, hashed
    there, and copied up (no pageable temporary of the tensor, no second memcpy); the
    rest of the chunk is read only to be hashed. Other parts (column splits, a
    non-contiguous target) go through a host temporary of that part only. A mismatch
    raises ``InvalidCheckpoint`` as on the CPU path, after some bytes may have gone up:
    the caller falls back and overwrites them (``load.into_state`` checked every chunk
    before this pass already)."""
    target = job.target
    covered = 0
    for loc in reader.locate(job.name, want):
        part = intersection(loc.box, want)
        if part is None:
            continue
        covered += part.numel
        c, cbox, at = loc.chunk, loc.box, part.relative_to(want)
        dst = target[at.slices()]
        in_chunk = part.relative_to(cbox)
        whole_rows = cbox.ndim == 0 or in_chunk.shape[1:] == cbox.shape[1:]
        if not (whole_rows and contiguous_in(at, Box((0,) * want.ndim, want.shape)) and dst.is_contiguous()):
            host = torch.empty(tuple(part.shape), dtype=target.dtype)
            _copy_part(reader, job.name, loc, host, part, part, verify)
            bounce.upload(host, dst)
            continue
        row_bytes = (c.end - c.begin) // max(cbox.shape[0] if cbox.ndim else 1, 1)
        r0, r1 = (in_chunk.offsets[0], in_chunk.end[0]) if cbox.ndim else (0, 1)
        start, end = loc.byte_range
        lo, hi = start + r0 * row_bytes, start + r1 * row_bytes
        h = Hasher() if verify and c.checksum is not None else None
        if h is not None:
            _hash_range(reader, loc.file, start, lo, h)

        def fill(out: torch.Tensor, offset: int, lo: int = lo, file: str = loc.file, h: Hasher | None = h) -> None:
            view = tensor_bytes(out)
            reader.pread(file, lo + offset, view)
            if h is not None:  # in file order: the pool fills its buffers in order
                h.update(view)

        bounce.upload_from(fill, dst)
        if h is not None:
            _hash_range(reader, loc.file, hi, end, h)
            reader.check_digest(loc, h.hexdigest(), job.name)
    check_covered(reader, job, covered)


def _copy_part(reader: Source, name: str, loc: Located, target: torch.Tensor, want: Box, part: Box, verify: bool) -> None:
    """Copy region ``part`` (global coordinates) of chunk ``loc`` into ``target`` (which
    holds region ``want``), reading and hashing the whole chunk when ``verify``."""
    c = loc.chunk
    verify = verify and c.checksum is not None
    cbox = loc.box
    dst = target[part.relative_to(want).slices()]
    in_chunk = part.relative_to(cbox)
    rows = cbox.shape[0] if cbox.ndim else 1
    row_bytes = (c.end - c.begin) // max(rows, 1)
    r0, r1 = (in_chunk.offsets[0], in_chunk.end[0]) if cbox.ndim else (0, 1)
    whole_rows = cbox.ndim == 0 or in_chunk.shape[1:] == cbox.shape[1:]
    start, end = loc.byte_range
    if whole_rows and contiguous_in(part.relative_to(want), Box((0,) * want.ndim, want.shape)) and dst.is_contiguous():
        # The needed rows are one run in the file and in the target: read them in place.
        lo, hi = start + r0 * row_bytes, start + r1 * row_bytes
        h = Hasher() if verify else None
        if h is not None:
            _hash_range(reader, loc.file, start, lo, h)
        mid = tensor_bytes(dst)
        for a in range(0, len(mid), READ_STEP):  # each step hashed while it is in the CPU's cache
            step = mid[a : a + READ_STEP]
            reader.pread(loc.file, lo + a, step)
            if h is not None:
                h.update(step)
        if h is not None:
            _hash_range(reader, loc.file, hi, end, h)
            reader.check_digest(loc, h.hexdigest(), name)
        return
    # Rows through the piece buffer; the needed columns of each are copied out of it.
    first, last = (0, rows) if verify else (r0, r1)
    step = max(1, VERIFY_PIECE // max(row_bytes, 1))
    h = Hasher() if verify else None
    cols = in_chunk.slices()[1:]
    for a in range(first, last, step):
        b = min(a + step, last)
        piece = reader._piece((b - a) * row_bytes)
        reader.pread(loc.file, start + a * row_bytes, piece)
        if h is not None:
            h.update(piece)
        lo, hi = max(a, r0), min(b, r1)
        if lo < hi:
            rows_view = torch.frombuffer(piece, dtype=target.dtype).view(b - a, *cbox.shape[1:])
            dst[lo - r0 : hi - r0].copy_(rows_view[(slice(lo - a, hi - a), *cols)])
    if h is not None:
        reader.check_digest(loc, h.hexdigest(), name)


def _hash_range(reader: Source, file: str, lo: int, hi: int, h: Hasher) -> None:
    for pos in range(lo, hi, VERIFY_PIECE):
        piece = reader._piece(min(VERIFY_PIECE, hi - pos))
        reader.pread(file, pos, piece)
        h.update(piece)
