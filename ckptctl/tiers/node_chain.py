"""Tiers whose first tier is node-local (``Tier("/nvme/ckpt", node_local=True)``): each node's
disk holds only the shards its own ranks wrote, plus each checkpoint's manifest and marker.

What differs from ``tiers.chain`` (a first tier every rank shares):

* **Nodes.** When the ``Checkpointer`` is built, every rank publishes its node (torchrun's
  ``GROUP_RANK``, else the host name) through the c10d store (``tiers.channel``); a node's
  leader is its lowest rank.
* **Commit.** A save commits on rank 0's node exactly as on a single root. Then rank 0 sends
  the manifest and marker to every leader, which commits its node's copy by the node-local
  rule (``tiers.node_commit``).
* **Promotion.** Rank 0's promoter decides (cadence, skip-when-behind, backoff); each attempt
  is a round in which every rank uploads its own shards and rank 0 writes the marker last
  (``tiers.promotion_round``). Tiers after the second are whole: rank 0 copies them as before.
* **Retention** of the first tier: rank 0 plans with the promoter's pins, each leader verifies
  its part of the newest checkpoint and deletes, abandoned partial saves on its node included
  (``tiers.node_retention``). Later tiers prune as in ``tiers.chain``; the promotion round
  sweeps its own leftovers there (``tiers.promotion_round``).
* **Recovery** (``tiers.node_resume``). Candidates: rank 0's node's steps (with replicas, every
  node's: ``tiers.node_candidates``) and the later tiers', newest first, each read through
  ``tiers.layered`` (own disk, then each later tier), checksummed by the loader; every rank
  moves on together when one lacks a file (docs/protocol.md, "The recovery choice"). With no
  later tier, or for a step no later tier holds committed (not yet promoted), each node first
  fetches what its ranks read from the other nodes (``tiers.node_fetch``), over the replicas'
  gloo group, or one of its own without replicas.

* **Peer replicas** (``replicas=1``): after each commit rank 0 also announces a round of
  ``tiers.replica``; recovery reads each file from the node's step, its replicas
  (``tiers.replica_store``), then each later tier, once ``tiers.replica_recovery`` has
  restored what the node lost.

Rank 0's work after each commit runs on a thread of its own (never the saver's writer thread,
so the next save's write never waits for a listing or the store). At ``close``, rank 0 flushes,
then sends ``stop``; every other rank waits (bounded) for it, so that its upload thread serves
rank 0's final round.

May import: ``tiers.*``, ``layouts``, ``ops``, ``storage``, leaves.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before Python 3.11
from typing import Callable, Iterator

from ckptctl.errors import CkptError
from ckptctl.layouts.native_read import read_committed_raw
from ckptctl.ops.transfer.copy import CopyResult
from ckptctl.storage.base import Storage
from ckptctl.tiers.chain import Tiers
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.durability import Flushed
from ckptctl.tiers.link import StoreGone
from ckptctl.tiers.node_candidates import NodeSteps
from ckptctl.tiers.node_fetch import Fetch, whole_job
from ckptctl.tiers.node_keeper import NodeKeeper, NodeMessages
from ckptctl.tiers.node_resume import NodeResume, name_of
from ckptctl.tiers.node_retention import NodePruner, plan
from ckptctl.tiers.promotion_round import RoundLeader, RoundWorker
from ckptctl.tiers.replica import ReplicaWorker, announce
from ckptctl.tiers.replica import outbox as replica_outbox
from ckptctl.tiers.replica_link import TIMEOUT_S as REPLICA_TIMEOUT_S
from ckptctl.tiers.replica_link import open_group, ring_of
from ckptctl.tiers.replica_recovery import Recovery
from ckptctl.tiers.spec import Tier
from ckptctl.tiers.stream import Outbox, StreamWorker

log = logging.getLogger("ckptctl")

MAX_FAILED = 64  # failed saves whose leftovers rank 0's prune plans name (older ones go by the idle rule)


def node_id() -> str:
    """This process's node: torchrun's node rank when launched by it (two "nodes" on one host
    stay two), else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"node-{group}" if group is not None else socket.gethostname()


def make_tiers(tiers: list[Tier]) -> Tiers:
    """The wiring for ``tiers``: node-local when the first tier says so."""
    return NodeTiers(tiers) if tiers and isinstance(tiers[0], Tier) and tiers[0].node_local else Tiers(tiers)


class NodeTiers(Tiers):
    def __init__(self, tiers: list[Tier]) -> None:
        super().__init__(tiers)
        self._rules = self.specs[0].retention
        self.retentions[0] = None  # ``prune`` cannot verify one node's part: rank 0 plans, leaders delete
        self.channel: Channel | None = None
        self.node_ranks: frozenset[int] = frozenset({0})
        self._messages: NodeMessages | None = None
        self._round: RoundLeader | None = None
        self._keeper: NodeKeeper | None = None
        self._worker: RoundWorker | None = None
        self._pruner: NodePruner | None = None  # one process: rank 0 applies its own plans
        self._replicas: ReplicaWorker | None = None
        self._announce: Outbox | None = None  # rank 0: the replica rounds' announcements
        self._announced: int | None = None  # rank 0: the step of the newest one
        self._resume = NodeResume(self.roots)
        self._replica_timeout_s = REPLICA_TIMEOUT_S
        self._after: ThreadPoolExecutor | None = None  # rank 0's work after each commit, in order
        self._lock = threading.Lock()
        self._failed: list[int] = []  # rank 0: steps whose save failed in this run (the newest MAX_FAILED)
        self.rank = 0

    def begin(self, rank: int, world_size: int, group_name: str | None, timeout_s: float, liveness_s: float) -> None:
        self.rank = rank
        self._resume = NodeResume(self.roots, rank)
        replicas = self.specs[0].replicas > 0
        if world_size <= 1 or group_name is None:
            if replicas:
                ring_of([node_id()])  # one process is one node: raises, naming the fix
            self._pruner = NodePruner(self.roots[0], {0})
            self._after = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-tiers")
            self.start()
            return
        channel = self.channel = Channel(group_name, rank, world_size, self.health)
        nodes = channel.exchange("nodes", node_id(), timeout_s)  # collective: every rank builds its Checkpointer
        self.node_ranks = frozenset(k for k, n in enumerate(nodes) if n == nodes[rank])
        # A resume fetches what each node's ranks read from the other nodes when no later tier
        # holds the step committed (tiers.node_fetch: with none, or before its promotion), over
        # a gloo group made over every rank: the replicas' when there are.
        fetch = len(set(nodes)) > 1 and whole_job(world_size)
        if rank == 0 and len(self.specs) == 1 and len(set(nodes)) > 1 and not replicas:
            self._warn_alone(len(set(nodes)), fetch)
        leaders = {min(k for k, m in enumerate(nodes) if m == n) for n in set(nodes)}
        # Rank 0's after-commit thread: its node and replica messages and node-list reads share one connection.
        after = channel.link("after-commit thread (rank 0)", "") if rank == 0 else None
        ring = ring_of(nodes) if replicas else None  # the same nodes on every rank: a bad topology raises on all
        self._replica_timeout_s = min(timeout_s, REPLICA_TIMEOUT_S)
        group = open_group(world_size, self._replica_timeout_s) if replicas or fetch else None
        fetcher = Fetch(group, self.roots[0], rank, world_size, self.node_ranks, self._replica_timeout_s,
                        self.roots[1:]) if fetch and group is not None else None
        if fetcher is not None and ring is None:
            self._resume = NodeResume(self.roots, rank, fetch=fetcher)
        if ring is not None and group is not None:
            if after is not None:
                self._announce = replica_outbox(channel, after.share())
            self._replicas = ReplicaWorker(channel, group, ring, self.roots[0], self._replica_timeout_s,
                                           self.durability if rank == 0 else None, self._announce)
            self._resume = NodeResume(self.roots, rank,
                                      Recovery(group, ring, self.roots[0], rank, world_size, self.node_ranks,
                                               self._replica_timeout_s),
                                      NodeSteps(channel, self.roots[0], rank, {ranks[0] for ranks in ring.nodes}, timeout_s),
                                      fetcher)
        if rank == min(self.node_ranks):
            # The root says it is this node's part (format.node_record): verify, latest, prune
            # and du of it then judge the files of these ranks and name the others' as elsewhere.
            from ckptctl.format.node_record import NODE_RECORD, NodeRecord

            self.roots[0].write_atomic(NODE_RECORD, NodeRecord(nodes[rank], self.node_ranks, world_size).to_json())
            self._keeper = NodeKeeper(channel, self.roots[0], self.node_ranks)
        if len(self.roots) > 1:
            self._worker = RoundWorker(channel, self.roots[0], self.roots[1])
        if rank == 0:
            self._messages = NodeMessages(channel, leaders, after)
            self._after = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-tiers")
            if len(self.roots) > 1:
                self._round = RoundLeader(channel, self.roots[1], liveness_s)
                self.start(first_copy=self._round.copy)
            else:
                self.start()

    def _warn_alone(self, nodes: int, fetch: bool) -> None:
        """Rank 0, a node-local tier alone on ``nodes`` nodes with no replicas: what a resume
        cannot survive. Each file of a step is on one node only; and without a group over every
        rank (``tiers.node_fetch``), no node but rank 0's can read rank 0's shard."""
        if fetch:
            log.warning("tiers: %s is node-local with no peer replicas and no later tier, on a job of %d nodes: each "
                        "node's disk alone holds its ranks' shards, so a node that loses its disk loses every step "
                        "for the job (load_latest then starts over); add replicas=1 (one lost node survives) or a "
                        "later tier (Tier('s3://bucket/prefix'))", self.roots[0].url, nodes)
        else:
            log.warning("tiers: %s is node-local with no later tier, on a job of %d nodes, and the Checkpointer's "
                        "process group is not the whole job: every rank reads rank 0's shard to resume, which only "
                        "rank 0's node holds, so load_latest cannot resume this job from it; add a later tier "
                        "(Tier('s3://bucket/prefix')) or pass no process_group", self.roots[0].url, nodes)

    def _workers(self) -> list[StreamWorker]:
        return [w for w in (self._keeper, self._worker, self._replicas) if w is not None]

    def revive(self) -> None:
        for w in self._workers():
            w.revive()

    # --- after each commit (rank 0) -----------------------------------------------------------

    def after_save(self, step: int, save: "Future[str | None]") -> None:
        def committed(f: "Future[str | None]") -> None:
            if f.exception() is None and f.result() is not None:
                self._submit(self._committed, step, name_of(str(f.result())))
            else:  # a full disk may have failed it: what is no longer pinned goes now, and what it left
                with self._lock:
                    self._failed = [*self._failed[-MAX_FAILED + 1:], step]
                self._submit(self._prune_logged)

        save.add_done_callback(committed)

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn`` on the after-commit thread, in order; dropped once closing (a promoter
        thread left running past ``close`` may still report)."""
        with self._lock:
            if self._after is not None and not self._closing:
                self._after.submit(fn, *args)

    def _committed(self, step: int, name: str) -> None:
        try:
            source = read_committed_raw(self.roots[0].sub(name))
            if self._messages is not None:
                self._messages.commit(name, source)
            if self._announce is not None:
                self._announced = step
                announce(self._announce, name, source.manifest_raw)  # off this thread: each rank's replica thread
            self._newest = (step, name)
            self._reached(0, step, name)  # offered to the promoter, which pins it when chosen
            self._prune()
        except CkptError as e:
            log.error("tiers: after the commit of step %d: %s", step, e)
        except Exception as e:  # a bug here must not end commits and retention for the run
            log.error("tiers: after the commit of step %d", step, exc_info=e)

    def _promoted_callback(self, k: int):
        promoted = super()._promoted_callback(k)

        def then_prune(step: int, name: str, result: CopyResult) -> None:
            promoted(step, name, result)
            if k == 1:  # a pin was released: the first tier may shrink now
                self._submit(self._prune_logged)

        return then_prune

    def _prune_logged(self) -> None:
        try:
            self._prune()
        except CkptError as e:
            log.error("retention of %s: %s", self.roots[0].url, e)

    def _prune(self) -> None:
        if self._rules is None:
            return
        pins = self.promoters[0].pins() if self.promoters else frozenset()
        with self._lock:
            failed = list(self._failed)
        elsewhere = self._messages.elsewhere() if self._messages is not None else []
        p = plan(self.roots[0], self._rules, pins, self.roots[1].url if len(self.roots) > 1 else "", failed,
                 self.durability.newest_started(), elsewhere)
        if p is None:
            return
        if self._messages is not None:
            self._messages.prune(p)
        elif self._pruner is not None:
            self._pruner.apply(p)

    # --- resuming (``tiers.node_resume``) ----------------------------------------------------

    def gather(self) -> None:
        self._resume.gather()

    def candidates(self) -> Iterator[tuple[int, str]]:
        return self._resume.candidates(super().candidates())

    def checkpoint(self, tier: int, name: str) -> Storage:
        return self._resume.checkpoint(tier, name)

    def avoid(self, view: Storage, error: CkptError) -> bool:
        return self._resume.avoid(view, error)

    def loaded(self, view: Storage) -> None:
        self._resume.loaded(view)

    # --- closing ------------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> Flushed:
        self._begin_closing()
        if self._after is not None:
            t0 = time.monotonic()
            try:  # the last commit is offered before the wait
                self._after.submit(lambda: None).result(timeout_s)
            except FutureTimeout:
                log.warning("tiers: rank 0's after-commit work did not finish within %.0f s", timeout_s)
            timeout_s = max(0.0, timeout_s - (time.monotonic() - t0))
        return super().flush(timeout_s)

    def _begin_closing(self) -> None:
        """From here on, a thread of ours that cannot reach the store gives up on it after
        ``settings.CLOSE_STORE_TIMEOUT_S`` (``tiers.link``): close never waits on a store that
        is gone for good."""
        if self.channel is not None:
            self.channel.begin_closing()

    def _store_gone(self) -> str | None:
        return self.channel.closing.gone if self.channel is not None else None

    def release(self, timeout_s: float) -> None:
        self._begin_closing()
        deadline = time.monotonic() + timeout_s
        for t in self._workers():
            if not t.join(max(0.0, deadline - time.monotonic())):
                # The keeper too: its node's copy of the newest step may then be uncommitted.
                log.warning("tiers: rank %d stopped waiting for its %s to take rank 0's stop after %.0f s",
                            self.rank, t.link.worker, timeout_s)
        gone = self._store_gone()
        if gone is not None and self.rank != 0:
            log.warning("close: rank %d: %s; rank 0's last promotion and replica rounds may not have finished; its "
                        "newest save (step %s) stays on %s for a later load_latest", self.rank, gone,
                        self.durability.newest_started(), self.roots[0].url)

    def close(self, join_s: float = 5.0) -> None:
        self._begin_closing()
        super().close(join_s)  # promoters first: their last callback may still ask for a prune
        with self._lock:
            self._closing = True
        if self._after is not None:
            self._after.shutdown(wait=True)  # the last commit's message and prune go out before stop
        try:
            self._stop_streams(join_s)
        except StoreGone as e:  # logged by the link; what was not finished is named below
            log.info("tiers: rank %d's streams not stopped: %s", self.rank, e)
        if self.rank == 0:
            self.release(join_s)
        self._report_unreplicated()
        if self.channel is not None:
            self.channel.close()  # its idle connections, for the next Checkpointer of this process

    def _stop_streams(self, join_s: float) -> None:
        """Send ``stop`` on every stream of rank 0, then wait (bounded) for every receiver."""
        stops = []  # (outbox, its stop): every stream is told first, then waited for together
        if self._round is not None:
            stops.append((self._round.outbox, self._round.stop()))
        if self._messages is not None:
            stops.append((self._messages.outbox, self._messages.stop()))
        if self._announce is not None:  # after the last announcement: the rounds in flight finish
            stops.append((self._announce, self._announce.stop()))
            if self._replicas is not None and not self._replicas.join(self._replica_timeout_s):
                log.warning("tiers: the last peer replica round did not finish within %.0f s", self._replica_timeout_s)
        deadline = time.monotonic() + join_s
        for out, n in stops:
            out.finish(n, deadline - time.monotonic())
        if self._messages is not None:
            self._messages.forget()  # after the leaders' last prune

    def _report_unreplicated(self) -> None:
        """Rank 0 with peer replicas: name the newest announced step whose replica round did not
        complete (a partner or the store gone); its node-local copy is whole."""
        step = self._announced
        if step is None or self.durability.replication(step):
            return
        log.warning("close: the peer replica of step %d did not complete%s; each node's first tier (%s) still holds "
                    "its own part of it", step, f" ({self._store_gone()})" if self._store_gone() else "",
                    self.roots[0].url)
