"""The peer-replica round of a node-local first tier (``Tier(..., node_local=True, replicas=1)``):
after each save commits, every rank sends the shard it wrote to its partner rank on the next
node, which writes it under its own node's replica directory.

1. Rank 0's after-commit thread (``tiers.node_chain``) sends ``{"op": "replicate", name,
   manifest}`` on the channel's ``replica`` stream (``tiers.channel``: a small announcement
   through the c10d store; no shard byte goes through the store).
2. Every rank's ``ReplicaWorker`` thread takes the messages in order. For each, at the same
   time: it sends the files the manifest lists for its own rank, read back from its node's
   first tier (written and fsynced by the save), to its partner; and it receives its source
   rank's files into ``<root>/.ckptctl-replicas/<step-dir>/``, then writes that source's
   marker last (``tiers.replica_store``). Transport and ring: ``tiers.replica_link``.
3. It replies ``ok:<bytes sent>`` or ``fail:<why>``. Rank 0's worker, after its own part,
   collects every reply (bounded by the timeout) and records the step's time to replicated
   and the bytes sent over the network by every rank together (``tiers.durability``); a
   failed or missing reply is logged and that step's replica is skipped, never retried (the
   next save's replica follows). The announcement stays in the store until every rank
   replied (``tiers.stream``): a rank still busy with an earlier round reads it when it gets
   there, whatever rank 0's wait found.

Off the training thread, off the saver's writer thread: the bytes are read from disk, not from
the staging buffer, so the next save's snapshot never waits for a replica. A partner that
died or hangs fails the round's transfers at the timeout (``replica_link``), and the next
round uses a tag of its own.

May import: ``tiers.channel``, ``tiers.link``, ``tiers.stream``, ``tiers.replica_link``, ``tiers.replica_store``,
``tiers.durability``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import base64
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from ckptctl.errors import CkptError
from ckptctl.format.layout import parse_step_dir
from ckptctl.format.manifest import Manifest
from ckptctl.storage.base import Storage
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.link import Link
from ckptctl.tiers.durability import Durability
from ckptctl.tiers.replica_link import Ring, recv_files, send_files
from ckptctl.tiers.replica_store import replica_dir, write_marker
from ckptctl.tiers.stream import Outbox, StreamWorker

log = logging.getLogger("ckptctl")

STREAM = "replica"


KEEP = 16  # announcements open at once (one per save; each rank takes them in order)


def outbox(channel: Channel, link: Link | None = None) -> Outbox:
    """Rank 0's side of the ``replica`` stream, on ``link`` (the announcing thread's; else one
    of its own): every rank replies to each announcement."""
    return channel.outbox(STREAM, range(channel.world_size), KEEP, collected=True, link=link)


def announce(out: Outbox, name: str, manifest_raw: bytes) -> int:
    """Rank 0: start the round of checkpoint ``name`` (just committed)."""
    return out.send({"op": "replicate", "name": name, "manifest": base64.b64encode(manifest_raw).decode()})


class ReplicaWorker(StreamWorker):
    """Every rank's replica thread. Rank 0's also collects each round's replies from
    ``collect`` (its outbox) and records them in ``durability``."""

    ops = frozenset({"replicate"})

    def __init__(self, channel: Channel, group: "dist.ProcessGroup", ring: Ring, root: Storage, timeout_s: float,
                 durability: Durability | None = None, collect: Outbox | None = None) -> None:
        self.group, self.ring, self.root = group, ring, root
        self.timeout_s, self.durability, self.collect = timeout_s, durability, collect
        self.world_size = channel.world_size
        self.sent_bytes = 0  # by this rank, over the run
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-replica-send")
        self._started: dict[int, float] = {}
        # The link is made here, not on the thread: see ``tiers.link``.
        super().__init__(channel.link(f"replica thread (rank {channel.rank})", root.url), STREAM, channel.rank,
                         channel.health)
        self.start()

    def handle(self, n: int, msg: dict[str, Any]) -> str:
        self._started[n] = time.monotonic()
        return self._round(n, msg)

    def after(self, n: int, msg: dict[str, Any]) -> None:
        t0 = self._started.pop(n, time.monotonic())
        if self.collect is not None:
            self._collect(n, str(msg["name"]), t0)

    def stopped(self) -> None:
        self._sender.shutdown(wait=False)

    def _round(self, n: int, msg: dict[str, Any]) -> str:
        name = str(msg["name"])
        try:
            raw = base64.b64decode(msg["manifest"])
            manifest = Manifest.from_json(raw, self.root.sub(name).url_of("manifest"))
            partner, source = self.ring.partner(self.rank), self.ring.source(self.rank)
            mine = sorted((f for f in manifest.files if f.rank == self.rank), key=lambda f: f.name)
            theirs = sorted((f for f in manifest.files if f.rank == source), key=lambda f: f.name)
            sending = self._sender.submit(send_files, self.group, partner, n, self.root.sub(name), mine, self.timeout_s)
            rep = replica_dir(self.root, name)
            failure: str | None = None
            try:
                got = recv_files(self.group, source, n, rep, theirs, self.timeout_s)
                if len(got) == len(theirs):
                    write_marker(rep, source, manifest.step, raw, theirs)  # last: the replica counts now
                else:
                    failure = f"rank {source} did not hold {len(theirs) - len(got)} of its files of {name}"
            except CkptError as e:
                failure = f"receiving rank {source}'s files of {name}: {e}"
            try:
                sent = sending.result()
            except CkptError as e:
                return f"fail:sending {name} to rank {partner}: {e}"
            self.sent_bytes += sent
            return f"fail:{failure}" if failure is not None else f"ok:{sent}"
        except CkptError as e:
            return f"fail:{e}"
        except Exception as e:  # a bug must not end this rank's replicas for the run: logged, step skipped
            log.error("peer replica of %s failed unexpectedly", name, exc_info=e)
            return f"fail:unexpected {type(e).__name__}: {e}"

    def _collect(self, n: int, name: str, t0: float) -> None:
        """Rank 0: every rank's reply to round ``n``; the step's time to replicated and bytes."""
        assert self.collect is not None
        replies = self.collect.replies(self.link, n, self.timeout_s)
        failed = {k: v[5:] for k, v in replies.items() if not v.startswith("ok:")}
        missing = [k for k in range(self.world_size) if k not in replies]
        if failed or missing:
            why = f"rank {min(failed)}: {failed[min(failed)]}" if failed else f"ranks {missing} did not reply"
            log.warning("peer replica of %s incomplete (%s); the next save's replica follows", name, why)
            return
        total = sum(int(v[3:] or 0) for v in replies.values())
        step = parse_step_dir(name)
        seconds = self.durability.replicated(step, total) if self.durability is not None and step is not None else None
        log.info("step %s replicated to the partner nodes: %d bytes sent, %.2f s after its save (round %.2f s)",
                 step, total, seconds if seconds is not None else float("nan"), time.monotonic() - t0)
