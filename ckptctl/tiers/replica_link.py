"""How peer replicas travel: the ring of nodes, and files sent rank to rank over a gloo group
of their own, in bounded chunks.

**The ring.** Nodes are ordered by their lowest rank (rank 0's node first), the same order on
every rank since every rank sees the same node list. Node i's shards are replicated on node
(i+1) mod n: rank r's *partner* is the rank with r's local index on the next node, and its
*source* the rank with r's local index on the node before. So every rank sends one shard and
receives one per step, and a node's network load is its own shards' size, whatever n is.
That needs at least two nodes and the same number of ranks on each (``ring_of`` raises
``UsageError`` otherwise, on every rank alike).

**The transport.** A gloo group created for replicas alone (``open_group``, collectively, when
the ``Checkpointer`` is built), used only by the replica threads and by recovery: never by the
save coordinator, whose collectives must not queue behind megabytes of replica traffic, nor by
the training's NCCL. Each file goes as a header (its size, or -1 when the sender does not hold
it whole) then chunks of at most ``CHUNK`` bytes, each an ``isend``/``irecv`` pair under the
round's tag; both sides know the chunking from the manifest. A sender holds two chunk buffers
(the next chunk is read while the last one is in flight), a receiver one: memory is bounded
by the chunk, not the checkpoint. Every wait is bounded (``timeout_s``): a partner that died
or hangs fails this transfer with ``CoordinationError`` instead of hanging a thread forever;
each round uses a tag of its own, so a transfer abandoned half way never matches the next
one's messages.

May import: ``format``, ``storage``, leaves (and torch.distributed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ckptctl.errors import CkptError, CoordinationError, StorageError, UsageError
from ckptctl.format.manifest import FileEntry
from ckptctl.storage.base import Storage

CHUNK = 8 << 20  # bytes per message: large enough to keep TCP busy, small enough to bound memory
# How long one transfer waits for its peer at most (or the Checkpointer's timeout_s, when
# shorter): a partner that died must not hold its rounds longer.
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Ring:
    """``nodes``: the ranks of each node, nodes in ring order, ranks ascending."""

    nodes: tuple[tuple[int, ...], ...]

    def _at(self, rank: int) -> tuple[int, int]:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i, ranks.index(rank)
        raise KeyError(rank)

    def partner(self, rank: int) -> int:
        """The rank that holds ``rank``'s replica."""
        i, j = self._at(rank)
        return self.nodes[(i + 1) % len(self.nodes)][j]

    def source(self, rank: int) -> int:
        """The rank whose replica ``rank`` holds."""
        i, j = self._at(rank)
        return self.nodes[(i - 1) % len(self.nodes)][j]


def ring_of(node_of_rank: Sequence[str]) -> Ring:
    """The ring for ``node_of_rank`` (each rank's node, by rank). Raises UsageError when it
    has fewer than two nodes or unequal ones."""
    order: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        order.setdefault(node, []).append(rank)  # by first rank: rank 0's node first
    nodes = tuple(tuple(r) for r in order.values())
    if len(nodes) < 2:
        raise UsageError(f"Tier(replicas=1): every rank of this job is on one node ({next(iter(order), '?')}); "
                         "a peer replica needs a partner node (and torch.distributed)",
                         hint="launch on at least two nodes, or set replicas=0 on the node-local tier")
    sizes = {len(r) for r in nodes}
    if len(sizes) > 1:
        shown = ", ".join(f"{n}: {len(r)}" for n, r in zip(order, nodes))
        raise UsageError(f"Tier(replicas=1): nodes run different numbers of ranks ({shown}); "
                         "each rank's partner is the rank with its local index on the next node",
                         hint="run the same number of ranks on every node, or set replicas=0")
    return Ring(nodes)


def open_group(world_size: int, timeout_s: float) -> "dist.ProcessGroup":
    """The replicas' own gloo group over every rank (collective: every rank calls it, at the
    same point). Raises UsageError when the ``Checkpointer``'s group is not the whole job."""
    if dist.get_world_size() != world_size:
        raise UsageError(f"Tier(replicas=1) needs the Checkpointer's process group to be the whole job "
                         f"({world_size} of {dist.get_world_size()} ranks)",
                         hint="pass no process_group, or set replicas=0")
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s), group_desc="ckptctl_replicas")


def _wait(work: "dist.Work | Callable[[], dist.Work]", timeout_s: float, what: str) -> None:
    """Post (when given a callable) and wait for one send or receive: gloo raises at the post
    too, when the peer's connection is already closed."""
    try:
        (work() if callable(work) else work).wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:  # gloo's timeout, a peer that closed its connection (DistError is one)
        raise CoordinationError(f"peer replica: {what}: {e}",
                                hint="the partner rank died or hangs; this replica is skipped") from None


def _chunks(size: int) -> range:
    return range(0, size, CHUNK)


def send_files(group: "dist.ProcessGroup", dst: int, tag: int, src: Storage, files: Sequence[FileEntry],
               timeout_s: float, *, whole: bool = True) -> int:
    """Send ``files`` from the directory ``src`` to rank ``dst``; a file not there at its size
    (or every file, when ``whole`` is false: the sender holds no complete copy) is announced
    as absent. Returns the bytes sent. Raises CoordinationError (the peer), StorageError."""
    sent = 0
    bufs = [torch.empty(min(CHUNK, max((f.size for f in files), default=0)), dtype=torch.uint8) for _ in range(2)]
    for f in files:
        info = src.stat(f.name) if whole else None
        have = info is not None and info.kind == "file" and info.size == f.size
        header = torch.tensor([f.size if have else -1], dtype=torch.int64)
        _wait(lambda: dist.isend(header, dst, group=group, tag=tag), timeout_s, f"announcing {f.name} to rank {dst}")
        if not have:
            continue
        pending: "dist.Work | None" = None
        with src.open_reader(f.name) as r:
            for k, off in enumerate(_chunks(f.size)):
                buf = bufs[k % 2][: min(CHUNK, f.size - off)]
                r.read_into(off, memoryview(buf.numpy()))  # while the previous chunk is in flight
                if pending is not None:
                    _wait(pending, timeout_s, f"sending {f.name} to rank {dst}")
                try:
                    pending = dist.isend(buf, dst, group=group, tag=tag)
                except RuntimeError as e:  # the peer's connection is closed already
                    raise CoordinationError(f"peer replica: sending {f.name} to rank {dst}: {e}",
                                            hint="the partner rank died; this replica is skipped") from None
            if pending is not None:
                _wait(pending, timeout_s, f"sending {f.name} to rank {dst}")
        sent += f.size
    return sent


def recv_files(group: "dist.ProcessGroup", src: int, tag: int, dst: Storage, files: Sequence[FileEntry],
               timeout_s: float, *, keep: Callable[[FileEntry], bool] = lambda f: True) -> list[FileEntry]:
    """Receive ``files`` from rank ``src`` into the directory ``dst``, each written under a
    temporary name, fsynced and renamed (``Storage.open_writer``); a file ``keep`` declines
    (already there) is received and dropped, so the stream stays in step. Returns the files
    written. A file the sender does not hold is skipped. Raises CoordinationError (the
    peer), StorageError (this disk: the rest of the stream is still drained first)."""
    written: list[FileEntry] = []
    buf = torch.empty(min(CHUNK, max((f.size for f in files), default=0)), dtype=torch.uint8)
    failure: Exception | None = None
    for f in files:
        header = torch.empty(1, dtype=torch.int64)
        _wait(lambda: dist.irecv(header, src, group=group, tag=tag), timeout_s, f"waiting for {f.name} from rank {src}")
        size = int(header[0])
        if size < 0:
            continue
        if size != f.size:
            raise CoordinationError(f"peer replica: rank {src} announced {f.name} as {size} bytes, not {f.size}",
                                    hint="the ranks disagree on the manifest; this replica is skipped")
        writer = dst.open_writer(f.name) if failure is None and keep(f) else None
        try:
            for off in _chunks(size):
                part = buf[: min(CHUNK, size - off)]
                _wait(lambda: dist.irecv(part, src, group=group, tag=tag), timeout_s, f"receiving {f.name} from rank {src}")
                if writer is not None:
                    try:
                        writer.write(memoryview(part.numpy()))
                    except (OSError, CkptError) as e:  # this disk: drain the rest so the stream stays in step
                        writer.abort()
                        writer, failure = None, e
            if writer is not None:
                writer.commit()
                written.append(f)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    if isinstance(failure, CkptError):
        raise failure
    if failure is not None:
        raise StorageError(f"{dst.url}: writing a replica failed: {failure}",
                           hint="check this node's disk (space, permissions); the replica is skipped")
    return written
