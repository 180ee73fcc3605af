"""Which shard holds which part of a tensor: a committed checkpoint's manifest, and its shard
headers opened on demand.

The chunk index lives in the shard headers (one per rank, each O(tensors)), so opening every
header costs every rank O(ranks x tensors). The manifest's placement hints
(``TensorEntry.owner``/``split``, recorded at save time from a proof the ranks build together,
see ``save.shard_layout.placement_columns``) say which rank's file holds which block of a
tensor, so a read opens only the headers of the shards that can overlap its region: a rank
loading its FSDP shard opens one or two, whatever the number of ranks. A tensor without hints
(an older checkpoint, an irregular sharding) opens every header once; a hint the headers
disagree with does too, so a wrong hint costs time, never correctness. Each header opened is
bound to the manifest by its file checksum before any of its chunks is used.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from ckptctl.errors import InvalidCheckpoint, StateError
from ckptctl.format.geometry import Box, intersection
from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry
from ckptctl.format.shard import Chunk, ShardHeader
from ckptctl.format.shard_identity import header_mismatch
from ckptctl.layouts.native_read import read_committed, read_header
from ckptctl.settings import IO_THREADS
from ckptctl.storage.base import Storage

T = TypeVar("T")


@dataclass(frozen=True)
class Located:
    """One saved chunk and where its bytes are: file ``file``, from ``data_start + chunk.begin``."""

    file: str
    data_start: int
    chunk: Chunk

    @property
    def box(self) -> Box:
        """The region of the global tensor the chunk holds."""
        return Box(tuple(self.chunk.offsets), tuple(self.chunk.shape))

    @property
    def byte_range(self) -> tuple[int, int]:
        """The chunk's bytes in its file, [start, end)."""
        return self.data_start + self.chunk.begin, self.data_start + self.chunk.end


@dataclass(frozen=True)
class ReadJob:
    """Fill ``target`` with the region of tensor ``name`` that starts at ``offsets`` (the
    origin when None); ``target`` has the tensor's dtype, any device and any strides."""

    name: str
    target: torch.Tensor
    offsets: tuple[int, ...] | None = None


def region_of(job: ReadJob) -> Box:
    """The region of the global tensor ``job`` fills."""
    shape = tuple(job.target.shape)
    return Box(tuple(job.offsets) if job.offsets is not None else tuple(0 for _ in shape), shape)


def file_runs(items: Sequence[T], loc_of: Callable[[T], Located], cap: int) -> list[list[T]]:
    """``items`` (each with chunk ``loc_of(item)``) in file order, grouped into runs of chunks
    adjacent in one file, each run at most ``cap`` bytes (a chunk larger than ``cap`` is a run
    of its own): the units a load reads front to back, one call or one sequential stream each."""
    runs: list[list[T]] = []
    end: tuple[str, int] | None = None  # where the current run ends
    size = 0
    for item in sorted(items, key=lambda i: (loc_of(i).file, loc_of(i).byte_range[0])):
        loc = loc_of(item)
        start, stop = loc.byte_range
        if runs and end == (loc.file, start) and size + stop - start <= cap:
            runs[-1].append(item)
            size += stop - start
        else:
            runs.append([item])
            size = stop - start
        end = (loc.file, stop)
    return runs


class ShardIndex:
    """A committed checkpoint's manifest and, on demand, its shard headers (see the module
    docstring). ``headers_read`` counts the headers opened so far."""

    def __init__(self, ckpt: Storage, *, verify_checksums: bool = True) -> None:
        self.storage = ckpt
        self.verify_checksums = verify_checksums
        self.manifest: Manifest = read_committed(ckpt)[0]
        self._lock = threading.Lock()
        self._by_rank: dict[int, list[FileEntry]] = {}
        for f in self.manifest.files:
            self._by_rank.setdefault(f.rank, []).append(f)
        self._headers: dict[str, ShardHeader] = {}
        self._index: dict[str, list[Located]] = {}
        self._all_open = False
        self.headers_read = 0

    def _open_header(self, f: FileEntry) -> ShardHeader:
        """The header of ``f``, checked against the manifest: size, and file checksum."""
        h = read_header(self.storage, f.name)
        actual = h.data_start + h.data_size
        if actual != f.size:
            raise InvalidCheckpoint(
                f"{self.storage.url_of(f.name)}: file has {actual} bytes, manifest says {f.size}",
                hint="the shard is truncated or was replaced; run `ckptctl verify` for details",
            )
        why = header_mismatch(h, f)  # no data read, no field used yet: see ``format.shard_identity``
        if why is not None:
            raise InvalidCheckpoint(
                f"{self.storage.url_of(f.name)}: {why}",
                hint="the shard is corrupt, belongs to another save or was modified after commit; resume from an older checkpoint",
            )
        return h

    def _ensure(self, files: Sequence[FileEntry]) -> None:
        """Open (in parallel) and index the headers of ``files`` not open yet."""
        with self._lock:
            todo = list({f.name: f for f in files if f.name not in self._headers}.values())
        if not todo:
            return
        if len(todo) == 1:
            opened = [self._open_header(todo[0])]
        else:
            with ThreadPoolExecutor(min(IO_THREADS, len(todo))) as pool:
                opened = list(pool.map(self._open_header, todo))
        with self._lock:
            touched: set[str] = set()
            for f, h in zip(todo, opened):
                if f.name in self._headers:  # another thread opened it meanwhile
                    continue
                self._headers[f.name] = h
                self.headers_read += 1
                for c in h.chunks:
                    self._index.setdefault(c.name, []).append(Located(f.name, h.data_start, c))
                    touched.add(c.name)
            for name in touched:
                self._index[name].sort(key=lambda loc: tuple(loc.chunk.offsets))

    def _open_all(self) -> None:
        if not self._all_open:
            self._ensure(self.manifest.files)
            self._all_open = True

    def files_for(self, name: str, want: Box | None = None) -> list[FileEntry] | None:
        """The shard files that can hold chunks of tensor ``name`` overlapping region ``want``
        (the whole tensor when None), from the manifest's placement hints; None when the
        manifest gives none for it (then any file may)."""
        t = self.manifest.tensors.get(name)
        if t is None:
            return []
        if t.owner is not None:
            return list(self._by_rank.get(t.owner, ()))
        if t.split is None:
            return None
        dim, block = t.split
        lo, hi = (0, t.shape[dim]) if want is None else (want.offsets[dim], want.end[dim])
        if hi <= lo:
            return []
        return [f for r in range(lo // block, (hi - 1) // block + 1) for f in self._by_rank.get(r, ())]

    @property
    def headers(self) -> dict[str, ShardHeader]:
        """Every shard's header (file name -> header, in manifest order), all opened now."""
        self._open_all()
        return {f.name: self._headers[f.name] for f in self.manifest.files}

    # --- metadata ---------------------------------------------------------------------------

    def tensor(self, name: str) -> TensorEntry:
        """The manifest's entry for tensor ``name``; ``StateError`` when the checkpoint lacks it."""
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise StateError(
                f"tensor {name!r} is not in checkpoint {self.storage.url}",
                hint="pass strict=False to load the tensors that exist",
            ) from None

    def chunks(self, name: str) -> list[Located]:
        """Where tensor ``name``'s saved chunks are, ordered by their offsets (empty for a
        tensor the checkpoint lacks)."""
        files = self.files_for(name)
        if files is None:
            self._open_all()
        else:
            self._ensure(files)
        return list(self._index.get(name, ()))

    def locate(self, name: str, want: Box) -> list[Located]:
        """The saved chunks of tensor ``name`` that overlap region ``want``, ordered by their
        offsets, opening only the headers that can hold them. When the hinted shards do not
        cover ``want`` (a hint that does not hold), every header is opened and searched."""
        if want.numel == 0:
            return []
        files = self.files_for(name, want)
        if files is None:
            self._open_all()
        else:
            self._ensure(files)
        found = self._overlapping(name, want)
        if not self._all_open and sum(intersection(loc.box, want).numel for loc in found) != want.numel:  # type: ignore[union-attr]
            self._open_all()
            found = self._overlapping(name, want)
        return found

    def _overlapping(self, name: str, want: Box) -> list[Located]:
        with self._lock:
            locs = list(self._index.get(name, ()))
        return [loc for loc in locs if intersection(loc.box, want) is not None]

    def prefetch(self, jobs: Sequence[ReadJob]) -> None:
        """Open, in parallel, every header ``jobs`` will need (``read_many`` does it first)."""
        need: dict[str, FileEntry] = {}
        for j in jobs:
            t = self.manifest.tensors.get(j.name)
            if t is None:
                continue
            want = region_of(j)
            if want.numel == 0:
                continue
            files = self.files_for(j.name, want)
            if files is None:
                self._open_all()
                return
            need.update((f.name, f) for f in files)
        self._ensure(list(need.values()))

    def rank_states(self, ranks: Sequence[int] | None = None) -> dict[int, dict]:
        """Per-rank state (RNG, data loader) by the rank that saved it: of ``ranks`` only
        (opening only their shards' headers), or of every rank when None."""
        if ranks is None:
            self._open_all()
        else:
            self._ensure([f for r in ranks for f in self._by_rank.get(r, ())])
        with self._lock:
            headers = list(self._headers.values())
        return {
            h.rank: h.rank_state for h in headers
            if h.rank is not None and h.rank_state and (ranks is None or h.rank in ranks)
        }

