"""``ls ROOT --tier URL``: where each checkpoint of a tiered run lives.

A ``Checkpointer(tiers=[...])`` commits to its first tier and promotes to the next ones
(``ckptctl.tiers``), so one step may be committed on NVMe only, on S3 only, on both, or partial
on one (a promotion in progress). This lists every tier's checkpoints with the same catalog
``ls`` uses and lines them up by checkpoint (step and name), oldest first: per tier, the
checkpoint's status there, or None where that tier does not hold it.

A node-local first tier (``Tier(path, node_local=True)``) holds on each node only the shards
that node's ranks wrote, plus the manifest and marker: its steps are committed there by the
node-local rule while other nodes' files are absent by design. On a root on a filesystem, a
committed checkpoint whose manifest lists files that are not there reads ``node part``, not
``committed`` (a whole copy is on another tier, or all nodes together hold one); ``verify``
checks the node's own files and names the others' as elsewhere (``layouts.node_part``). One listing per committed checkpoint,
on local disks only: an object store is never a node's tier, and its listings cost requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ckptctl.errors import UsageError
from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.ops.targets import open_root
from ckptctl.storage.base import Storage

# Committed by its marker, and some files its manifest lists are not on this disk.
NODE_PART = "node part"


@dataclass(frozen=True)
class TierRow:
    """One checkpoint (a step and its directory's name) and its status on each tier."""

    step: int
    name: str
    where: dict[str, str | None]  # tier URL -> status there ("committed", "partial", ...) or None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "tiers": dict(self.where)}


@dataclass
class TierListing:
    tiers: list[str]  # the roots, nearest first, as given
    rows: list[TierRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"tiers": list(self.tiers), "checkpoints": [r.to_dict() for r in self.rows]}


def list_tiers(roots: Sequence[str]) -> TierListing:
    """Every checkpoint of every root in ``roots`` (nearest tier first), lined up by step and
    name. Raises UsageError for a root named twice or one that does not exist."""
    if len(set(roots)) != len(roots):
        raise UsageError(f"a tier is named twice: {', '.join(roots)}", hint="give each tier's root once")
    by_tier = {root: _statuses(open_root(root)) for root in roots}
    keys = sorted({key for listed in by_tier.values() for key in listed})
    return TierListing(list(roots), [TierRow(step, name, {root: by_tier[root].get((step, name)) for root in roots})
                                     for step, name in keys])


def _statuses(root: Storage) -> dict[tuple[int, str], str]:
    """(step, name) -> the catalog's status of each checkpoint under ``root``, ``NODE_PART`` for
    a committed one on a filesystem that lacks files its manifest lists."""
    found: dict[tuple[int, str], str] = {}
    local = root.local_path() is not None
    for e in list_checkpoints(root):
        status = e.status
        if local and status == "committed" and e.manifest is not None and e.storage is not None:
            here = {info.key for info in e.storage.list() if info.kind == "file"}
            if any(f.name not in here for f in e.manifest.files):
                status = NODE_PART
        found[(e.step, e.name)] = status
    return found
