"""``rm``: delete named checkpoints, marker first, never the last good one by accident.

Each CKPT names one checkpoint directory (``ROOT/step-XXXXXXXXXX``, local or ``s3://``); its
parent is its root. Under each root's lock (the same ``RootLock`` as ``prune``), the plan is
made for every root first, then shown to ``review`` (to print it and ask), then carried out;
so a refusal deletes nothing at all.

Safety: the newest checkpoint of a root that passes full verification (``prune``'s anchor,
found the same way, newest first, with the verification record) is refused unless ``force``:
deleting it leaves the run with nothing known good to resume from; so is, unless ``force``,
what a pointer of the root protects (``layouts.protection``: a symlinked step directory
DeepSpeed's ``latest`` names, for one). Only ckptctl's own
checkpoints (and step-named symlinks: the link only) are removed; other tools' checkpoints are
``prune``'s to manage by their own rules. Deleting removes the marker first
(``layouts.native.remove``), so an interrupted ``rm`` leaves something that reads as partial.
A dry run takes no lock and writes nothing.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ckptctl.errors import CkptError, RefusedForSafety, UsageError
from ckptctl.layouts.base import Checkpoint
from ckptctl.layouts.catalog import LAYOUTS, layout_called, list_checkpoints
from ckptctl.layouts.native import remove, total_size
from ckptctl.layouts.protection import protected
from ckptctl.ops.retention.lock import DEFAULT_STALE_AFTER_S, RootLock
from ckptctl.ops.retention.plan import ANCHOR_LEVEL
from ckptctl.ops.targets import open_root
from ckptctl.ops.verify.cache import VerifyCache, verify_cached
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage

__all__ = ["RmItem", "RmResult", "remove_checkpoints", "split_checkpoint_path"]


@dataclass
class RmItem:
    """One named checkpoint and what ``rm`` did (or would do) with it."""

    step: int
    name: str
    url: str
    status: str  # as the catalog lists it: committed, partial, corrupt, link
    bytes: int = 0
    result: str = "planned"  # planned, deleted, failed
    detail: str | None = None
    anchor: bool = False  # the newest checkpoint of its root that passes full verification

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "url": self.url, "status": self.status, "bytes": self.bytes,
                "result": self.result, "detail": self.detail, "anchor": self.anchor}


@dataclass
class RmResult:
    dry_run: bool
    items: list[RmItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[RmItem]:
        return [i for i in self.items if i.result == "failed"]

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "checkpoints": [i.to_dict() for i in self.items],
                "bytes": sum(i.bytes for i in self.items if i.result in ("planned", "deleted")),
                "notes": list(self.notes)}


def split_checkpoint_path(path: str) -> tuple[str, str]:
    """(root, name) of the checkpoint directory ``path``: its parent, and its last component.

    >>> split_checkpoint_path("s3://b/run/step-0000000005/")
    ('s3://b/run', 'step-0000000005')
    >>> split_checkpoint_path("ckpt/step-0000000005")[1]
    'step-0000000005'
    """
    if "://" in path:
        root, _, name = path.rstrip("/").rpartition("/")
        if "://" not in root or root.endswith(":/"):
            raise UsageError(f"{path} names a bucket, not a checkpoint", hint="give ROOT/step-XXXXXXXXXX")
        return root, name
    full = os.path.abspath(path)
    return os.path.dirname(full), os.path.basename(full)


@dataclass
class _Root:
    storage: Storage
    entries: dict[str, Checkpoint]
    items: list[RmItem]


def _survey(paths: Sequence[str]) -> list[_Root]:
    roots: dict[str, _Root] = {}
    for path in paths:
        root_path, name = split_checkpoint_path(path)
        root = roots.get(root_path)
        if root is None:
            storage = open_root(root_path)
            root = roots[root_path] = _Root(storage, {e.name: e for e in list_checkpoints(storage, layouts=LAYOUTS)}, [])
        entry = root.entries.get(name)
        if entry is None:
            raise UsageError(f"no such checkpoint: {path}",
                             hint=f"list the checkpoints with `ckptctl ls {root_path}`")
        if not deletes(entry) and entry.status != "link":
            raise UsageError(f"{path} is a {entry.layout} checkpoint; rm deletes ckptctl checkpoints only",
                             hint="`ckptctl prune` manages other tools' checkpoints by their own rules")
        if any(i.name == name for i in root.items):
            continue  # named twice
        size = total_size(entry.storage)[0] if entry.storage is not None else 0
        root.items.append(RmItem(entry.step, name, entry.url, entry.status, size))
    return list(roots.values())


def deletes(entry: Checkpoint) -> bool:
    """Whether ``rm`` deletes ``entry``: only checkpoints ckptctl writes (``native.remove``)."""
    layout = layout_called(entry.layout)
    return layout is not None and layout.written_by_ckptctl


def _mark_anchor(root: _Root, cache: VerifyCache, progress: Progress | None) -> None:
    """Flag the target that is the root's newest checkpoint passing full verification, if any.
    Verifies newest first, and stops as soon as the answer is known."""
    targets = {i.name: i for i in root.items if i.status == "committed"}
    if not targets:
        return
    lowest = min(i.step for i in targets.values())
    committed = [e for e in root.entries.values() if e.status == "committed" and deletes(e)]
    for e in sorted(committed, key=lambda e: (e.step, e.name), reverse=True):
        if e.step < lowest:
            return  # the anchor, if any, is older than every target
        assert e.storage is not None
        report, _cached, fp = verify_cached(e.storage, e.name, cache, level=ANCHOR_LEVEL, progress=progress)
        if report.ok and fp is not None:
            if e.name in targets:
                targets[e.name].anchor = True
            return


def _protected_targets(root: _Root) -> list[tuple[RmItem, str]]:
    """The targets that a pointer of their root names (``layouts.protection``: a symlinked step
    directory DeepSpeed's ``latest`` or Megatron's tracker names, or the link's target)."""
    entries = [(e.layout, e.name, "broken" if e.status == "corrupt" else e.status) for e in root.entries.values()]
    guarded = protected(root.storage, entries)
    return [(i, guarded[i.name]) for i in root.items if i.name in guarded]


def remove_checkpoints(
    paths: Sequence[str],
    *,
    force: bool = False,
    dry_run: bool = False,
    review: Callable[[RmResult], bool] | None = None,
    progress: Progress | None = None,
    lock_stale_after_s: float = DEFAULT_STALE_AFTER_S,
    command: str = "rm",
) -> RmResult:
    """Delete the checkpoints at ``paths`` (marker first). ``review(result)`` sees the plan
    (items ``planned``) and returns whether to go on; the result is returned either way.

    Raises UsageError (a path that is no ckptctl checkpoint), RefusedForSafety (exit 1: a
    target is its root's newest fully verified checkpoint, or a pointer of its root protects
    it, and ``force`` is not set; nothing is deleted) or LockHeld (exit 3: a prune, rm or sync holds a root's lock).
    """
    if not paths:
        raise UsageError("no checkpoint given", hint="e.g. ckptctl rm ROOT/step-0000001000")
    result = RmResult(dry_run)
    with ExitStack() as stack:
        roots = _survey(paths)
        caches = []
        for root in roots:
            if not dry_run:
                lock = stack.enter_context(RootLock(root.storage, command=command, stale_after_s=lock_stale_after_s))
                result.notes.extend(lock.notes)
            cache = VerifyCache.load(root.storage, read_only=dry_run)
            caches.append(cache)
            _mark_anchor(root, cache, progress)
            result.items.extend(root.items)
        anchors = [i for i in result.items if i.anchor]
        if anchors and not force:
            names = ", ".join(i.url for i in anchors)
            raise RefusedForSafety(
                f"{names}: the newest checkpoint of its root that passes full verification; nothing was deleted",
                hint="a run resumes from it; pass --force to delete it anyway",
            )
        guarded = [(item, why) for root in roots for item, why in _protected_targets(root)]
        if guarded and not force:
            item, why = guarded[0]
            raise RefusedForSafety(
                f"{item.url}: protected ({why}); nothing was deleted"
                + (f" (+{len(guarded) - 1} more protected)" if len(guarded) > 1 else ""),
                hint="removing it leaves the pointer naming nothing; move the pointer first, or pass --force",
            )
        go = review(result) if review is not None else True
        if dry_run or not go:
            for cache in caches:
                cache.save()  # read_only on a dry run: nothing is written
            return result
        for root, cache in zip(roots, caches):
            for item in root.items:
                _delete_one(root, item)
                if item.result == "deleted":
                    cache.forget(item.name)
            cache.save()
            result.notes.extend(cache.notes)
    return result


def _delete_one(root: _Root, item: RmItem) -> None:
    entry = root.entries[item.name]
    try:
        if entry.storage is None:  # a symlink: the link only, never its target
            root.storage.delete(item.name)
        else:
            remove(entry.storage)
        item.result = "deleted"
    except CkptError as e:  # report it and go on with the others
        item.result, item.detail = "failed", str(e)
