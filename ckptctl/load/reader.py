"""Reading tensors, or regions of them, out of a committed checkpoint.

For each target region the reader finds the saved chunks that overlap it and reads exactly the
overlapping bytes with ranged reads, straight into the target's memory when the layouts allow
(a whole chunk, or whole rows of it) and through a bounded temporary otherwise. A read that
covers a whole chunk is checked against the chunk's checksum, so a resume never trains on
corrupt bytes. The same code serves loading at a different world size and offline reshard.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from ckptctl.errors import InvalidCheckpoint, StateError
from ckptctl.format import dtypes
from ckptctl.format.checkpoint import read_committed, read_header
from ckptctl.format.checksum import digest
from ckptctl.format.manifest import Manifest
from ckptctl.format.shard import Chunk, ShardHeader
from ckptctl.storage.base import Reader, Storage

IO_THREADS = 8


@dataclass(frozen=True)
class Located:
    file: str
    data_start: int
    chunk: Chunk


@dataclass(frozen=True)
class ReadJob:
    """Fill ``target`` with the region of tensor ``name`` that starts at ``offsets``."""

    name: str
    target: torch.Tensor
    offsets: tuple[int, ...] | None = None


class CheckpointReader:
    """Open one committed checkpoint: marker, manifest and every shard header.

    >>> with CheckpointReader(open_storage("/ckpt/step-0000001000")) as r:  # doctest: +SKIP
    ...     w = r.read("model/fc.weight")
    """

    def __init__(self, ckpt: Storage, *, verify_checksums: bool = True) -> None:
        self.storage = ckpt
        self.verify_checksums = verify_checksums
        self.manifest: Manifest = read_committed(ckpt)[0]
        self._readers: dict[str, Reader] = {}
        self._lock = threading.Lock()
        with ThreadPoolExecutor(IO_THREADS) as pool:
            headers = list(pool.map(self._header, [f.name for f in self.manifest.files]))
        self.headers: dict[str, ShardHeader] = dict(zip((f.name for f in self.manifest.files), headers))
        self.index: dict[str, list[Located]] = {}
        for fname, h in self.headers.items():
            for c in h.chunks:
                self.index.setdefault(c.name, []).append(Located(fname, h.data_start, c))

    def _header(self, name: str) -> ShardHeader:
        expected = next(f.size for f in self.manifest.files if f.name == name)
        h = read_header(self.storage, name)
        actual = h.data_start + h.data_size
        if actual != expected:
            raise InvalidCheckpoint(
                f"{self.storage.url_of(name)}: file has {actual} bytes, manifest says {expected}",
                hint="the shard is truncated or was replaced; run `ckptctl verify` for details",
            )
        return h

    def rank_states(self) -> dict[int, dict]:
        return {h.rank: h.rank_state for h in self.headers.values() if h.rank is not None and h.rank_state}

    # --- reads ----------------------------------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """The whole global tensor, newly allocated."""
        t = self._entry(name)
        out = torch.empty(t.shape, dtype=dtypes.torch_dtype(t.dtype))
        self.read_into(ReadJob(name, out))
        return out

    def read_many(self, jobs: Sequence[ReadJob]) -> None:
        """Fill many targets, in parallel (ranged reads and hashing release the GIL)."""
        if len(jobs) <= 1:
            for j in jobs:
                self.read_into(j)
            return
        with ThreadPoolExecutor(IO_THREADS) as pool:
            for f in [pool.submit(self.read_into, j) for j in jobs]:
                f.result()

    def read_into(self, job: ReadJob) -> None:
        entry = self._entry(job.name)
        target = job.target
        offsets = job.offsets or tuple(0 for _ in target.shape)
        want = dtypes.torch_dtype(entry.dtype)
        if target.dtype != want:
            raise StateError(
                f"tensor {job.name!r}: checkpoint has {entry.dtype}, target is {dtypes.name_of(target.dtype)}",
                hint="cast after loading, or convert the checkpoint with `ckptctl convert --dtype`",
            )
        if len(offsets) != len(entry.shape) or target.dim() != len(entry.shape) or any(
            o + s > g for o, s, g in zip(offsets, target.shape, entry.shape)
        ):
            raise StateError(
                f"tensor {job.name!r}: checkpoint shape {list(entry.shape)} does not fit the "
                f"target {list(target.shape)} at offsets {list(offsets)}",
                hint="the model's architecture differs from the checkpoint's; pass strict=False to skip mismatched tensors",
            )
        if target.device.type != "cpu":
            host = torch.empty(target.shape, dtype=target.dtype, pin_memory=torch.cuda.is_available())
            self.read_into(ReadJob(job.name, host, offsets))
            target.copy_(host)
            return
        if not target.is_contiguous():
            tmp = torch.empty(target.shape, dtype=target.dtype)
            self.read_into(ReadJob(job.name, tmp, offsets))
            target.copy_(tmp)
            return
        covered = 0
        for loc in self.index.get(job.name, []):
            covered += self._copy_overlap(job.name, loc, target, offsets)
        if covered != target.numel():
            raise InvalidCheckpoint(
                f"{self.storage.url}: tensor {job.name!r}: saved chunks cover {covered} of the "
                f"{target.numel()} elements requested",
                hint="shards are missing from this checkpoint; run `ckptctl verify --load`",
            )

    def _entry(self, name: str):
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise StateError(
                f"tensor {name!r} is not in checkpoint {self.storage.url}",
                hint="pass strict=False to load the tensors that exist",
            ) from None

    def _copy_overlap(self, name: str, loc: Located, target: torch.Tensor, toff: tuple[int, ...]) -> int:
        c = loc.chunk
        lo = [max(a, b) for a, b in zip(c.offsets, toff)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(c.offsets, c.shape, toff, target.shape)]
        if any(h <= l for l, h in zip(lo, hi)):
            return 0
        n = math.prod(h - l for l, h in zip(lo, hi))
        whole_chunk = all(l == o and h == o + s for l, h, o, s in zip(lo, hi, c.offsets, c.shape))
        if whole_chunk and tuple(c.shape) == tuple(target.shape):
            return self._read_whole(name, loc, target)
        row = math.prod(c.shape[1:]) * target.element_size()
        r0, r1 = lo[0] - c.offsets[0], hi[0] - c.offsets[0]  # rows of the chunk we need
        start = loc.data_start + c.begin + r0 * row
        full_rows = all(l == o and h == o + s for l, h, o, s in zip(lo[1:], hi[1:], c.offsets[1:], c.shape[1:]))
        same_rows = tuple(target.shape[1:]) == tuple(c.shape[1:])
        if full_rows and same_rows:
            # Row-sharded on both sides (FSDP-style): the overlap is contiguous in the file and
            # in the target, so it is read straight into place.
            t0 = lo[0] - toff[0]
            self._pread(loc.file, start, _bytes_of(target[t0 : t0 + (r1 - r0)]))
            return n
        tmp = torch.empty((r1 - r0, *c.shape[1:]), dtype=target.dtype)
        self._pread(loc.file, start, _bytes_of(tmp))
        src = tmp[(slice(None),) + tuple(slice(l - o, h - o) for l, h, o in zip(lo[1:], hi[1:], c.offsets[1:]))]
        dst = target[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, toff))]
        dst.copy_(src)
        return n

    def _read_whole(self, name: str, loc: Located, target: torch.Tensor) -> int:
        c = loc.chunk
        buf = _bytes_of(target)
        self._pread(loc.file, loc.data_start + c.begin, buf)
        if self.verify_checksums and c.checksum is not None and digest(buf) != c.checksum:
            raise InvalidCheckpoint(
                f"{self.storage.url_of(loc.file)}: tensor {name!r} (bytes {loc.data_start + c.begin}-"
                f"{loc.data_start + c.end}) does not match its checksum",
                hint="the shard is corrupt; resume from an older checkpoint (`ckptctl latest`)",
            )
        return target.numel()

    def _pread(self, file: str, offset: int, out: memoryview) -> None:
        if len(out):
            self._reader(file).read_into(offset, out)

    def _reader(self, file: str) -> Reader:
        with self._lock:
            r = self._readers.get(file)
            if r is None:
                r = self._readers[file] = self.storage.open_reader(file)
            return r

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")

