"""One checkpoint read through several tiers at once: each file from the nearest tier that has
it. The recovery view of a node-local first tier (``tiers.node_chain``).

A rank resuming step S reads ``Layered([its node's step-S, the next tier's step-S, ...])``:
its marker and manifest from its own disk when its node committed S there, else from the next
tier; each shard file from its own disk when its node holds it (the files its node's ranks
wrote), else from the next tier (another node's files, or all of them on a replaced node).
Nothing is trusted for having come from nearby: the loader checks every chunk it reads
against its checksum and every shard header against the manifest that was read, whichever
tier each came from, so a file of another attempt at S, or a damaged one, fails the load
(and ``load_latest`` moves on to an older step, on every rank together).

Read-only: every write raises.

May import: ``storage``, leaves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ckptctl.errors import NotFound, StorageError
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer


class Layered(Storage):
    """``layers``: the same checkpoint directory (or root) on each tier, nearest first."""

    def __init__(self, layers: Sequence[Storage]) -> None:
        if not layers:
            raise ValueError("Layered needs at least one storage")
        self.layers = list(layers)
        self.url = self.layers[0].url

    def sub(self, key: str) -> "Layered":
        return Layered([s.sub(key) for s in self.layers])

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
        for s in self.layers:
            info = s.stat(key)
            if info is not None:
                return info
        return None

    def open_reader(self, key: str) -> Reader:
        for s in self.layers:
            try:
                return s.open_reader(key)
            except NotFound:
                continue
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
