"""``rm``: delete named checkpoints, commit file first, never the last good one by accident.

Each CKPT names one checkpoint (``ROOT/step-XXXXXXXXXX``, ``ROOT/checkpoint-N``, a Lightning
``.ckpt`` file..., local or ``s3://``) of any layout; its parent is its root. Under each root's
lock (the same ``RootLock`` as ``prune``), the plan is made for every root first, then shown to
``review`` (to print it and ask), then carried out; so a refusal deletes nothing at all.

Safety: the newest resumable checkpoint of its layout under its root that passes full
verification (``prune``'s anchor, found the same way: newest first, by the one verify engine
with the verification record) is refused unless ``force``: deleting it leaves the run with
nothing known good to resume from; so is, unless ``force``, what a pointer of the root protects
(``layouts.protection``: DeepSpeed's ``latest``, Megatron's tracker, a Trainer's best). A
directory no layout claims is never deleted, a step-named symlink only as the link. Deleting
takes the files in their layout's ``removal_order`` (its commit file first), each only while
it is as listed, so an interrupted ``rm`` leaves something that reads as partial.
A dry run takes no lock and writes nothing.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ckptctl.errors import CkptError, RefusedForSafety, UsageError
from ckptctl.layouts.base import Checkpoint, kind_of_checkpoint
from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.layouts.protection import protected
from ckptctl.layouts.removal import Snapshot, entry_snapshot, remove_entry
from ckptctl.ops.lock import DEFAULT_STALE_AFTER_S, RootLock
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
    anchor: bool = False  # the newest checkpoint of its layout under its root that passes full verification
    snapshot: Snapshot = ()  # its files as listed: only those are deleted, each only while unchanged

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
            root = roots[root_path] = _Root(storage, {e.name: e for e in list_checkpoints(storage)}, [])
        entry = root.entries.get(name)
        if entry is None:
            raise UsageError(f"no such checkpoint: {path}",
                             hint=f"list the checkpoints with `ckptctl ls {root_path}`")
        if entry.owner is None:
            raise UsageError(f"{path}: {entry.reason or 'no layout claims its files'}",
                             hint="rm deletes only what a layout claims as its checkpoint; look at it yourself")
        if any(i.name == name for i in root.items):
            continue  # named twice
        snap = entry_snapshot(root.storage, name) if entry.storage is not None else ()
        root.items.append(RmItem(entry.step, name, entry.url, entry.status,
                                 sum(s[1] for s in snap if s[3] == "file"), snapshot=snap))
    return list(roots.values())


def _mark_anchor(root: _Root, cache: VerifyCache, progress: Progress | None) -> None:
    """Flag each target that is the newest resumable checkpoint of its layout under the root
    passing full verification, as prune finds its anchors. Verifies newest first, and stops as
    soon as the answer is known."""
    targets: dict[str, dict[str, RmItem]] = {}  # by layout
    for item in root.items:
        if item.status == "committed":
            targets.setdefault(root.entries[item.name].layout, {})[item.name] = item
    committed: dict[str, list[Checkpoint]] = {}  # by layout
    for e in root.entries.values():
        if e.status == "committed":
            committed.setdefault(e.layout, []).append(e)
    for layout, mine in targets.items():
        lowest = min(i.step for i in mine.values())
        for e in sorted(committed[layout], key=lambda e: (e.step, e.name), reverse=True):
            if e.step < lowest:
                break  # the anchor, if any, is older than every target
            assert e.storage is not None and e.owner is not None
            if not kind_of_checkpoint(e.owner, e.storage, e.manifest).resumable:
                continue  # an export is never what a run resumes from
            report, _cached, fp = verify_cached(e.storage, e.name, cache, layout=e.owner, level=ANCHOR_LEVEL,
                                               progress=progress)
            if report.ok and fp is not None:
                if e.name in mine:
                    mine[e.name].anchor = True
                break


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
    assert entry.owner is not None
    try:
        if entry.storage is None:  # a symlink: the link only, never its target
            root.storage.delete(item.name)
            changed = None
        else:
            changed = remove_entry(root.storage, item.name, item.snapshot, entry.owner.removal_order, entry.owner.commit_files)
        item.result = "deleted" if changed is None else "failed"
        if changed is not None:
            item.detail = f"{changed} changed since it was listed; it and the files not yet deleted are left in place"
    except CkptError as e:  # report it and go on with the others
        item.result, item.detail = "failed", str(e)
