"""``du``: the size of each checkpoint under a root, the total, and what a prune would free.

Sizes come from listing the files (no data read). With a retention policy, the prune plan is
made exactly as ``prune --dry-run`` makes it (``ops.retention.plan.plan``, the newest checkpoint
verified fully, or found unchanged in the verification record) and nothing is written, so
"will free" is what ``prune`` with the same options deletes, not an estimate.

What killed runs left beside the checkpoints (``ops.retention.scratch``: restores' staging
copies, the temporaries of ckptctl's writes at the root) no checkpoint's size counts: they are
listed apart (``scratch``), found by the functions prune plans them with. A temporary inside a
checkpoint directory is counted in that checkpoint's size, as every file in it is; what prune
would delete of those is added to ``scratch_bytes_freed`` only, so that ``bytes_freed +
scratch_bytes_freed`` is what prune frees and ``bytes + scratch_bytes`` all ckptctl knows of.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS
from ckptctl.ops.listing import Listed, list_checkpoints, wrong_level_error
from ckptctl.ops.retention.plan import DEFAULT_PARTIAL_AFTER_S, plan
from ckptctl.ops.retention.planned import PlanItem, PrunePlan
from ckptctl.ops.retention.policies import RetentionPolicy
from ckptctl.ops.retention.scratch import staging_copies, temporaries
from ckptctl.ops.targets import open_root
from ckptctl.progress import Progress

__all__ = ["DuEntry", "DuReport", "disk_usage"]


@dataclass
class DuEntry:
    step: int
    name: str
    url: str
    status: str
    layout: str
    bytes: int
    prune: str | None = None  # with a policy: keep, delete or skip
    reason: str | None = None  # why it is not committed (as ls says), or, with a policy, the prune plan's reason

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "url": self.url, "status": self.status, "layout": self.layout,
                "bytes": self.bytes, "prune": self.prune, "reason": self.reason}


@dataclass
class DuReport:
    root: str
    entries: list[DuEntry] = field(default_factory=list)  # oldest first, as ls lists them
    policy: str | None = None
    refused: str | None = None  # why a prune would delete nothing at all
    notes: list[str] = field(default_factory=list)
    scratch: list[DuEntry] = field(default_factory=list)  # killed runs' staging copies and temporaries at the root
    freed_inside: int = 0  # with a policy: bytes of temporaries inside kept checkpoints that prune would delete

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

    @property
    def scratch_bytes(self) -> int:
        return sum(e.bytes for e in self.scratch)

    @property
    def scratch_bytes_freed(self) -> int:
        return sum(e.bytes for e in self.scratch if e.prune == "delete") + self.freed_inside

    @property
    def freed(self) -> list[DuEntry]:
        return [e for e in self.entries if e.prune == "delete"]

    @property
    def bytes_freed(self) -> int:
        return sum(e.bytes for e in self.freed)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.root, "checkpoints": [e.to_dict() for e in self.entries], "bytes": self.bytes,
                "policy": self.policy, "refused": self.refused,
                "bytes_freed": None if self.policy is None else self.bytes_freed,
                "checkpoints_freed": None if self.policy is None else len(self.freed), "notes": list(self.notes),
                "scratch": [e.to_dict() for e in self.scratch], "scratch_bytes": self.scratch_bytes,
                "scratch_bytes_freed": None if self.policy is None else self.scratch_bytes_freed}


def disk_usage(
    root: str,
    policy: RetentionPolicy | None = None,
    *,
    partial_after_s: float = DEFAULT_PARTIAL_AFTER_S,
    delete_broken: bool = False,
    progress: Progress | None = None,
) -> DuReport:
    """Sizes under the root at ``root``; with ``policy``, what ``prune`` would delete.
    Writes nothing."""
    storage = open_root(root)
    listed: list[Listed] = list_checkpoints(storage)
    wrong = wrong_level_error(storage, root, "ckptctl du {}") if not listed else None
    if wrong is not None:  # "0 B in 0 checkpoints" would read as an empty run
        raise wrong
    report = DuReport(storage.url, [DuEntry(e.step, e.name, e.url, e.status, e.layout, e.size, reason=e.reason)
                                    for e in listed])
    if policy is None:
        own, now = CHECKPOINTER_LAYOUTS[0], time.time()
        left = staging_copies(storage, own, now, partial_after_s) + temporaries(storage, own, now, partial_after_s)
        report.scratch = [_scratch_entry(i, with_plan=False) for i in left]
        return report
    p: PrunePlan = plan(storage, policy, partial_after_s=partial_after_s, delete_broken=delete_broken,
                        progress=progress, record=False)
    report.policy, report.refused, report.notes = policy.describe(), p.refused, list(p.notes)
    by_name = {i.name: i for i in p.items}
    for e in report.entries:
        item = by_name.get(e.name)
        if item is not None:
            e.prune, e.reason = item.action, item.reason or e.reason
    for item in p.items:
        if item.kind not in ("staging", "temporary"):
            continue
        if "/" not in item.name:  # at the root
            report.scratch.append(_scratch_entry(item, with_plan=True))
        elif item.action == "delete":  # inside a checkpoint, whose size counts it
            report.freed_inside += item.size
    return report


def _scratch_entry(item: PlanItem, *, with_plan: bool) -> DuEntry:
    """A staging copy or temporary as du lists it: with a policy, what the plan does with it;
    without, only why prune would or would not reclaim it."""
    return DuEntry(item.step, item.name, item.url, item.kind, item.layout, item.size,
                   prune=item.action if with_plan else None, reason=item.reason)
