"""Deleting a checkpoint's files in the order its layout's commit rule needs.

Every layout removes the file its commit rule reads first (ckptctl's marker, DCP's
``.metadata``, the Trainer's ``trainer_state.json``...), so a removal interrupted at any point
leaves something that reads as incomplete, never as complete. Prune deletes only what its plan
saw, each file only while it is unchanged: a checkpoint being rewritten under it is left alone.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from ckptctl.format.seal import SEAL
from ckptctl.storage.base import Storage

Snapshot = tuple[tuple[str, int, float, str], ...]  # (key, size, mtime, kind) of every file


def remove_unchanged(ckpt: Storage, order: Iterable[str], expected: Mapping[str, tuple[int, float]]) -> str | None:
    """Delete the files of ``order`` (keys of ``expected``: key -> (size, mtime) as planned),
    in that order, each only while unchanged, then the directory when empty. Returns the URL
    of the first file that changed (it and the files after it stay), or None."""
    for key in order:
        now = ckpt.stat(key)
        if now is None:
            continue  # already gone (an earlier, interrupted removal)
        if (now.size, now.mtime) != expected[key]:
            return ckpt.url_of(key)
        ckpt.delete(key)
    ckpt.remove_dir("")
    return None


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


def remove_entry(root: Storage, name: str, snapshot: Snapshot, order: Callable[[Iterable[str]], list[str]]) -> str | None:
    """Delete the entry ``name`` of ``root`` as ``snapshot`` (``entry_snapshot``) saw it, in its
    layout's removal ``order``, each file only while unchanged, then its directory when empty;
    a checkpoint that is one file is deleted only while it is the file seen. Returns the URL of
    the first file that changed (it and the files after it stay), or None."""
    expected = {key: (size, mtime) for key, size, mtime, _kind in snapshot}
    if "" in expected:
        now = root.stat(name)
        if now is not None and (now.kind, now.size, now.mtime) != ("file", *expected[""]):
            return root.url_of(name)
        if now is not None:
            root.delete(name)
        return None
    return remove_unchanged(root.sub(name), order(expected), expected)
