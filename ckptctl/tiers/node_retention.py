"""Retention of a node-local first tier: rank 0 decides, each node's leader deletes.

``ckptctl prune``'s planner cannot run on one node's root: it verifies the anchor fully, and a
node holds only its own ranks' shards. So the decision and the deletion are split:

* rank 0 plans (``plan``) from its own node's committed checkpoints with the tier's rules,
  plus the promoter's pins (``tiers.pins``: what is chosen for promotion and not yet promoted
  is never deleted), anchored on the newest committed step (always kept);
* each node's leader, before deleting anything, verifies its node's part of that anchor byte
  for byte (``node_commit.check_node_files``: marker, manifest, every chunk checksum of its
  ranks' files), and deletes nothing when it does not verify; then removes each planned step
  on its node marker first (``layouts.native_commit.remove``), so a deletion cut short leaves a
  partial directory, never a committed one;
* each leader removes the peer replicas (``tiers.replica_store``) of the steps it deletes, and
  abandoned ones (of steps older than the anchor it no longer holds; incomplete ones once
  idle for the partial-after time), whether or not anything else is deleted;
* with the same verified anchor, each leader also removes its node's abandoned partial step
  directories (a save that failed or was killed there, a copy whose commit never came) by
  ``ckptctl prune``'s rule for them (``tiers.leftovers``: idle for prune's partial-after time,
  never a directory another layout's rule calls complete, never a symlink, each deleted only
  while unchanged, marker first, under the root's lock), except the steps the plan keeps (the
  anchor, the promoter's pins: their parts on this node are read by a promotion round); the
  partials of saves rank 0 saw fail in this run, older than the anchor, without waiting for
  the idle time (a full disk fails saves one after another, and each leaves a directory).

Rank 0 sends a plan after every commit whenever the tier has rules, even when it deletes
nothing (a node may hold partials rank 0 cannot see); a node reads its part of a new anchor
only when it has something to delete.

May import: ``ops.retention.policies``, ``layouts``, ``tiers.pins``, ``tiers.node_commit``,
``tiers.leftovers``, ``tiers.replica_store``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from ckptctl.errors import CkptError
from ckptctl.format.layout import MARKER, parse_step_dir, step_dir
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, newest_committed
from ckptctl.layouts.native_commit import remove
from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.ops.retention.base import Candidate
from ckptctl.storage.base import Storage
from ckptctl.tiers.leftovers import PARTIAL_AFTER_S, abandoned
from ckptctl.tiers.leftovers import remove as remove_partials
from ckptctl.tiers.node_commit import check_node_files
from ckptctl.tiers.pins import guarded
from ckptctl.tiers.replica_store import sweep as sweep_replicas

log = logging.getLogger("ckptctl")


@dataclass(frozen=True)
class PrunePlan:
    anchor: str  # the newest committed checkpoint's name: verified on each node before deleting
    delete: tuple[str, ...]  # names, oldest first
    keep: tuple[str, ...] = ()  # pinned for promotion: never removed as partial on a node
    failed: tuple[str, ...] = ()  # saves of this run that failed: their partials go without the idle time


def held(root: Storage) -> list[list]:
    """What a node's first tier holds committed, as a leader publishes it for rank 0's plans:
    ``[name, step, created, metrics]`` of each step, newest first."""
    return [[e.name, e.step, float(e.manifest.created), dict(e.manifest.metrics)]
            for e in newest_committed(root, layouts=CHECKPOINTER_LAYOUTS) if e.manifest is not None]


def plan(root: Storage, rules: Policy | RetentionPolicy, pins: frozenset[int], to: str,
         failed: Collection[int] = (), newest_started: int | None = None,
         elsewhere: Collection[list] = ()) -> PrunePlan | None:
    """What retention deletes on every node, from rank 0's node's first tier (possibly
    nothing: each node still removes its abandoned partials); None when nothing is committed.
    ``elsewhere``: what the other nodes said they hold (``held``), so that a step rank 0's node
    no longer holds (pruned there, or its disk lost) is decided too, and not kept on the
    others for good; the anchor is rank 0's newest, which every node verifies before deleting.
    ``failed``: steps whose save failed in this run; those older than ``newest_started`` (the
    newest step a save was started for: the job moved on, so no writer of this run writes
    them, nor will a retry of the same step) are named in the plan, so that each node removes
    what they left at once instead of after prune's partial-after time. Not only those older
    than the anchor: on a full disk, failed saves' shards are what keeps it full, and no save
    commits until they go."""
    entries = [e for e in newest_committed(root, layouts=CHECKPOINTER_LAYOUTS) if e.manifest is not None]
    if not entries:
        return None
    policy = RetentionPolicy.of(guarded(RetentionPolicy.of(rules), pins, to))
    known = {e.step: (e.name, float(e.manifest.created), e.manifest.metrics) for e in entries}  # type: ignore[union-attr]
    for name, step, created, metrics in elsewhere:
        if step < entries[0].step:  # a node newer than rank 0's is left alone: rank 0's anchor decides
            known.setdefault(step, (name, created, metrics))
    decisions = policy.decide([Candidate(s, t, m) for s, (_, t, m) in known.items()], entries[0].step)
    delete = tuple(known[s][0] for s in sorted(known) if not decisions[s].keep)
    gone = tuple(step_dir(s) for s in sorted(failed) if newest_started is not None and s < newest_started)
    return PrunePlan(entries[0].name, delete, tuple(e.name for e in entries if e.step in pins), gone)


class NodePruner:
    """Applies rank 0's plans to one node's first tier (``ranks``: the node's)."""

    def __init__(self, root: Storage, ranks: Collection[int], partial_after_s: float = PARTIAL_AFTER_S) -> None:
        self.root, self.ranks = root, frozenset(ranks)
        self.partial_after_s = partial_after_s
        self._verified: str | None = None  # the anchor last verified here: each is read once

    def apply(self, p: PrunePlan) -> list[str]:
        """Delete ``p.delete`` and this node's abandoned partials once the anchor verifies
        here. Returns the names deleted."""
        planned = [n for n in p.delete if n != p.anchor and self.root.stat(n) is not None]
        partials = abandoned(self.root, partial_after_s=self.partial_after_s, keep={p.anchor, *p.keep, *p.delete},
                             quiet=p.failed)
        if not planned and not partials:
            self._replicas(p)
            return []  # nothing to delete: the anchor is not read
        if self._verified != p.anchor:
            why = check_node_files(self.root.sub(p.anchor), self.ranks)
            if why is not None:
                log.error("retention of %s: deleting nothing, the newest checkpoint %s does not verify on this node: %s",
                          self.root.url, p.anchor, why)
                return []
            self._verified = p.anchor
        deleted = []
        for name in planned:
            try:
                remove(self.root.sub(name))
                deleted.append(name)
            except CkptError as e:
                log.warning("retention of %s: could not delete %s: %s", self.root.url, name, e)
        if deleted:
            log.info("retention of %s: deleted %s", self.root.url, ", ".join(deleted))
        try:
            deleted += remove_partials(self.root, p.anchor, partials, command="node-local retention",
                                       partial_after_s=self.partial_after_s)
        except CkptError as e:  # a prune holds the root's lock, or the disk fails: the next plan tries again
            log.warning("retention of %s: abandoned partial checkpoints not removed: %s", self.root.url, e)
        self._replicas(p)
        return deleted

    def _replicas(self, p: PrunePlan) -> None:
        """The peer replicas of the steps the plan deletes, and abandoned ones, after the steps
        (a replica outliving its step is useless; a step outliving its replica is still whole)."""
        anchor_step = parse_step_dir(p.anchor)
        if anchor_step is not None:
            gone = {n for n in p.delete if n not in (p.anchor, *p.keep) and self.root.sub(n).stat(MARKER) is None}
            sweep_replicas(self.root, delete=gone, anchor_step=anchor_step, partial_after_s=self.partial_after_s)
