"""``prune``: delete old checkpoints without ever losing the last good one.

``plan()`` reads and decides; ``execute(plan)`` re-checks and deletes; ``prune()`` does both under
the root's lock and is what the CLI and ``Checkpointer(keep_last=...)`` call.

Safety, in this order (issue 4, PRODUCT.md):

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
   checkpoint anyone resumes from, and leaving it would make it look like one to people.
5. Committed checkpoints older than the anchor are deleted unless a policy keeps them. Older
   ones are not verified (that would read everything on every run); policies count them.

Deleting one checkpoint removes its marker first, then the manifest, then everything else, then
the empty directory: a prune killed at any point leaves something that reads as partial, never
as committed. Before touching an entry, ``execute`` lists it again and deletes only if it is
exactly as planned (same files, sizes and mtimes), and it checks each file again just before
removing it; an entry that changed (a save started writing into it) is skipped and reported.
Everything goes through the ``Storage`` rooted at ROOT, which never follows links, so nothing
outside the root is touched.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from ckptctl.durations import format_duration
from ckptctl.errors import CkptError, InvalidCheckpoint, NoValidCheckpoint, NotFound, RefusedForSafety
from ckptctl.format.checkpoint import list_steps, read_committed
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.ops.lock import DEFAULT_STALE_AFTER_S, RootLock
from ckptctl.ops.retention import Candidate, KeepSteps, RetentionPolicy
from ckptctl.ops.verify import Level, Progress, VerifyReport
from ckptctl.ops.verify_cache import Fingerprint, VerifyCache, fingerprint, verify_cached
from ckptctl.storage.base import Storage

DEFAULT_PARTIAL_AFTER_S = 6 * 3600.0
ANCHOR_LEVEL: Level = "load"

Action = Literal["keep", "delete", "skip"]
Kind = Literal["committed", "broken", "partial", "link", "duplicate"]
Snapshot = tuple[tuple[str, int, float, str], ...]  # (key, size, mtime, kind) of every file

log = logging.getLogger("ckptctl")


@dataclass
class PlanItem:
    """One step entry under the root and what the plan does with it."""

    step: int
    name: str
    url: str
    kind: Kind
    action: Action = "skip"
    reason: str = ""
    size: int = 0
    created: float | None = None  # manifest time (committed and broken-but-readable ones)
    modified: float | None = None  # newest modification inside (partial ones)
    verification: dict[str, Any] | None = None  # summary of a verification, when one ran
    snapshot: Snapshot = ()  # the files as planned; execute deletes only if they are unchanged

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "name": self.name, "url": self.url, "kind": self.kind,
            "action": self.action, "reason": self.reason, "size": self.size,
            "created": self.created, "modified": self.modified, "verification": self.verification,
        }


@dataclass
class PrunePlan:
    root: Storage
    policy: RetentionPolicy
    partial_after_s: float
    delete_broken: bool
    reverify: bool
    now: float
    items: list[PlanItem] = field(default_factory=list)  # ordered by step, then name
    anchor: PlanItem | None = None
    refused: str | None = None  # why nothing may be deleted (no checkpoint verifies)
    notes: list[str] = field(default_factory=list)
    anchor_fingerprint: Fingerprint | None = None
    cache: VerifyCache | None = None

    @property
    def deletions(self) -> list[PlanItem]:
        return [i for i in self.items if i.action == "delete"]

    @property
    def broken_left(self) -> list[PlanItem]:
        """Broken checkpoints this plan leaves in place (a problem to report)."""
        return [i for i in self.items if i.kind == "broken" and i.action != "delete"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root.url,
            "policy": self.policy.describe(),
            "partial_after_s": self.partial_after_s,
            "delete_broken": self.delete_broken,
            "reverify": self.reverify,
            "anchor": None if self.anchor is None else {"step": self.anchor.step, "name": self.anchor.name, "url": self.anchor.url},
            "refused": self.refused,
            "items": [i.to_dict() for i in self.items],
            "notes": list(self.notes),
        }


Result = Literal["deleted", "kept", "skipped", "failed"]


@dataclass
class ItemOutcome:
    step: int
    name: str
    planned: Action
    result: Result
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "planned": self.planned, "result": self.result, "detail": self.detail}


@dataclass
class PruneOutcome:
    items: list[ItemOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def _with(self, result: Result) -> list[ItemOutcome]:
        return [i for i in self.items if i.result == result]

    @property
    def deleted(self) -> list[ItemOutcome]:
        return self._with("deleted")

    @property
    def failed(self) -> list[ItemOutcome]:
        return self._with("failed")

    @property
    def skipped(self) -> list[ItemOutcome]:
        """Planned deletions that were not done because the entry changed."""
        return [i for i in self.items if i.planned == "delete" and i.result == "skipped"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "deleted": [i.name for i in self.deleted],
            "failed": [i.to_dict() for i in self.failed],
            "skipped": [i.to_dict() for i in self.skipped],
            "items": [i.to_dict() for i in self.items],
            "notes": list(self.notes),
        }


# --- planning ------------------------------------------------------------------------------


def plan(
    root: Storage,
    policy: RetentionPolicy,
    *,
    partial_after_s: float = DEFAULT_PARTIAL_AFTER_S,
    delete_broken: bool = False,
    reverify: bool = False,
    now: float | None = None,
    progress: Progress | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> PrunePlan:
    """Decide what to keep and delete under ``root``. Reads only, apart from the verification
    record (an optimisation that is always safe to write). Never raises for a checkpoint
    problem: a plan with nothing verified has ``refused`` set and deletes nothing.

    ``heartbeat`` is called between verifications (a lock holder refreshes its lock there).
    """
    p = PrunePlan(root, policy, partial_after_s, delete_broken, reverify, time.time() if now is None else now)
    p.cache = VerifyCache.load(root)
    p.items = [_survey(root, e.step, e.name, e.kind, p.now, partial_after_s) for e in list_steps(root)]
    _mark_duplicates(p.items)
    _choose_anchor(p, progress, heartbeat)
    _apply_policy(p)
    for item in p.items:
        if item.kind == "broken":
            _decide_broken(p, item)
    if p.refused is not None:
        for item in p.deletions:
            item.action, item.reason = "skip", f"{item.reason}; not deleted: no checkpoint verifies"
    p.cache.retain({i.name for i in p.items if i.kind in ("committed", "broken")})
    p.cache.save()
    p.notes.extend(p.cache.notes)
    return p


def _snapshot(ckpt: Storage) -> Snapshot:
    return tuple(sorted((i.key, i.size, i.mtime, i.kind) for i in ckpt.list()))


def _survey(root: Storage, step: int, name: str, kind: str, now: float, partial_after_s: float) -> PlanItem:
    """Classify one step entry from its listing, marker and manifest (no data read)."""
    url = root.url_of(name)
    if kind == "link":
        return PlanItem(step, name, url, "link", "delete",
                        "symlink: the link is removed, never followed; its target is not touched")
    ckpt = root.sub(name)
    snap = _snapshot(ckpt)
    item = PlanItem(step, name, url, "partial", size=sum(s[1] for s in snap if s[3] == "file"), snapshot=snap)
    if not any(key == MARKER for key, *_ in snap):
        own = root.stat(name)
        item.modified = max([s[2] for s in snap] + [own.mtime if own else 0.0])
        idle = now - item.modified
        if idle >= partial_after_s:
            item.action = "delete"
            item.reason = (f"abandoned: no marker and nothing modified for {format_duration(idle)} "
                           f"(--partial-after {format_duration(partial_after_s)})")
        else:
            item.reason = (f"no marker, modified {format_duration(max(0.0, idle))} ago: may still be "
                           f"written; left alone until idle for {format_duration(partial_after_s)}")
        return item
    try:
        manifest, _ = read_committed(ckpt)
    except (NotFound, InvalidCheckpoint) as e:
        item.kind, item.reason = "broken", str(e)
        return item
    item.kind, item.created = "committed", manifest.created
    return item


def _mark_duplicates(items: list[PlanItem]) -> None:
    """Two directories for one step (``step-9`` and ``step-0000000009``): which one a reader
    picks is not well defined, so neither is ever deleted or trusted as the anchor."""
    dirs: dict[int, list[PlanItem]] = {}
    for i in items:
        if i.kind != "link":
            dirs.setdefault(i.step, []).append(i)
    for same in dirs.values():
        if len(same) > 1:
            names = ", ".join(i.name for i in same)
            for i in same:
                i.kind, i.action = "duplicate", "skip"
                i.reason = f"{len(same)} directories claim step {i.step} ({names}); left alone, rename one"


def _summary(report: VerifyReport, cached: bool) -> dict[str, Any]:
    return {
        "ok": report.ok, "cached": cached, "level": report.level, "bytes_read": report.bytes_read,
        "seconds": round(report.seconds, 3), "problems": [str(pr) for pr in report.problems], "note": report.note,
    }


def _choose_anchor(p: PrunePlan, progress: Progress | None, heartbeat: Callable[[], None] | None) -> None:
    committed = [i for i in p.items if i.kind == "committed"]
    for item in reversed(committed):
        if heartbeat:
            heartbeat()
        report, cached, fp = verify_cached(p.root.sub(item.name), item.name, p.cache,
                                           level=ANCHOR_LEVEL, reverify=p.reverify, progress=progress)
        item.verification = _summary(report, cached)
        if report.ok and fp is not None:
            p.anchor, p.anchor_fingerprint = item, fp
            return
        item.kind = "broken"
        item.reason = ("changed while it was being verified" if report.ok
                       else f"fails full verification: {report.problems[0]}"
                       + (f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""))
    marked = [i for i in p.items if i.kind == "broken"]
    if marked:
        p.refused = (f"{p.root.url}: none of {len(marked)} committed checkpoint(s) passes full verification; "
                     "nothing is deleted")
    else:
        p.refused = f"{p.root.url}: no committed checkpoint; nothing is deleted"


def _apply_policy(p: PrunePlan) -> None:
    """Committed checkpoints up to the anchor go to the policies; the anchor is always kept."""
    cands = [i for i in p.items if i.kind == "committed" and (p.anchor is None or i.step <= p.anchor.step)]
    by_step = {i.step: i for i in cands}
    anchor = p.anchor.step if p.anchor is not None else None
    decisions = p.policy.decide([Candidate(i.step, float(i.created or 0.0)) for i in cands], anchor)
    for step, d in decisions.items():
        item = by_step[step]
        if d.keep:
            item.action, item.reason = "keep", "; ".join(d.reasons)
        else:
            item.action = "delete"
            item.reason = (f"older than the anchor (step {anchor}) and kept by no policy ({p.policy.describe()})"
                           if anchor is not None else f"kept by no policy ({p.policy.describe()})")
    for pol in p.policy.policies:
        if isinstance(pol, KeepSteps):
            for step in sorted(pol.missing([Candidate(i.step, 0.0) for i in cands])):
                p.notes.append(f"--keep {step}: no committed checkpoint has that step")


def _decide_broken(p: PrunePlan, item: PlanItem) -> None:
    newer = p.anchor is None or item.step > p.anchor.step
    where = "newer than the anchor" if newer else "older than the anchor"
    if p.delete_broken and p.anchor is not None:
        item.action, item.reason = "delete", f"broken ({where}), --delete-broken: {item.reason}"
    else:
        item.action = "skip"
        item.reason = f"broken ({where}), reported, not deleted (--delete-broken removes it): {item.reason}"


# --- executing -----------------------------------------------------------------------------


class _Changed(Exception):
    """An entry differs from the plan; stop deleting it."""


def execute(plan: PrunePlan, *, lock: RootLock | None = None) -> PruneOutcome:
    """Carry out ``plan``. Takes the root's lock unless ``lock`` (held by the caller) is given.

    Raises ``NoValidCheckpoint`` if the plan has no anchor and ``RefusedForSafety`` if the anchor
    changed since it was verified; in both cases nothing is deleted.
    """
    if plan.refused is not None:
        raise NoValidCheckpoint(plan.refused, hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
    if lock is None:
        with RootLock(plan.root, command="prune") as own:
            outcome = _execute(plan, own)
            outcome.notes[:0] = own.notes
            return outcome
    return _execute(plan, lock)


def _execute(plan: PrunePlan, lock: RootLock) -> PruneOutcome:
    assert plan.anchor is not None
    anchor = plan.root.sub(plan.anchor.name)
    if fingerprint(anchor) != plan.anchor_fingerprint:
        raise RefusedForSafety(
            f"{anchor.url} changed after it was verified; nothing was deleted",
            hint="run prune again: it verifies the checkpoints afresh",
        )
    outcome = PruneOutcome()
    for item in plan.items:
        if item.action != "delete":
            outcome.items.append(ItemOutcome(item.step, item.name, item.action, "kept" if item.action == "keep" else "skipped"))
            continue
        lock.refresh()
        try:
            why = _changed_since_plan(plan, item)
            if why is None:
                _delete(plan.root, item)
                outcome.items.append(ItemOutcome(item.step, item.name, "delete", "deleted", _left_over(plan.root, item)))
            else:
                outcome.items.append(ItemOutcome(item.step, item.name, "delete", "skipped", why))
        except _Changed as e:
            outcome.items.append(ItemOutcome(item.step, item.name, "delete", "skipped", str(e)))
        except RefusedForSafety:
            raise
        except CkptError as e:  # storage trouble with this entry: report it, go on with the rest
            outcome.items.append(ItemOutcome(item.step, item.name, "delete", "failed", str(e)))
            log.warning("prune: could not delete %s: %s", item.url, e)
    if plan.cache is not None:
        plan.cache.retain({i.name for i in plan.items if i.kind in ("committed", "broken")} - {o.name for o in outcome.deleted})
        plan.cache.save()
        outcome.notes.extend(n for n in plan.cache.notes if n not in plan.notes)
    return outcome


def _changed_since_plan(plan: PrunePlan, item: PlanItem) -> str | None:
    """Why ``item`` may no longer be deleted, or None when it is exactly as planned."""
    assert plan.anchor is not None
    if item.kind == "committed" and item.step >= plan.anchor.step:
        raise RefusedForSafety(f"plan would delete {item.url}, not older than the anchor; refusing")
    if item.kind == "link":
        info = plan.root.stat(item.name)
        return None if info is not None and info.kind == "link" else "no longer a symlink; left alone"
    if _snapshot(plan.root.sub(item.name)) != item.snapshot:
        return "changed since the plan (a save may be writing into it); left alone"
    return None


def _delete(root: Storage, item: PlanItem) -> None:
    """Marker first, then manifest, then the rest, then the empty directory."""
    if item.kind == "link":
        root.delete(item.name)
        return
    ckpt = root.sub(item.name)
    first = {MARKER: 0, MANIFEST: 1}
    for key, size, mtime, _kind in sorted(item.snapshot, key=lambda s: (first.get(s[0], 2), s[0])):
        now = ckpt.stat(key)
        if now is None:
            continue  # already gone (an earlier, interrupted prune)
        if (now.size, now.mtime) != (size, mtime):
            raise _Changed(f"{ckpt.url_of(key)} changed while deleting; the rest is left in place")
        ckpt.delete(key)
    root.remove_dir(item.name)


def _left_over(root: Storage, item: PlanItem) -> str | None:
    if item.kind != "link" and root.stat(item.name) is not None:
        return "files that appeared after the plan were left in place"
    return None


# --- both, under the lock --------------------------------------------------------------------


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
) -> tuple[PrunePlan, PruneOutcome | None]:
    """Plan and execute under the root's lock. ``review(plan)`` sees the plan first (to print
    it, to ask for confirmation) and returns whether to go on. Returns the plan and the outcome
    (None for a dry run or when the review said no).

    A dry run takes no lock: it only reads (and updates the verification record, which is safe
    without one). Raises ``LockHeld`` (exit 3) when another run holds the lock, and
    ``NoValidCheckpoint`` (exit 1) after the review when nothing verifies.
    """
    path = root.local_path()
    if path is not None and not os.path.isdir(path):
        # Checked first: taking the lock would create the directory, and a mistyped root
        # should be an error, not a new empty directory.
        raise NotFound(f"{root.url}: no such directory", hint="check the checkpoint root's path")
    kwargs = dict(partial_after_s=partial_after_s, delete_broken=delete_broken, reverify=reverify, progress=progress)
    if dry_run:
        p = plan(root, policy, **kwargs)  # type: ignore[arg-type]
        if review is not None:
            review(p)
        if p.refused is not None:
            raise NoValidCheckpoint(p.refused, hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
        return p, None
    with RootLock(root, command=command, stale_after_s=lock_stale_after_s) as lock:
        p = plan(root, policy, heartbeat=lock.refresh, **kwargs)  # type: ignore[arg-type]
        p.notes[:0] = lock.notes
        go = review(p) if review is not None else True
        if p.refused is not None:
            raise NoValidCheckpoint(p.refused, hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
        if not go:
            return p, None
        return p, execute(p, lock=lock)
