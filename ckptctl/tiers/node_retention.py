"""Retention of a node-local first tier: rank 0 decides, each node's leader deletes.

``ckptctl prune``'s planner cannot run on one node's root: it verifies the anchor fully, and a
node holds only its own ranks' shards. So the decision and the deletion are split:

* rank 0 plans (``plan``) from its own node's committed checkpoints with the tier's rules,
  plus the promoter's pins (``tiers.pins``: what is chosen for promotion and not yet promoted
  is never deleted), anchored on the newest committed step (always kept);
* each node's leader, before deleting anything, verifies its node's part of that anchor byte
  for byte (``node_commit.check_node_files``: marker, manifest, every chunk checksum of its
  ranks' files), and deletes nothing when it does not verify; then removes each planned step
  on its node marker first (``layouts.native.remove``), so a deletion cut short leaves a
  partial directory, never a committed one.

May import: ``ops.retention.policies``, ``layouts``, ``tiers.pins``, ``tiers.node_commit``, ``storage``, leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from ckptctl.errors import CkptError
from ckptctl.layouts.catalog import NATIVE, newest_committed
from ckptctl.layouts.native import remove
from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.ops.retention.base import Candidate
from ckptctl.storage.base import Storage
from ckptctl.tiers.node_commit import check_node_files
from ckptctl.tiers.pins import guarded

log = logging.getLogger("ckptctl")


@dataclass(frozen=True)
class PrunePlan:
    anchor: str  # the newest committed checkpoint's name: verified on each node before deleting
    delete: tuple[str, ...]  # names, oldest first


def plan(root: Storage, rules: Policy | RetentionPolicy, pins: frozenset[int], to: str) -> PrunePlan | None:
    """What retention deletes on every node, from rank 0's node's first tier; None when
    nothing is to be deleted."""
    entries = [e for e in newest_committed(root, layouts=NATIVE) if e.manifest is not None]
    if len(entries) < 2:
        return None
    policy = RetentionPolicy.of(guarded(RetentionPolicy.of(rules), pins, to))
    candidates = [Candidate(e.step, float(e.manifest.created), e.manifest.metrics) for e in entries]  # type: ignore[union-attr]
    decisions = policy.decide(candidates, entries[0].step)
    delete = tuple(e.name for e in reversed(entries) if not decisions[e.step].keep)
    return PrunePlan(entries[0].name, delete) if delete else None


class NodePruner:
    """Applies rank 0's plans to one node's first tier (``ranks``: the node's)."""

    def __init__(self, root: Storage, ranks: Collection[int]) -> None:
        self.root, self.ranks = root, frozenset(ranks)
        self._verified: str | None = None  # the anchor last verified here: each is read once

    def apply(self, p: PrunePlan) -> list[str]:
        """Delete ``p.delete`` here once the anchor verifies here. Returns the names deleted."""
        if self._verified != p.anchor:
            why = check_node_files(self.root.sub(p.anchor), self.ranks)
            if why is not None:
                log.error("retention of %s: deleting nothing, the newest checkpoint %s does not verify on this node: %s",
                          self.root.url, p.anchor, why)
                return []
            self._verified = p.anchor
        deleted = []
        for name in p.delete:
            if name == p.anchor or self.root.stat(name) is None:
                continue
            try:
                remove(self.root.sub(name))
                deleted.append(name)
            except CkptError as e:
                log.warning("retention of %s: could not delete %s: %s", self.root.url, name, e)
        if deleted:
            log.info("retention of %s: deleted %s", self.root.url, ", ".join(deleted))
        return deleted
