"""``prune``: delete old checkpoints without ever losing the last good one.

``plan()`` (in ``retention.plan``) reads and decides; ``execute(plan)`` (in ``retention.execute``)
re-checks and deletes; ``prune()``, here, does both under the root's lock and is what the CLI
and ``Checkpointer(keep_last=...)`` call. All three are importable from this module.

Safety, in this order (the user-facing statement is ``man/ckptctl-prune.1``):

1. **Anchor.** Committed checkpoints are verified fully (level ``load``: marker, manifest, every
   checksum, a decode of every tensor), newest first, until one passes. That one is the anchor:
   always kept. If none passes, nothing is deleted at all (``NoValidCheckpoint``, exit 1).
2. **Broken** checkpoints (a marker, but they fail verification, or marker and manifest
   disagree) are reported and left in place: they may be evidence. ``delete_broken`` removes them.
3. **Partial** directories (no marker) may be in the middle of a save. They are left alone until
   nothing inside them (the directory itself included) was modified for ``partial_after_s``
   (default 6 h), then deleted as abandoned.
4. **Symlinked step entries** are removed: the link only, never followed, the target untouched.
   Every reader ignores them (ckptctl never follows a link under a root), so a link is never a
   checkpoint anyone resumes from, and leaving it would make it look like one to people. The
   exception is a link another stack's pointer names (DeepSpeed's ``latest``, Megatron's
   tracker, a best checkpoint): that stack resumes through it, so it is kept with its target
   (``layouts.protection``), like every pointer target, readable or not.
5. Committed checkpoints older than the anchor are deleted unless a policy keeps them. Older
   ones are not verified (that would read everything on every run); policies count them.
6. **Unfinished S3 uploads** a killed writer left inside checkpoint entries are aborted once
   idle for ``partial_after_s``, like partial directories (``ops.transfer.uploads``); listed in the plan.
7. **Staging copies** a killed re-sharding restore left (hidden ``.restore-staging-*``
   directories, never a checkpoint anyone lists) are deleted by rule 3's idle time and with
   its re-check, as ``staging`` items of the plan (``ops.retention.scratch``); a link or a file
   under such a name is left alone. Like everything else, not while no checkpoint verifies.
8. **Temporaries** a killed ckptctl write left (``.NAME.tmp-PID-HEX``, the one name its atomic
   writes give: at the root, or inside a committed checkpoint the plan keeps) are deleted the
   same way, one file each, as ``temporary`` items (``ops.retention.scratch``); a file of any
   other name, a directory or a link under such a name is left alone. Filesystem roots only:
   the S3 backend never makes a temporary name.

Deleting one checkpoint removes its marker first, then the manifest, then everything else, then
the empty directory: a prune killed at any point leaves something that reads as partial, never
as committed. Before touching an entry, ``execute`` lists it again and deletes only if it is
exactly as planned (same files, sizes and mtimes), and it checks each file again just before
removing it; an entry that changed (a save started writing into it) is skipped and reported.
Everything goes through the ``Storage`` rooted at ROOT, which never follows links, so nothing
outside the root is touched.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from ckptctl.errors import NotFound
from ckptctl.layouts.base import Layout
from ckptctl.layouts.catalog import LAYOUTS
from ckptctl.ops.transfer import uploads
from ckptctl.ops.lock import DEFAULT_STALE_AFTER_S, RootLock
from ckptctl.ops.retention.execute import ItemOutcome, PruneOutcome, Result, execute
from ckptctl.ops.retention.plan import ANCHOR_LEVEL, DEFAULT_PARTIAL_AFTER_S, plan
from ckptctl.ops.retention.planned import Action, Kind, PlanItem, PrunePlan, Snapshot, raise_if_refused
from ckptctl.ops.retention.policies import RetentionPolicy
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage

__all__ = [
    "ANCHOR_LEVEL",
    "DEFAULT_PARTIAL_AFTER_S",
    "Action",
    "ItemOutcome",
    "Kind",
    "PlanItem",
    "PruneOutcome",
    "PrunePlan",
    "Result",
    "Snapshot",
    "execute",
    "plan",
    "prune",
]


def prune(
    root: Storage,
    policy: RetentionPolicy,
    *,
    partial_after_s: float = DEFAULT_PARTIAL_AFTER_S,
    delete_broken: bool = False,
    reverify: bool = False,
    dry_run: bool = False,
    review: Callable[[PrunePlan], bool] | None = None,
    lock_stale_after_s: float = DEFAULT_STALE_AFTER_S,
    command: str = "prune",
    progress: Progress | None = None,
    layouts: Sequence[Layout] = LAYOUTS,
    seal: bool = False,
) -> tuple[PrunePlan, PruneOutcome | None]:
    """Plan and execute under the root's lock. ``review(plan)`` sees the plan first (to print
    it, to ask for confirmation) and returns whether to go on. Returns the plan and the outcome
    (None for a dry run or when the review said no).

    A dry run takes no lock and writes nothing anywhere, not even the verification record
    (only a real run or ``verify`` writes that). Raises ``LockHeld`` (exit 3) when another run holds the lock, and
    ``NoValidCheckpoint`` (exit 1) after the review when nothing verifies.
    """
    path = root.local_path()
    if path is not None and not os.path.isdir(path):
        # Checked first: taking the lock would create the directory, and a mistyped root
        # should be an error, not a new empty directory.
        raise NotFound(f"{root.url}: no such directory", hint="check the checkpoint root's path")
    kwargs = dict(partial_after_s=partial_after_s, delete_broken=delete_broken, reverify=reverify, progress=progress,
                  layouts=layouts, seal=seal)
    if dry_run:
        p = plan(root, policy, record=False, **kwargs)  # type: ignore[arg-type]
        p.uploads = uploads.in_root(root, idle_for_s=partial_after_s, notes=p.notes, dry_run=True, layouts=layouts)
        if review is not None:
            review(p)
        raise_if_refused(p)
        return p, None
    with RootLock(root, command=command, stale_after_s=lock_stale_after_s) as lock:
        p = plan(root, policy, heartbeat=lock.refresh, **kwargs)  # type: ignore[arg-type]
        p.notes[:0] = lock.notes
        p.uploads = uploads.in_root(root, idle_for_s=partial_after_s, notes=p.notes, dry_run=True, layouts=layouts)
        go = review(p) if review is not None else True
        raise_if_refused(p)
        if not go:
            return p, None
        outcome = execute(p, lock=lock)
        if p.uploads:  # listed again: only what is still idle now is aborted
            uploads.in_root(root, idle_for_s=partial_after_s, notes=outcome.notes, layouts=layouts)
        return p, outcome
