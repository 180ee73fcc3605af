"""What a prune plan says: each entry under the root and what the plan does with it
(``PlanItem``), and the plan as a whole (``PrunePlan``: its anchors, why it refuses, its JSON).

``ops.retention.plan`` makes a plan, ``ops.retention.execute`` carries one out; ``prune --dry-run``
and ``du`` print one. May import: ``layouts``, ``storage``, ``ops.retention.policies`` (the plan's
policy), ``ops.verify.cache`` (the verification record an anchor is checked against) and the leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ckptctl.durations import format_duration
from ckptctl.errors import NoValidCheckpoint
from ckptctl.layouts.base import UNKNOWN, Layout, numbered
from ckptctl.layouts.removal import Snapshot
from ckptctl.ops.retention.policies import RetentionPolicy
from ckptctl.ops.verify.cache import Fingerprint, VerifyCache
from ckptctl.storage.base import Storage

Action = Literal["keep", "delete", "skip"]
# staging (a killed restore's copy), temporary (a killed ckptctl write's file): ops.retention.scratch
Kind = Literal["committed", "broken", "partial", "link", "duplicate", "unknown", "staging", "temporary"]


@dataclass
class PlanItem:
    """One step entry under the root (or what a killed run left: a restore's staging copy, a
    write's temporary) and what the plan does with it."""

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
    layout: str = UNKNOWN  # whose checkpoint it is (layouts.catalog)
    metrics: dict[str, float] = field(default_factory=dict)  # recorded at save time (KeepBest ranks by them)
    owner: Layout | None = None  # its layout, bound to the root (None for an unknown entry)
    fingerprint: Fingerprint | None = None  # an anchor: what its verification vouched for
    numbered_by: str = "step"  # what ``step`` counts: accelerate's checkpoint_N, a "save index"

    @property
    def label(self) -> str:
        """``step 20``, or ``save index 2``: its number named for what it counts."""
        return numbered(self.numbered_by, self.step)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "name": self.name, "url": self.url, "kind": self.kind, "layout": self.layout,
            "numbered_by": self.numbered_by,
            "action": self.action, "reason": self.reason, "size": self.size,
            "created": self.created, "modified": self.modified, "verification": self.verification,
            "metrics": dict(self.metrics),
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
    anchor: PlanItem | None = None  # the first managed layout's anchor (catalog order: ckptctl's own first)
    refused: str | None = None  # why nothing may be deleted (no checkpoint verifies)
    notes: list[str] = field(default_factory=list)
    cache: VerifyCache | None = None
    anchors: dict[str, PlanItem] = field(default_factory=dict)  # layout -> its anchor
    seal: bool = False  # seal the other stacks' anchors it verified (``prune --seal``)
    record: bool = True  # False for a dry run: nothing is written, no seal either
    uploads: list[str] = field(default_factory=list)  # unfinished S3 uploads it aborts (ops.transfer.uploads)
    managed: dict[str, Layout] = field(default_factory=dict)  # by name: the layouts it may delete from

    def layout_of(self, item: PlanItem) -> Layout | None:
        """``item``'s layout when this plan manages it; None when it is left alone."""
        return self.managed.get(item.layout)

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
            "anchors": {k: {"step": a.step, "name": a.name, "url": a.url} for k, a in self.anchors.items()},
            "refused": self.refused,
            "items": [i.to_dict() for i in self.items],
            "notes": list(self.notes),
            "uploads": list(self.uploads),
        }




def by_idle_time(root: Storage, item: PlanItem, now: float, partial_after_s: float, what: str) -> None:
    """Prune's rule for what may still be written (a partial checkpoint, a restore's staging
    copy, a write's temporary), ``what`` it is: ``item`` (its snapshot taken) is deleted when nothing in it, the
    directory itself included, was modified for ``partial_after_s`` at ``now``; else left alone."""
    own = root.stat(item.name)
    item.modified = max([s[2] for s in item.snapshot] + [own.mtime if own else 0.0])
    idle = now - item.modified
    if idle >= partial_after_s:
        item.action = "delete"
        item.reason = (f"abandoned: {what}, and nothing modified for {format_duration(idle)} "
                       f"(--partial-after {format_duration(partial_after_s)})")
    else:
        item.reason = (f"{what}, modified {format_duration(max(0.0, idle))} ago: may still be "
                       f"written; left alone until idle for {format_duration(partial_after_s)}")


def raise_if_refused(p: PrunePlan) -> None:
    """``NoValidCheckpoint`` (exit 1) when the plan found no checkpoint that verifies."""
    if p.refused is not None:
        raise NoValidCheckpoint(p.refused, hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
