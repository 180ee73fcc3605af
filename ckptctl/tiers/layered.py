"""One checkpoint read through several tiers at once: each file from the nearest tier that has
it. The recovery view of a node-local first tier (``tiers.node_chain``).

A rank resuming step S reads ``Layered([its node's step-S, the next tier's step-S, ...])``:
its marker and manifest from its own disk when its node committed S there, else from the next
tier; each shard file from its own disk when its node holds it (the files its node's ranks
wrote), else from the next tier (another node's files, or all of them on a replaced node).
Nothing is trusted for having come from nearby: the loader checks every chunk it reads
against its checksum and every shard header against the manifest that was read, whichever
tier each came from, so a file of another attempt at S, or a damaged one, fails the load.
The view remembers which layer served each file (``served``), so that the next attempt at
the same step can read that file from the layer after it (``skip``; ``tiers.node_resume``):
every copy of a step is tried before an older step is.

Read-only: every write raises.

May import: ``storage``, leaves.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from ckptctl.errors import NotFound, StorageError
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer


class Layered(Storage):
    """``layers``: the same checkpoint directory (or root) on each tier, nearest first;
    ``skip``: per key, the layers not to read it from (a copy found damaged there)."""

    def __init__(self, layers: Sequence[Storage], skip: Mapping[str, Collection[int]] | None = None) -> None:
        if not layers:
            raise ValueError("Layered needs at least one storage")
        self.layers = list(layers)
        self.url = self.layers[0].url
        self.skip = {k: frozenset(v) for k, v in (skip or {}).items()}
        self.served: dict[str, int] = {}  # key -> the layer its last reader was opened on

    def sub(self, key: str) -> "Layered":
        return Layered([s.sub(key) for s in self.layers])

    def _layers(self, key: str) -> Iterator[tuple[int, Storage]]:
        avoid = self.skip.get(key, frozenset())
        return ((i, s) for i, s in enumerate(self.layers) if i not in avoid)

    def _merged(self, listings: Iterator[list[ObjectInfo]]) -> list[ObjectInfo]:
        seen: dict[str, ObjectInfo] = {}
        for items in listings:
            for info in items:
                seen.setdefault(info.key, info)
        return [seen[k] for k in sorted(seen)]

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        return self._merged(s.children(prefix) for s in self.layers)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(self._merged(list(s.list(prefix)) for s in self.layers))

    def stat(self, key: str) -> ObjectInfo | None:
        for _, s in self._layers(key):
            info = s.stat(key)
            if info is not None:
                return info
        return None

    def open_reader(self, key: str) -> Reader:
        for i, s in self._layers(key):
            try:
                reader = s.open_reader(key)
            except NotFound:
                continue
            self.served[key] = i
            return reader
        raise NotFound(f"{self.url_of(key)}: on none of {', '.join(s.url for s in self.layers)}",
                       hint="no tier holds this file of the checkpoint; an older one may be whole")

    def _read_only(self, key: str) -> StorageError:
        return StorageError(f"{self.url_of(key)}: a recovery view across tiers is read-only",
                            hint="write to one tier's root instead")

    def open_writer(self, key: str) -> Writer:
        raise self._read_only(key)

    def write_atomic(self, key: str, data: bytes) -> None:
        raise self._read_only(key)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        raise self._read_only(key)

    def delete(self, key: str) -> bool:
        raise self._read_only(key)

    def remove_dir(self, prefix: str) -> None:
        raise self._read_only(prefix)
