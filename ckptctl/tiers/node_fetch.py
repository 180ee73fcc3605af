"""Fetching, before a resume reads a step from a node-local tier, the files of it that each
node's ranks will read and that node does not hold, from a node that holds them.

Why: each node's disk holds only the shards its own ranks wrote, and a rank's load reads more
than its own shard: rank 0's header (the per-rank state's table, rank 0's RNG state), the
tensors saved once by rank 0, and every tensor every rank holds whole (DDP's parameters),
each written by *one* rank chosen by size (``save.shard_layout.assign_replicated``: spread
over the ranks, not left to rank 0). With no later tier those files are on one node (and, with
peer replicas, the next one): a relaunch on three nodes or more found no step every rank could
read, and started over although the nodes together held every file. With a later tier, the
view reads them from it, but only once the step is promoted there: a step committed on the
nodes and not yet promoted (the job died inside the promotion window, minutes for a large
checkpoint) was skipped on every rank, and the job resumed one checkpoint older than it could.

When a later tier holds the candidate committed, the same commit (its marker commits the
manifest every rank took), nothing is fetched (``needed``): the view reads what a node lacks
from there, as it always did, and no node's disk takes copies of a step that is durable
elsewhere. Rank 0 alone reads the later tiers' markers (one small read each) and tells every
rank, in one broadcast of a byte; without peer replicas, when rank 0's node does not hold the
candidate committed, nothing is fetched either (the plan below would send nothing), and the
commit is not broadcast at all. Otherwise (no later tier, or none holds it committed: not
promoted, or a promotion still in flight, some of its files there without a marker), every
file a node lacks comes from the other nodes.

What a rank reads (``files_read``), for the job's own world size, from the manifest's
placement hints: its own files and rank 0's; the file of each tensor one rank wrote whole
(``TensorEntry.owner``); for a tensor split rank by rank (``split``), its own block (its own
file, listed already); for a tensor without hints, every file. That is exact for a resume
whose state is sharded as at save (the same parallelism); a load that reads other blocks (an
FSDP-saved step into plain tensors) may need files beyond it, and, lacking them, fails on its
rank and the step is skipped on every rank alike, as before.

For a candidate (after ``tiers.replica_recovery`` when there are replicas), one all-gather:
each node's leader says which of the step's files its ranks read and it lacks, which it holds
(in its step directory or its copies, at their size), and whether its node committed the
step. Then, the same plan on every rank: each missing file from one holder (spread over the
holders), leader to leader, over a gloo group of every rank (the replicas', or one of its own
without replicas) in bounded chunks (``tiers.replica_link``: memory is a chunk or two, never a
shard). Nothing is sent when the
step cannot be read anyway: a node that does not hold it committed, or a file no node holds;
every rank then fails its load and moves on together, as before. Each file received is checked
against the manifest (its header bound to it, each chunk, the file checksum) before it is
kept (``replica_recovery.receive_checked``); one that does not check out is deleted, and the load
of that step fails on its node's ranks, never reading it.

Where: in the node's copies of other nodes' files (``<root>/.ckptctl-replicas/<step>/``, the
peer replicas' subtree, hidden, ``tiers.replica_store``), never in the step directory: the
node-local commit rule, ``ckptctl verify`` and prune of a node root reason about the files of
the node's own ranks, and a fetched file there would make the node's copy look like one it is
not. Node-local retention removes the subtree of a step with the step (``replica_store.sweep``).

Bounded and collective: every rank takes part; a peer that dies fails its transfers at the
timeout, and a barrier keeps every rank of a node from reading the step before its leader is
done receiving.

May import: ``tiers.layered``, ``tiers.replica_link``, ``tiers.replica_recovery``, ``tiers.replica_store``,
``layouts``, ``format``, ``storage``, leaves (and torch.distributed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ckptctl.errors import CkptError, NotFound
from ckptctl.format.layout import MARKER
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.marker import MAX_MARKER_BYTES, Marker
from ckptctl.layouts.native_read import Committed, read_bounded
from ckptctl.storage.base import Storage
from ckptctl.tiers.layered import Layered
from ckptctl.tiers.replica_link import send_files
from ckptctl.tiers.replica_recovery import TAG_BASE, absent, all_gather_ints, broadcast_commit, receive_checked
from ckptctl.tiers.replica_store import replica_dir

log = logging.getLogger("ckptctl")

TAG = TAG_BASE + (1 << 20)  # above replica recovery's tags (two per candidate)
# How long rank 0 waits for the later tiers' markers of a candidate (``Fetch.needed``; a read
# takes milliseconds): far inside the broadcast's timeout, which every other rank waits in.
CHECK_S = 30.0


def whole_job(world_size: int) -> bool:
    """Whether the ``Checkpointer``'s group is the whole job (a gloo group of its own can then be
    made over every rank: ``replica_link.open_group``)."""
    return dist.is_initialized() and dist.get_world_size() == world_size


def files_read(manifest: Manifest, rank: int) -> set[str]:
    """The files of ``manifest`` that rank ``rank`` of a job of the same world size reads to
    load it in a state sharded as at save (see the module docstring)."""
    by_rank: dict[int, list[str]] = {}
    for f in manifest.files:
        by_rank.setdefault(f.rank, []).append(f.name)
    out = {*by_rank.get(rank, []), *by_rank.get(0, [])}
    for t in manifest.tensors.values():
        if t.owner is not None:
            out.update(by_rank.get(t.owner, []))
        elif t.split is None:  # no hint: any file may hold part of it
            return {f.name for f in manifest.files}
    return out


class Fetch:
    """This rank's part in completing, from the other nodes, what its node's ranks read of a
    candidate (``node_ranks``: its node's)."""

    def __init__(self, group: "dist.ProcessGroup", root: Storage, rank: int, world_size: int,
                 node_ranks: Collection[int], timeout_s: float, later: Sequence[Storage] = ()) -> None:
        self.group, self.root, self.rank, self.world_size = group, root, rank, world_size
        self.node_ranks = frozenset(node_ranks)
        self.timeout_s = timeout_s
        self.later = list(later)  # the later tiers' roots
        self._calls = 0

    def needed(self, name: str, source: Committed | None = None) -> bool:
        """Collective over every rank when there are later tiers (else True at once): whether
        ``name`` is worth fetching. False when a later tier holds it committed with the commit
        ``source`` (the same on every rank), or, with no ``source`` given (no replicas), the
        commit rank 0's node holds: the view reads what a node lacks from that tier. False
        too, with no ``source``, when rank 0's node does not hold it committed: the plan would
        send nothing (see ``_plan``). Only rank 0 reads (its node's marker, then each later
        tier's), so the cost does not grow with the job."""
        if not self.later:
            return True
        want = int(self.rank == 0 and self._unserved(name, source))
        flag = torch.tensor([want], dtype=torch.uint8)
        try:
            dist.broadcast(flag, src=0, group=self.group)
        except RuntimeError as e:  # a peer gone: nothing can be fetched, the view reads the later tiers
            log.warning("tiers: the ranks could not agree whether to fetch %s from the other nodes: %s", name, e)
            return False
        return bool(flag.item())

    def _unserved(self, name: str, source: Committed | None) -> bool:
        """Rank 0: whether the nodes should serve ``name`` (see ``needed``). The reads run on a
        daemon thread bounded by ``CHECK_S``: every other rank waits in the broadcast meanwhile,
        and a later tier that does not answer by then (botocore's retries can take minutes)
        counts as not holding it, so the nodes serve it."""
        answer: list[bool] = []

        def check() -> None:
            checksum = source.marker.manifest_checksum if source is not None else self._checksum(self.root.sub(name))
            answer.append(checksum is not None and not any(self._checksum(r.sub(name)) == checksum for r in self.later))

        t = threading.Thread(target=check, name="ckptctl-fetch-check", daemon=True)
        t.start()
        t.join(min(CHECK_S, self.timeout_s / 2))
        if answer:
            return answer[0]
        log.warning("tiers: the later tiers did not say within %.0f s whether they hold %s; the nodes serve it",
                    min(CHECK_S, self.timeout_s / 2), name)
        return True

    def _checksum(self, ckpt: Storage) -> str | None:
        """The manifest checksum ``ckpt``'s marker commits, or None when it has none that
        reads (not committed there, or that tier cannot be read now: then it serves nothing)."""
        try:
            return Marker.from_json(read_bounded(ckpt, MARKER, MAX_MARKER_BYTES, "a marker may have"),
                                    ckpt.url_of(MARKER)).manifest_checksum
        except NotFound:
            return None
        except CkptError as e:
            log.info("tiers: %s: %s", ckpt.url_of(MARKER), e)
            return None

    def commit(self, name: str) -> Committed | None:
        """Collective: ``name``'s commit from the lowest node holding it (with replicas,
        ``Recovery.restore`` takes it instead)."""
        return broadcast_commit(self.group, self.root, self.rank, self.world_size, self.node_ranks, name)

    def fetch(self, name: str, source: Committed | None) -> None:
        """Collective over every rank: bring into this node what its ranks read of ``name``
        (``source``: its commit, the same on every rank; None when no node holds it) and it
        lacks. Never raises for a peer or a file: the load finds what could not be fetched
        missing, and every rank moves on together."""
        self._calls += 1  # each candidate's transfers under a tag of their own
        if source is None or source.manifest.world_size != self.world_size:
            return  # the same on every rank
        files = sorted(source.manifest.files, key=lambda f: f.name)
        try:
            rows = all_gather_ints(self.group, self.world_size, self._state(name, source.manifest, files), torch.uint8)
        except CkptError as e:
            log.warning("tiers: %s not fetched from the other nodes: %s", name, e)
            return
        plan = self._plan(name, files, rows)
        if not plan:
            return
        self._transfer(name, source.manifest, plan)
        try:  # no rank reads the step before its node's leader is done receiving
            dist.barrier(group=self.group)
        except RuntimeError as e:
            log.warning("tiers: the nodes did not all finish fetching %s: %s", name, e)

    def _state(self, name: str, manifest: Manifest, files: list[FileEntry]) -> list[int]:
        """This rank's row: per file, whether its node's ranks read it and the node lacks it;
        per file, whether the node holds it; whether the node lacks the step's commit. Only a
        node's leader speaks (the others send zeros)."""
        n = len(files)
        if self.rank != min(self.node_ranks):
            return [0] * (2 * n + 1)
        ckpt, copies = self.root.sub(name), replica_dir(self.root, name)
        try:
            read = set().union(*(files_read(manifest, r) for r in self.node_ranks))
            held = [not (absent(ckpt, f) and absent(copies, f)) for f in files]
            uncommitted = ckpt.stat(MARKER) is None
        except CkptError as e:  # this disk cannot be read: its ranks' loads fail, every rank moves on
            log.warning("tiers: rank %d cannot tell what its node holds of %s: %s", self.rank, name, e)
            return [0] * (2 * n) + [1]
        return [int(f.name in read and not h) for f, h in zip(files, held)] + [int(h) for h in held] + [int(uncommitted)]

    def _plan(self, name: str, files: list[FileEntry], rows: list[list[int]]) -> dict[tuple[int, int], list[FileEntry]]:
        """``(sender, receiver) -> files``, the same on every rank; empty when nothing is
        needed, or when the step cannot be read whatever is sent."""
        n = len(files)
        lost = [k for k, row in enumerate(rows) if row[2 * n]]
        plan: dict[tuple[int, int], list[FileEntry]] = {}
        nowhere: list[str] = []
        for i, f in enumerate(files):
            holders = [k for k, row in enumerate(rows) if row[n + i]]
            for k, row in enumerate(rows):
                if not row[i]:
                    continue
                if not holders:
                    nowhere.append(f.name)
                    break
                plan.setdefault((holders[(k + i) % len(holders)], k), []).append(f)  # spread over the holders
        if plan and (lost or nowhere):
            if self.rank == 0:
                why = (f"the node of rank {lost[0]} does not hold it committed" if lost
                       else f"no node holds {', '.join(nowhere[:3])}{' and more' if len(nowhere) > 3 else ''}")
                log.warning("tiers: %s is not fetched from the other nodes: %s; an older step is read", name, why)
            return {}
        return plan

    def _transfer(self, name: str, manifest: Manifest, plan: dict[tuple[int, int], list[FileEntry]]) -> None:
        """This rank's sends (on a thread) and receives. Each sender serves its receivers in
        rank order and each receiver takes its senders in rank order: the smallest pending
        (sender, receiver) pair is then always ready on both sides, so the pairs cannot wait on
        each other in a cycle."""
        tag = TAG + self._calls
        ckpt, copies = self.root.sub(name), replica_dir(self.root, name)
        held = Layered([ckpt, copies])  # a sender's file may be its own ranks' or a copy it holds
        sends = sorted(dst for src, dst in plan if src == self.rank)
        sender = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-fetch")
        try:
            served = sender.submit(self._serve, name, held, sends, plan, tag) if sends else None
            for src in sorted(src for src, dst in plan if dst == self.rank):
                self._receive(src, tag, copies, plan[(src, self.rank)], manifest)
            if served is not None:
                served.result()
        finally:
            sender.shutdown(wait=True)

    def _serve(self, name: str, held: Storage, receivers: list[int], plan: dict[tuple[int, int], list[FileEntry]],
               tag: int) -> None:
        for dst in receivers:
            try:
                send_files(self.group, dst, tag, held, plan[(self.rank, dst)], self.timeout_s)
            except (CkptError, OSError) as e:
                log.warning("tiers: serving %s's files to rank %d: %s", name, dst, e)

    def _receive(self, src: int, tag: int, into: Storage, files: list[FileEntry], manifest: Manifest) -> None:
        """Receive ``files`` from ``src``; keep each only when it checks out against the manifest."""
        try:
            kept = receive_checked(self.group, src, tag, into, files, manifest, self.timeout_s)
        except (CkptError, OSError) as e:
            log.warning("tiers: rank %d could not fetch %s from rank %d: %s", self.rank,
                        ", ".join(f.name for f in files), src, e)
            return
        if kept:
            log.info("tiers: rank %d fetched %s from rank %d into %s", self.rank,
                     ", ".join(f.name for f in kept), src, into.url)
