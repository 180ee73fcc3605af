"""Reshard's pass 1 folded with its source check: the checksum of every target chunk, hashed
from source chunks that are each read whole and checked against their own checksum.

``ops.transform.stream_shard`` writes a shard in two passes (checksums first, then header and data).
For reshard, pass 1 reads the source anyway, so it is also where the source is verified: every
source chunk that overlaps a target chunk lacking a checksum is streamed whole through the
reader (``CheckpointReader.stream_chunk``, which checks it), and the target checksums are fed
from the same bytes. Verifying the source then costs no read of its own.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes
from ckptctl.format.checksum import Hasher
from ckptctl.format.geometry import Box, intersection
from ckptctl.load.reader import CheckpointReader, Located, ReadJob
from ckptctl.ops.transform.stream_shard import ChunkSpec, pieces
from ckptctl.progress import Progress
from ckptctl.settings import STREAM_PIECE, STREAM_THREADS
from ckptctl.state.buffers import TensorBuffer, tensor_bytes



def checked_source_checksums(reader: CheckpointReader, specs: Sequence[ChunkSpec], *, threads: int = STREAM_THREADS,
                             piece_bytes: int = STREAM_PIECE, progress: Progress | None = None) -> tuple[list[ChunkSpec], int]:
    """``specs`` with every missing checksum filled in, and the number of source bytes read.

    Every source chunk that overlaps a spec lacking a checksum is read once, whole, in
    ``piece_bytes`` pieces, and checked against its checksum (``InvalidCheckpoint`` naming the
    source otherwise). Specs that already carry a checksum (whole source chunks) are not read
    here: pass 2 checks them against that same source checksum before anything is committed.

    When a tensor's target and source chunks are all runs of whole rows (dim-0 splits and whole
    tensors), each target chunk is a contiguous byte range of the tensor's row-major bytes and
    its hasher is fed from the source pieces in order: one read in all (``_hash_rowwise``).
    Other tensors (column splits, 0-d) have their source chunks checked the same way, then
    their target chunks hashed through region reads: two reads (``_hash_by_regions``).
    Memory: one ``piece_bytes`` buffer per thread; work is spread over threads by tensor.
    """
    todo: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        if s.checksum is None:
            todo.setdefault(s.name, []).append(i)
    out = list(specs)
    local = threading.local()

    def one(name: str) -> int:
        mine = [specs[i] for i in todo[name]]
        locs = reader.chunks(name)
        if _rowwise(reader.tensor(name).shape, mine, locs):
            sums, nread = _hash_rowwise(reader, name, mine, locs, piece_bytes, progress)
        else:
            buf = getattr(local, "buf", None) or TensorBuffer()
            local.buf = buf
            sums, nread = _hash_by_regions(reader, mine, locs, buf, piece_bytes, progress)
        for i, checksum in zip(todo[name], sums):
            out[i] = dataclasses.replace(specs[i], checksum=checksum)
        return nread

    names = sorted(todo, key=lambda n: -sum(specs[i].nbytes for i in todo[n]))  # largest first: balanced threads
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptctl-hash") as pool:
        nread = sum(pool.map(one, names))
    return out, nread


def _rowwise(shape: tuple[int, ...], specs: Sequence[ChunkSpec], locs: Sequence[Located]) -> bool:
    """Whether every target and source chunk is a band of whole rows and the source bands tile
    the rows in order (``locs`` come sorted by offsets)."""
    if not shape:
        return False
    rest = tuple(shape[1:])
    bands = [(tuple(s.shape), tuple(s.offsets)) for s in specs] + [(tuple(loc.chunk.shape), tuple(loc.chunk.offsets)) for loc in locs]
    if not all(sh[1:] == rest and not any(off[1:]) for sh, off in bands):
        return False
    row = 0
    for loc in locs:
        if loc.chunk.offsets[0] != row:
            return False
        row += loc.chunk.shape[0]
    return row == shape[0]


def _checked(reader: CheckpointReader, loc: Located, piece_bytes: int, progress: Progress | None):
    """The pieces of source chunk ``loc``, checked when the last one has been handed out; a
    mismatch is reported as the source's."""
    try:
        for view in reader.stream_chunk(loc, piece_bytes):
            yield view
            if progress:
                progress(len(view))
    except InvalidCheckpoint as e:
        raise InvalidCheckpoint(
            f"{reader.storage.url}: the source failed verification: {e}",
            hint="run `ckptctl verify` on it; reshard a good checkpoint instead (`ckptctl latest`)",
        ) from None


def _hash_rowwise(reader: CheckpointReader, name: str, specs: Sequence[ChunkSpec], locs: Sequence[Located],
                  piece_bytes: int, progress: Progress | None) -> tuple[list[str], int]:
    """One read: each source chunk streamed in order, each piece fed to the target chunks
    whose byte range of the tensor's row-major bytes it overlaps."""
    t = reader.tensor(name)
    row_bytes = math.prod(t.shape[1:]) * dtypes.itemsize(t.dtype)
    ranges = [(s.offsets[0] * row_bytes, (s.offsets[0] + s.shape[0]) * row_bytes) for s in specs]
    hashers = [Hasher() for _ in specs]
    fed = [0 for _ in specs]
    nread = 0
    for loc in locs:
        base = loc.chunk.offsets[0] * row_bytes
        end = base + loc.chunk.shape[0] * row_bytes
        users = [k for k, (lo, hi) in enumerate(ranges) if max(lo, base) < min(hi, end)]
        if not users:
            continue  # no byte of this chunk is used here (another rank's, or an empty one)
        pos = base
        for view in _checked(reader, loc, piece_bytes, progress):
            for k in users:
                a, b = max(ranges[k][0], pos), min(ranges[k][1], pos + len(view))
                if a < b:
                    hashers[k].update(view[a - pos : b - pos])
                    fed[k] += b - a
            pos += len(view)
        nread += end - base
    for k, (lo, hi) in enumerate(ranges):
        if fed[k] != hi - lo:  # cannot happen once the rows tile; never write a wrong checksum
            raise InvalidCheckpoint(f"{reader.storage.url}: tensor {name!r}: source chunks cover {fed[k]} of {hi - lo} bytes",
                                    hint="run `ckptctl verify` on the source")
    return [h.hexdigest() for h in hashers], nread


def _hash_by_regions(reader: CheckpointReader, specs: Sequence[ChunkSpec], locs: Sequence[Located], buf: TensorBuffer,
                     piece_bytes: int, progress: Progress | None) -> tuple[list[str], int]:
    """Two reads: every source chunk a target chunk overlaps is checked whole, then each
    target chunk is hashed from region reads of those just-checked chunks (pass 2 compares
    what it writes with these digests, so the region reads need no check of their own)."""
    nread = 0
    boxes = [Box(tuple(s.offsets), tuple(s.shape)) for s in specs]
    for loc in locs:
        if any(intersection(loc.box, b) is not None for b in boxes):
            for _ in _checked(reader, loc, piece_bytes, progress):
                pass
            nread += loc.chunk.end - loc.chunk.begin
    sums = []
    for s in specs:
        h = Hasher()
        for r, view in pieces(s, buf, piece_bytes):
            offsets = (s.offsets[0] + r, *s.offsets[1:]) if s.offsets else s.offsets
            reader.read_into_unverified(ReadJob(s.name, view, offsets))
            h.update(tensor_bytes(view))
        nread += s.nbytes
        sums.append(h.hexdigest())
    return sums, nread
