"""Recovery from peer replicas: before ``load_latest`` reads a candidate step, every node that
lost its part of it gets it back from the ranks that hold it, over the replicas' gloo group,
without touching the next tier.

For a candidate, the lowest rank whose node holds it committed broadcasts the step's manifest
and marker (each node's leader reads its own; one all-gather says who has them, so rank 0's
node may be the one that lost it), and every rank says what its node lacks (one all-gather):

* its *own* files (those the manifest lists for its rank) missing from its node's step
  directory: its partner rank (which holds their replica) sends them back from its complete
  replica, and they are written into the step directory;
* the *replica* it held of its source rank, missing or incomplete: the source rank sends its
  own files again, and they are written under the replica directory, marker last.

So a replaced node gets back what it held: its own shards, and the replica of the node before
it. Every file restored is checked against the manifest (header bound to it, each chunk's
checksum, the file checksum) before it is kept; one that does not check out is deleted, and
the load reads it from the next tier (``tiers.layered``). Once every rank is done (a barrier),
each node's leader commits its node's copy by the node-local rule (``node_commit.commit_here``:
manifest, marker last) when its marker is absent and its ranks' files are all there; a second
barrier keeps every rank from reading the step before its node's marker is written. A node
that lacks nothing but its marker (the job died before rank 0's ``commit`` message reached its
leader) is committed the same way.

All of it is collective and bounded: every rank takes part whether it needs anything or not;
a holder without a complete replica announces the file as absent; a dead peer fails the
transfer at the timeout and the rank falls back on the next tier. The decision
that follows (load, or move on to an older step) is still ``load_latest``'s, on every rank
together; a step no node holds committed is left to the next tier on every rank alike.

May import: ``tiers.replica_link``, ``tiers.replica_store``, ``tiers.node_commit``,
``ops.verify``, ``layouts.native``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ckptctl.errors import CkptError, CoordinationError
from ckptctl.format.layout import MARKER
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.layouts.native_read import Committed, read_committed_raw
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.storage.base import Storage
from ckptctl.tiers.node_commit import commit_here, parse_committed
from ckptctl.tiers.replica_link import Ring, recv_files, send_files
from ckptctl.tiers.replica_store import complete, replica_dir, write_marker

log = logging.getLogger("ckptctl")

TAG_BASE = 1 << 30  # above any replication round's tag (its round number)


class Recovery:
    """This rank's part in restoring candidates from replicas (``node_ranks``: its node's)."""

    def __init__(self, group: "dist.ProcessGroup", ring: Ring, root: Storage, rank: int, world_size: int,
                 node_ranks: Collection[int], timeout_s: float) -> None:
        self.group, self.ring, self.root = group, ring, root
        self.rank, self.world_size, self.node_ranks = rank, world_size, frozenset(node_ranks)
        self.timeout_s = timeout_s
        self.restored: list[str] = []  # files restored into this rank's node, for the caller's log
        self.sent_bytes = 0
        self._calls = 0

    def restore(self, name: str) -> Committed | None:
        """Collective over every rank: bring back what this node lacks of checkpoint ``name``
        (committed on some node). Never raises for a peer or a file: what cannot be restored
        is left to the next tier. Returns the commit every rank took (``tiers.node_fetch``
        then works from it), or None when there was none to take (the same on every rank)."""
        self._calls += 1  # each candidate's transfers under tags of their own
        source = broadcast_commit(self.group, self.root, self.rank, self.world_size, self.node_ranks, name)
        if source is None or source.manifest.world_size != self.world_size:
            return None  # no node holds it, or another world size: every rank skips alike
        ckpt, rep = self.root.sub(name), replica_dir(self.root, name)
        src = self.ring.source(self.rank)
        mine, theirs = _files(source.manifest, self.rank), _files(source.manifest, src)
        try:
            need_own = any(absent(ckpt, f) for f in mine)
            need_rep = bool(theirs) and not complete(rep, src, source.manifest_raw, theirs)
            # A node whose files are all there may still lack its marker: the job died before
            # rank 0's commit message reached its leader. It is committed below all the same.
            need_marker = self.rank == min(self.node_ranks) and ckpt.stat(MARKER) is None
        except CkptError as e:  # this disk cannot be read: it asks for nothing, the next tier serves it
            log.warning("peer replica: rank %d cannot tell what its node lacks of %s: %s", self.rank, name, e)
            need_own = need_rep = need_marker = False
        try:
            needs = all_gather_ints(self.group, self.world_size, [int(need_own), int(need_rep), int(need_marker)])
        except CkptError as e:
            log.warning("peer replica: checkpoint %s not restored from replicas: %s", name, e)
            return source
        if not any(any(n) for n in needs):
            return source
        try:  # nothing to send or receive when a marker alone is missing
            self._exchange(name, source, needs, need_own, need_rep)
        except (CkptError, OSError) as e:  # this disk: what is missing is read from the next tier
            log.warning("peer replica: rank %d could not restore %s: %s", self.rank, name, e)
        self._commit_node(ckpt, name, source)
        return source

    def _exchange(self, name: str, source: Committed, needs: list[list[int]], need_own: bool, need_rep: bool) -> None:
        """This rank's sends and receives for ``needs`` (every rank's ``[own, replica, marker]``)."""
        ckpt, rep, manifest = self.root.sub(name), replica_dir(self.root, name), source.manifest
        src, tag = self.ring.source(self.rank), TAG_BASE + 2 * self._calls
        mine, theirs = _files(manifest, self.rank), _files(manifest, src)
        partner = self.ring.partner(self.rank)
        sender = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-replica-restore")
        try:
            sends = []
            if needs[src][0]:  # my source lost its own files: I hold their replica
                whole = complete(rep, src, source.manifest_raw, theirs)
                sends.append(sender.submit(send_files, self.group, src, tag, rep, theirs, self.timeout_s, whole=whole))
            if needs[partner][1]:  # my partner lost its replica of me: my own files again
                sends.append(sender.submit(send_files, self.group, partner, tag + 1, ckpt, mine, self.timeout_s))
            if need_own:
                self._receive(partner, tag, ckpt, mine, manifest, "its own files")
            if need_rep:
                got = self._receive(src, tag + 1, rep, theirs, manifest, f"the replica of rank {src}")
                if complete_now(rep, theirs):
                    write_marker(rep, src, manifest.step, source.manifest_raw, theirs)
                elif got:
                    log.warning("peer replica: the replica of rank %d's files of %s is still incomplete", src, name)
            for s in sends:
                try:
                    self.sent_bytes += s.result()
                except CkptError as e:
                    log.warning("peer replica: serving %s to a recovering rank: %s", name, e)
        finally:
            sender.shutdown(wait=True)

    def _receive(self, peer: int, tag: int, into: Storage, files: list[FileEntry], manifest: Manifest,
                 what: str) -> list[FileEntry]:
        """Receive ``files`` from ``peer``; keep each only when it checks out against the manifest."""
        try:
            kept = receive_checked(self.group, peer, tag, into, files, manifest, self.timeout_s)
        except CkptError as e:
            log.warning("peer replica: rank %d could not receive %s from rank %d: %s", self.rank, what, peer, e)
            return []
        self.restored += [into.url_of(f.name) for f in kept]
        if kept:
            log.info("peer replica: rank %d restored %s from rank %d: %s", self.rank, what, peer,
                     ", ".join(f.name for f in kept))
        return kept

    def _commit_node(self, ckpt: Storage, name: str, source: Committed) -> None:
        """After every rank's transfers (a barrier), the node's leader commits its copy; a
        second barrier, so that no rank reads the step before its node's marker is there."""
        try:
            dist.barrier(group=self.group)
        except RuntimeError as e:
            log.warning("peer replica: the ranks did not all finish restoring %s: %s", name, e)
            return
        if self.rank == min(self.node_ranks) and ckpt.stat(MARKER) is None:
            try:
                if commit_here(ckpt, source, self.node_ranks):
                    log.info("peer replica: this node's copy of %s is committed again", name)
            except CkptError as e:
                log.warning("peer replica: this node's copy of %s not committed: %s", name, e)
        try:
            dist.barrier(group=self.group)
        except RuntimeError as e:
            log.warning("peer replica: the nodes did not all commit %s again: %s", name, e)


def broadcast_commit(group: "dist.ProcessGroup", root: Storage, rank: int, world_size: int,
                     node_ranks: Collection[int], name: str) -> Committed | None:
    """Collective over every rank of ``group`` (the whole job: its ranks are global): the
    commit of ``name`` (manifest and marker bytes), on every rank, from the lowest rank whose
    node holds it committed (a node's leader is its lowest rank: only leaders read). None when
    no node does, or when the ranks could not exchange it (logged). The loader and
    ``check_against`` judge the bytes, not this."""
    raw = b""
    if rank == min(node_ranks):
        ckpt = root.sub(name)
        try:
            if ckpt.stat(MARKER) is not None:  # a node without the step has nothing to say
                c = read_committed_raw(ckpt)
                raw = len(c.manifest_raw).to_bytes(8, "big") + c.manifest_raw + c.marker_raw
        except CkptError as e:  # still takes part below: the others must not wait for it
            log.warning("tiers: %s unreadable on rank %d's node: %s", name, rank, e)
    try:
        sizes = [n for (n,) in all_gather_ints(group, world_size, [len(raw)])]
        src = next((k for k, n in enumerate(sizes) if n > 0), None)
        if src is None:
            if rank == 0:
                log.warning("tiers: no node holds %s committed; it is read from the next tier", name)
            return None
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if rank == src \
            else torch.empty(sizes[src], dtype=torch.uint8)
        dist.broadcast(data, src=src, group=group)
        got = bytes(data.numpy().tobytes())
        cut = 8 + int.from_bytes(got[:8], "big")
        return parse_committed(root.sub(name), got[8:cut], got[cut:])
    except (CkptError, RuntimeError) as e:
        log.warning("tiers: the nodes' copies of %s not completed from each other: %s", name, e)
        return None


def all_gather_ints(group: "dist.ProcessGroup", world_size: int, mine: list[int],
                    dtype: torch.dtype = torch.int64) -> list[list[int]]:
    """Every rank's ``mine`` (the same length on every rank), in rank order."""
    out = [torch.zeros(len(mine), dtype=dtype) for _ in range(world_size)]
    try:
        dist.all_gather(out, torch.tensor(mine, dtype=dtype), group=group)
    except RuntimeError as e:
        raise CoordinationError(f"tiers: the ranks could not say what their nodes lack: {e}") from None
    return [[int(v) for v in t] for t in out]


def receive_checked(group: "dist.ProcessGroup", peer: int, tag: int, into: Storage, files: list[FileEntry],
                    manifest: Manifest, timeout_s: float) -> list[FileEntry]:
    """Receive ``files`` from rank ``peer`` into ``into`` (one there at its size is received
    and dropped: ``replica_link.recv_files``); keep each only when it checks out against
    ``manifest``: one that does not is deleted, with an error naming it, and is never read.
    Returns the files kept. Raises CkptError (the peer, this disk)."""
    got = recv_files(group, peer, tag, into, files, timeout_s, keep=lambda f: absent(into, f))
    kept = []
    for f in got:
        why = check_against(into, f, manifest)
        if why is None:
            kept.append(f)
        else:
            log.error("tiers: %s from rank %d does not check out (%s); deleted, another copy is read or the step "
                      "skipped", into.url_of(f.name), peer, why)
            into.delete(f.name)
    return kept


def _files(manifest: Manifest, rank: int) -> list[FileEntry]:
    return sorted((f for f in manifest.files if f.rank == rank), key=lambda f: f.name)


def absent(d: Storage, f: FileEntry) -> bool:
    """Whether ``d`` lacks ``f`` at its size (a file there at its size is taken as a copy; the
    loader, or ``check_against``, judges its bytes)."""
    info = d.stat(f.name)
    return info is None or info.kind != "file" or info.size != f.size


def complete_now(rep: Storage, files: list[FileEntry]) -> bool:
    return bool(files) and not any(absent(rep, f) for f in files)


def check_against(d: Storage, f: FileEntry, manifest: Manifest) -> str | None:
    """Why ``d``'s copy of ``f`` does not check out against ``manifest`` (its header bound to
    it, each chunk's checksum, the file checksum), or None when it does."""
    problems: list[Problem] = []
    header = check_file(d, f, manifest, problems)
    if header is not None:
        problems, _ = stream_file(d, f, header)
    return str(problems[0]) if problems else None
