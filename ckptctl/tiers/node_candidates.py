"""The candidates of a node-local first tier with peer replicas: the steps committed on *any*
node's first tier, not only on rank 0's.

Why: rank 0 lists the candidates alone (``Checkpointer.load_latest``: the other ranks take its
list, so the listing's cost does not grow with the job), from its own node's disk and the
later tiers. When rank 0's node is the replaced one, its disk is empty, and a step still
committed on the other nodes (rank 0's node's shards of it surviving as replicas on the next
node) would never be offered: the job would resume from the next tier's older newest step,
losing progress that is still whole on the cluster.

So, before rank 0 lists, every other node's leader lists its own first tier and publishes the
names through the tiers channel (``Channel.to_rank0``: one store key per node, nothing from
the other ranks, which return at once); rank 0 merges them into its list as first-tier
candidates, newest step first, nearest tier first. ``tiers.replica_recovery`` then restores
what each node lacks of a candidate, taking its manifest and marker from the lowest rank whose
node holds it committed. Nothing is trusted for having been listed: a name that is not a step
directory is dropped, a step that cannot be completed fails the load on some rank, and every
rank moves on to the next candidate together, as for any candidate.

Only with replicas: without them, a step held only by other nodes lacks rank 0's node's shards
everywhere but the later tiers, which are listed already; offering it would cost every other
rank a read of its part and a collective vote to skip it.

May import: ``tiers.channel``, ``layouts``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Collection, Iterator

from ckptctl.errors import CkptError
from ckptctl.format.layout import parse_step_dir
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, newest_committed
from ckptctl.storage.base import Storage
from ckptctl.tiers.channel import Channel

log = logging.getLogger("ckptctl")

MAX_NAMES = 100_000  # a node publishing more is not ckptctl's: its list is ignored


class NodeSteps:
    """The steps each node's first tier holds committed, gathered on rank 0 for one candidate
    list. ``leaders``: every node's lowest rank (rank 0's node's is 0)."""

    def __init__(self, channel: Channel, root: Storage, rank: int, leaders: Collection[int], timeout_s: float) -> None:
        self.channel, self.root, self.rank = channel, root, rank
        self.leaders = frozenset(leaders)
        self.timeout_s = timeout_s
        self._calls = 0  # every rank counts load_latest's calls alike: each gather has keys of its own
        self._others: dict[str, int] = {}  # rank 0: name -> step, committed on some other node

    def gather(self) -> None:
        """Every rank calls it before rank 0 lists (only the leaders do anything): each other
        leader publishes its node's committed steps; rank 0 collects them, waiting
        ``timeout_s`` at most (a leader that did not answer by then is left out, with a
        warning: its steps are not offered)."""
        self._calls += 1
        if self.rank not in self.leaders:
            return
        mine = None if self.rank == 0 else json.dumps(self._listed())  # rank 0 lists its own disk itself
        got = self.channel.to_rank0(f"steps/{self._calls}", mine, self.leaders, self.timeout_s)
        if self.rank != 0:
            return
        self._others = {}
        for k in sorted(self.leaders - {0}):
            if k not in got:
                log.warning("tiers: the node of rank %d did not say which steps it holds within %.0f s; "
                            "they are not offered", k, self.timeout_s)
                continue
            for name in _names(got[k], k):
                step = parse_step_dir(name)
                if step is not None:
                    self._others[name] = step

    def merged(self, listed: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
        """Rank 0's ``listed`` (``(tier, name)``, newest step first, nearest tier first) with
        the other nodes' steps as first-tier candidates, in the same order. A name may come
        twice (its tier 0 first): the caller keeps the first."""
        if not self._others:
            yield from listed
            return
        ours = ((-_step(name), tier, name) for tier, name in listed)
        theirs = sorted((-step, 0, name) for name, step in self._others.items())
        for _, tier, name in heapq.merge(ours, theirs):
            yield tier, name

    def _listed(self) -> list[str]:
        try:
            return [e.name for e in newest_committed(self.root, layouts=CHECKPOINTER_LAYOUTS)]
        except CkptError as e:  # a disk that cannot be listed offers nothing; the others still do
            log.warning("tiers: cannot list %s for the candidates: %s", self.root.url, e)
            return []


def _names(text: str, rank: int) -> list[str]:
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, list) or len(names) > MAX_NAMES or not all(isinstance(n, str) for n in names):
        log.warning("tiers: the node of rank %d sent an unreadable list of steps; ignored", rank)
        return []
    return names


def _step(name: str) -> int:
    step = parse_step_dir(name)
    if step is None:  # ckptctl's own layout names every checkpoint by its step
        raise ValueError(f"not a step directory: {name}")
    return step
