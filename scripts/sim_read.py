"""The read side of ``sim_scale.py``: a synthetic FSDP checkpoint in memory, and the metadata
work of loading, resuming, verifying and pruning it, counted in bytes and timed.

The checkpoint is real as far as the readers can tell (manifest and marker written by
``layouts.native_commit.commit``, shard headers built by ``format.shard.build_header`` and parsed by
the real readers) but its shard headers are generated when read and its data is never
materialised: only metadata is measured. Each chunk carries a made-up digest (its data is never
read, so no reader can tell) and each manifest entry the file checksum those digests and the
header imply, so the headers bind to the manifest as a real save's do
(``format.shard_identity``). Building the root therefore generates every header once; only
the reads are measured.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

from ckptctl.errors import NotFound
from ckptctl.format.checksum import file_checksum
from ckptctl.format.geometry import Box
from ckptctl.format.layout import shard_name, step_dir
from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry
from ckptctl.format.shard import Chunk, build_header
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, newest_committed, newest_marked
from ckptctl.layouts.native_commit import commit
from ckptctl.layouts.native_read import read_committed
from ckptctl.load.shard_index import ShardIndex
from ckptctl.layouts.native_check import coverage
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer

ROWS, COLS = 16384, 1024
ITEM = 2  # bfloat16


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0
        self.opens = 0


class _MemReader(Reader):
    def __init__(self, data: bytes, size: int, counter: _Counter) -> None:
        self._data, self.size, self._counter = data, size, counter

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        n = len(out)
        got = self._data[offset : offset + n]
        out[: len(got)] = got
        out[len(got) :] = bytes(n - len(got))  # the data section is zeros, never stored
        self._counter.bytes += n

    def close(self) -> None:
        pass


class _MemWriter(Writer):
    def __init__(self, store: "MemStorage", key: str) -> None:
        self._store, self._key, self._parts = store, key, []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._parts.append(bytes(data))

    def commit(self) -> None:
        self._store.write_atomic(self._key, b"".join(self._parts))

    def abort(self) -> None:
        self._parts.clear()


class MemStorage(Storage):
    """An in-memory root counting bytes read; ``virtual`` files are generated when opened
    (key -> (size, function returning the file's stored prefix))."""

    def __init__(self, files: dict[str, bytes], virtual: dict[str, tuple[int, Callable[[], bytes]]],
                 counter: _Counter, prefix: str = "") -> None:
        self.files, self.virtual, self.counter, self.prefix = files, virtual, counter, prefix
        self.url = "mem://sim/" + prefix

    def _k(self, key: str) -> str:
        return self.prefix + key

    def sub(self, key: str) -> "MemStorage":
        return MemStorage(self.files, self.virtual, self.counter, self._k(key) + "/")

    def _all(self) -> Iterator[tuple[str, int]]:
        yield from ((k, len(v)) for k, v in self.files.items())
        yield from ((k, v[0]) for k, v in self.virtual.items())

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._k(prefix)
        seen: dict[str, ObjectInfo] = {}
        for k, size in self._all():
            if k.startswith(base):
                head, sep, _ = k[len(base):].partition("/")
                seen[head] = ObjectInfo(prefix + head, 0 if sep else size, 0.0, "dir" if sep else "file")
        return [seen[k] for k in sorted(seen)]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._k(prefix)
        for k, size in sorted(self._all()):
            if k.startswith(base):
                yield ObjectInfo(k[len(self.prefix):], size, 0.0)

    def stat(self, key: str) -> ObjectInfo | None:
        k = self._k(key)
        if k in self.files:
            return ObjectInfo(key, len(self.files[k]), 0.0)
        if k in self.virtual:
            return ObjectInfo(key, self.virtual[k][0], 0.0)
        return None

    def open_reader(self, key: str) -> Reader:
        k = self._k(key)
        self.counter.opens += 1
        if k in self.files:
            return _MemReader(self.files[k], len(self.files[k]), self.counter)
        if k in self.virtual:
            size, make = self.virtual[k]
            return _MemReader(make(), size, self.counter)
        raise NotFound(f"{self.url_of(key)}: no such object")

    def open_writer(self, key: str) -> Writer:
        return _MemWriter(self, key)

    def write_atomic(self, key: str, data: bytes) -> None:
        self.files[self._k(key)] = bytes(data)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        if self._k(key) in self.files:
            return False
        self.files[self._k(key)] = bytes(data)
        return True

    def delete(self, key: str) -> bool:
        return self.files.pop(self._k(key), None) is not None

    def remove_dir(self, prefix: str) -> None:
        pass


def _names(tensors: int) -> list[str]:
    return [f"model/layers.{i // 8}.w{i % 8}" for i in range(tensors)]


def _chunks(rank: int, ranks: int, names: list[str]) -> list[Chunk]:
    """Rank ``rank``'s row block of every tensor (FSDP2 ``Shard(0)``), laid out by name."""
    block = math.ceil(ROWS / ranks)
    start = min(rank * block, ROWS)
    rows = max(0, min(block, ROWS - start))
    n = rows * COLS * ITEM
    return [Chunk(name, "bfloat16", (rows, COLS), (start, 0), i * n, (i + 1) * n, _digest(rank, i))
            for i, name in enumerate(names)]


def _digest(rank: int, i: int) -> str:
    """A made-up chunk digest: 16 lowercase hex digits, as a real one has."""
    return f"{(rank << 32) | i:016x}"


def build_root(ranks: int, tensors: int, *, checkpoints: int = 3, hints: bool = True) -> MemStorage:
    """A root of ``checkpoints`` committed saves of a ``ranks``-rank FSDP job."""
    names = _names(tensors)
    block = math.ceil(ROWS / ranks)
    files: dict[str, bytes] = {}
    virtual: dict[str, tuple[int, Callable[[], bytes]]] = {}
    root = MemStorage(files, virtual, _Counter())
    held = [r for r in range(ranks) if r * block < ROWS]  # empty shards are not saved
    table = {n: TensorEntry("bfloat16", (ROWS, COLS), "model", len(held), None, (0, block) if hints else None)
             for n in names}
    sums: dict[int, tuple[int, str]] = {}  # rank -> (header length, file checksum): same every step
    for k in range(checkpoints):
        step = 1000 * (k + 1)
        d = step_dir(step) + "/"
        entries = []
        for r in held:
            rows = min(block, ROWS - r * block)
            if r not in sums:
                chunks = _chunks(r, ranks, names)
                header = build_header(chunks, rank=r, rank_state={"rng": r})
                sums[r] = (len(header), file_checksum(header, [c.checksum for c in chunks]))  # type: ignore[misc]
            size = sums[r][0] + tensors * rows * COLS * ITEM
            name = shard_name(r, ranks)
            # Generated when opened: ranks x tensors chunks never exist at once.
            virtual[d + name] = (size, lambda r=r: build_header(_chunks(r, ranks, names), rank=r, rank_state={"rng": r}))
            entries.append(FileEntry(name, size, sums[r][1], r, tensors))
        manifest = Manifest.new(step, ranks, entries, table, {"model": {}}, {})
        commit(root.sub(step_dir(step)), manifest)
    return root


def measure(fn: Callable[[MemStorage], object], root: MemStorage) -> dict[str, float]:
    """Bytes and files read, and seconds, of ``fn(root)``."""
    root.counter.bytes = root.counter.opens = 0
    t0 = time.perf_counter()
    fn(root)
    return {"bytes": root.counter.bytes, "opens": root.counter.opens, "s": time.perf_counter() - t0}


def load_planning(root: MemStorage, ranks: int, *, read_all: bool = False) -> None:
    """(a) One rank's load planning at the same world size: manifest, its own region of every
    tensor located (headers opened as the hints say), its per-rank state and rank 0's."""
    rank = ranks // 2 + 1
    entry = next(newest_committed(root, layouts=CHECKPOINTER_LAYOUTS))  # what rank 0 broadcast: a name only
    index = ShardIndex(root.sub(entry.name))
    if read_all:  # the old reader: every header, on every rank
        index.headers
    block = math.ceil(ROWS / ranks)
    lo, hi = min(rank * block, ROWS), min((rank + 1) * block, ROWS)
    for name in index.manifest.tensors:
        index.locate(name, Box((lo, 0), (hi - lo, COLS)))
    index.rank_states((rank, 0))


def latest_decision(root: MemStorage) -> None:
    """(b) ``load_latest``'s decision, on rank 0 (the others read nothing for it): the newest
    committed checkpoint, marker and manifest checked."""
    next(newest_committed(root, layouts=CHECKPOINTER_LAYOUTS))


def verify_metadata(root: MemStorage) -> None:
    """(c) ``verify``'s default level, its metadata part: every header of the newest
    checkpoint and the coverage check (the data read is proportional to the data)."""
    entry = next(newest_committed(root, layouts=CHECKPOINTER_LAYOUTS))
    index = ShardIndex(entry.storage)
    coverage(index.manifest, index.headers)


def prune_anchor_metadata(root: MemStorage) -> None:
    """(d) ``prune --dry-run``'s listing and anchor check, metadata part: every checkpoint's
    status (marker and manifest), then the anchor's headers and coverage."""
    entries = list(newest_marked(root, layouts=CHECKPOINTER_LAYOUTS))
    anchor = entries[0]
    read_committed(anchor.storage)
    index = ShardIndex(anchor.storage)
    coverage(index.manifest, index.headers)


__all__ = ["MemStorage", "build_root", "measure", "load_planning", "latest_decision",
           "verify_metadata", "prune_anchor_metadata"]
