"""Deleting a checkpoint's files in the order its layout's commit rule needs.

Every layout removes the file its commit rule reads first (ckptctl's marker, DCP's
``.metadata``, the Trainer's ``trainer_state.json``...), so a removal interrupted at any point
leaves something that reads as incomplete, never as complete. Prune deletes only what its plan
saw, each file only while it is unchanged: a checkpoint being rewritten under it is left alone.

Once the commit files (and a seal) are gone, one at a time and in order, the rest of the
files go ``settings.REQUEST_THREADS`` at a time: the checkpoint already reads as partial, and
on object storage each file is a stat and a delete, round trips that one after another made a
512-rank checkpoint's removal take a minute.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection, Iterable, Mapping, Sequence

from ckptctl.format.seal import SEAL
from ckptctl.settings import REQUEST_THREADS
from ckptctl.storage.base import Storage

Snapshot = tuple[tuple[str, int, float, str], ...]  # (key, size, mtime, kind) of every file


def remove_unchanged(ckpt: Storage, order: Iterable[str], expected: Mapping[str, tuple[int, float]],
                     serial: Collection[str] | None = None) -> str | None:
    """Delete the files of ``order`` (keys of ``expected``: key -> (size, mtime) as planned),
    each only while unchanged, then the directory when empty. ``serial`` (the layout's
    ``commit_files``; None: every file): the files at the head of ``order`` that are among
    them, or the seal, go one at a time in that order; the rest then go several at once.
    Returns the URL of the first file (in ``order``) found changed, or None: it stays, and
    once a change (or a storage error, raised) is seen no further delete starts (those in
    flight finish)."""
    keys = list(order)
    head = len(keys) if serial is None else next(
        (i for i, k in enumerate(keys) if k not in serial and k != SEAL), len(keys))
    for key in keys[:head]:
        if not _delete_if_unchanged(ckpt, key, expected[key]):
            return ckpt.url_of(key)
    rest = keys[head:]
    if rest:
        changed: list[int] = []
        seen = threading.Event()

        def one(i: int) -> None:
            if seen.is_set():
                return
            try:
                if not _delete_if_unchanged(ckpt, rest[i], expected[rest[i]]):
                    changed.append(i)
                    seen.set()
            except BaseException:
                seen.set()  # a storage error stops the removal, as one at a time it did
                raise

        with ThreadPoolExecutor(min(REQUEST_THREADS, len(rest)), thread_name_prefix="ckptctl-delete") as pool:
            for f in [pool.submit(one, i) for i in range(len(rest))]:
                f.result()  # a storage error: raised once every delete started has ended
        if changed:
            return ckpt.url_of(rest[min(changed)])
    ckpt.remove_dir("")
    return None


def _delete_if_unchanged(ckpt: Storage, key: str, planned: tuple[int, float]) -> bool:
    """Delete ``key`` if it is as ``planned`` (size, mtime) or already gone (an earlier,
    interrupted removal); False, deleting nothing, when it changed."""
    now = ckpt.stat(key)
    if now is None:
        return True
    if (now.size, now.mtime) != planned:
        return False
    ckpt.delete(key)
    return True


def snapshot_of(ckpt: Storage) -> Snapshot:
    """Every file below ``ckpt`` as (key, size, mtime, kind): what a deletion checks against."""
    return tuple(sorted((i.key, i.size, i.mtime, i.kind) for i in ckpt.list()))


def entry_snapshot(root: Storage, name: str) -> Snapshot:
    """``snapshot_of`` the entry ``name`` under ``root``; a checkpoint that is one file
    (Lightning's ``*.ckpt``) is that file, under the key ``""``."""
    info = root.stat(name)
    if info is not None and info.kind == "file":
        return (("", info.size, info.mtime, "file"),)
    return snapshot_of(root.sub(name))


def commit_files_first(keys: Iterable[str], commit_files: Sequence[str]) -> list[str]:
    """``keys`` in the order a delete takes them: ``commit_files`` (what the commit rule reads)
    first, then the seal, then the rest, so that a delete cut short never leaves something that
    reads as complete. The seal right after the commit files: a delete cut short then leaves
    the stack's own files (a partial checkpoint its layout claims and prune later removes),
    never a directory holding only the seal, which no layout claims."""
    first = {k: i for i, k in enumerate(commit_files)}
    first.setdefault(SEAL, len(commit_files))
    return sorted(keys, key=lambda k: (first.get(k, len(first)), k))


def remove_entry(root: Storage, name: str, snapshot: Snapshot, order: Callable[[Iterable[str]], list[str]],
                 serial: Collection[str] | None = None) -> str | None:
    """Delete the entry ``name`` of ``root`` as ``snapshot`` (``entry_snapshot``) saw it, in its
    layout's removal ``order``, each file only while unchanged, then its directory when empty;
    a checkpoint that is one file is deleted only while it is the file seen. ``serial``: see
    ``remove_unchanged``. Returns the URL of the first file that changed (it stays), or None."""
    expected = {key: (size, mtime) for key, size, mtime, _kind in snapshot}
    if "" in expected:
        now = root.stat(name)
        if now is not None and (now.kind, now.size, now.mtime) != ("file", *expected[""]):
            return root.url_of(name)
        if now is not None:
            root.delete(name)
        return None
    return remove_unchanged(root.sub(name), order(expected), expected, serial)
