"""``du``: the size of each checkpoint under a root, the total, and what a prune would free.

Sizes come from listing the files (no data read). With a retention policy, the prune plan is
made exactly as ``prune --dry-run`` makes it (``ops.retention.plan.plan``, the newest checkpoint
verified fully, or found unchanged in the verification record) and nothing is written, so
"will free" is what ``prune`` with the same options deletes, not an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptctl.ops.listing import Listed, list_checkpoints, wrong_level_error
from ckptctl.ops.retention.plan import DEFAULT_PARTIAL_AFTER_S, plan
from ckptctl.ops.retention.planned import PrunePlan
from ckptctl.ops.retention.policies import RetentionPolicy
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

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

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
                "checkpoints_freed": None if self.policy is None else len(self.freed), "notes": list(self.notes)}


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
        return report
    p: PrunePlan = plan(storage, policy, partial_after_s=partial_after_s, delete_broken=delete_broken,
                        progress=progress, record=False)
    report.policy, report.refused, report.notes = policy.describe(), p.refused, list(p.notes)
    by_name = {i.name: i for i in p.items}
    for e in report.entries:
        item = by_name.get(e.name)
        if item is not None:
            e.prune, e.reason = item.action, item.reason or e.reason
    return report
