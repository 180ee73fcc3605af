"""Views of a storage that answer some questions from what the verb read a moment ago, instead
of asking the store again: on object storage every question is a request in series (15-50 ms
on a real store), and the catalog asked several twice before a restore's first data byte.

- ``Listed``: a directory with the listing of it just made; an immediate child the listing
  does not hold is answered as missing without a request. Binding each known layout to a root
  read each stack's pointer file (Megatron's tracker, DeepSpeed's ``latest``, Composer's
  uploaded symlink), a HEAD each, although the root's listing said none was there.
- ``Remembered``: a checkpoint whose small files (``read_if_small``: ckptctl's marker and
  manifest) are answered to the next reader from the bytes the previous one got, once each:
  the catalog reads the record to judge the checkpoint, and the verify or the copy that
  follows reads it again.

A name absent from a listing but written just after it is answered as absent, and a record
remembered is the one the store held when it was read: each is one snapshot, as the catalog's
own listing is. Everything else, and every write, goes to the store; a write through a view
forgets what it knew, so nothing written through it is answered from before.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterator, Sequence

from ckptctl.errors import NotFound
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer


class _Forwarding(Storage):
    """``inner``, every question forwarded; a write calls ``_written`` first."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    def _written(self) -> None:
        """Forget what the view answers by itself."""

    def sub(self, key: str) -> Storage:
        return self.inner.sub(key)

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.children(prefix)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo | None:
        return self.inner.stat(key)

    def open_reader(self, key: str) -> Reader:
        return self.inner.open_reader(key)

    def open_root_reader(self) -> Reader:
        return self.inner.open_root_reader()

    def read_if_small(self, key: str, limit: int) -> tuple[bytes | None, int]:
        return self.inner.read_if_small(key, limit)

    def open_writer(self, key: str) -> Writer:
        self._written()
        return self.inner.open_writer(key)

    def write_atomic(self, key: str, data: bytes) -> None:
        self._written()
        self.inner.write_atomic(key, data)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        self._written()
        return self.inner.write_if_absent(key, data)

    def compare_and_swap(self, key: str, expected: bytes | None, data: bytes) -> bytes | None:
        self._written()
        return self.inner.compare_and_swap(key, expected, data)

    def delete(self, key: str) -> bool:
        self._written()
        return self.inner.delete(key)

    def remove_dir(self, prefix: str) -> None:
        self._written()
        self.inner.remove_dir(prefix)

    def abort_stale_uploads(self, prefix: str = "", *, idle_for_s: float, keys: Collection[str] = (),
                            where: Callable[[str], bool] | None = None, dry_run: bool = False) -> list[str]:
        self._written()
        return self.inner.abort_stale_uploads(prefix, idle_for_s=idle_for_s, keys=keys, where=where, dry_run=dry_run)

    def local_path(self, key: str = "") -> str | None:
        return self.inner.local_path(key)

    def url_of(self, key: str = "") -> str:
        return self.inner.url_of(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class Listed(_Forwarding):
    """``inner`` with its immediate children as ``children`` (``inner.children()``) listed them."""

    def __init__(self, inner: Storage, children: Sequence[ObjectInfo]) -> None:
        super().__init__(inner)
        self._children: list[ObjectInfo] | None = list(children)
        self._names = frozenset(info.key for info in children)

    def _written(self) -> None:
        self._children = None

    def _absent(self, key: str) -> bool:
        """Whether the listing says ``key`` is no immediate child (so nothing is there)."""
        return self._children is not None and "/" not in key and key not in self._names

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        if not prefix and self._children is not None:
            return list(self._children)
        return self.inner.children(prefix)

    def stat(self, key: str) -> ObjectInfo | None:
        return None if self._absent(key) else self.inner.stat(key)

    def open_reader(self, key: str) -> Reader:
        if self._absent(key):
            raise NotFound(f"{self.url_of(key)}: no such object",
                           hint="check the URL; the checkpoint may have been pruned or never committed")
        return self.inner.open_reader(key)

    def read_if_small(self, key: str, limit: int) -> tuple[bytes | None, int]:
        if self._absent(key):
            self.open_reader(key)  # raises NotFound, as the store would
        return self.inner.read_if_small(key, limit)


class Remembered(_Forwarding):
    """``inner``, each answer of ``read_if_small`` given once more to the next reader of the
    same key and limit (then forgotten: the reader after it asks the store)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self._kept: dict[tuple[str, int], tuple[bytes | None, int]] = {}
        self._replayed: set[tuple[str, int]] = set()

    def _written(self) -> None:
        self._kept.clear()
        self._replayed.clear()

    def read_if_small(self, key: str, limit: int) -> tuple[bytes | None, int]:
        asked = (key, limit)
        kept = self._kept.pop(asked, None)
        if kept is not None:
            self._replayed.add(asked)
            return kept
        got = self.inner.read_if_small(key, limit)
        if asked not in self._replayed:  # the first read: kept for the next reader
            self._kept[asked] = got
        return got
