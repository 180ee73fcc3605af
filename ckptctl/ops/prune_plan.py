"""Planning a prune: survey every step entry under the root and decide what to keep and delete.

``plan()`` reads only (apart from the verification record) and never deletes; see
``ckptctl.ops.prune`` for the safety rules it applies and ``prune_execute`` for carrying a
plan out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from ckptctl.durations import format_duration
from ckptctl.errors import InvalidCheckpoint, NoValidCheckpoint, NotFound
from ckptctl.format.checkpoint import list_steps, read_committed
from ckptctl.format.layout import MARKER
from ckptctl.ops.retention import Candidate, KeepSteps, RetentionPolicy
from ckptctl.ops.verify import Level, Progress, VerifyReport
from ckptctl.ops.verify_cache import Fingerprint, VerifyCache, verify_cached
from ckptctl.storage.base import Storage

DEFAULT_PARTIAL_AFTER_S = 6 * 3600.0
ANCHOR_LEVEL: Level = "load"

Action = Literal["keep", "delete", "skip"]
Kind = Literal["committed", "broken", "partial", "link", "duplicate"]
Snapshot = tuple[tuple[str, int, float, str], ...]  # (key, size, mtime, kind) of every file


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




def raise_if_refused(p: PrunePlan) -> None:
    """``NoValidCheckpoint`` (exit 1) when the plan found no checkpoint that verifies."""
    if p.refused is not None:
        raise NoValidCheckpoint(p.refused, hint="run `ckptctl verify ROOT --all` to see what is wrong with each")


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


def snapshot_of(ckpt: Storage) -> Snapshot:
    return tuple(sorted((i.key, i.size, i.mtime, i.kind) for i in ckpt.list()))


def _survey(root: Storage, step: int, name: str, kind: str, now: float, partial_after_s: float) -> PlanItem:
    """Classify one step entry from its listing, marker and manifest (no data read)."""
    url = root.url_of(name)
    if kind == "link":
        return PlanItem(step, name, url, "link", "delete",
                        "symlink: the link is removed, never followed; its target is not touched")
    ckpt = root.sub(name)
    snap = snapshot_of(ckpt)
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
