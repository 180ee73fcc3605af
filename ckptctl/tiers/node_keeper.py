"""Each node's keeper of its first tier: applies rank 0's node messages, in order, on a thread
of the node's leader (its lowest rank).

Rank 0 (``NodeMessages``) sends on the channel's ``node`` stream, after each save commits:
``commit`` (the checkpoint's manifest and marker, for the node-local commit rule of
``tiers.node_commit``), then, when the tier has retention rules, ``prune`` (a
``node_retention.PrunePlan``: what to delete, possibly nothing, and what to keep); and
``stop`` when the ``Checkpointer`` closes. One stream, so a node always commits a step before
it is asked to anchor a prune on it. Each leader acks each
message; rank 0 deletes a message from the store once every leader took it.

May import: ``tiers.channel``, ``tiers.node_commit``, ``tiers.node_retention``, ``layouts``,
``storage``, leaves.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Collection
from typing import Any

import torch.distributed as dist

from ckptctl.errors import CkptError
from ckptctl.layouts.native import Committed
from ckptctl.storage.base import Storage
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.node_commit import commit_here, parse_committed
from ckptctl.tiers.node_retention import NodePruner, PrunePlan

log = logging.getLogger("ckptctl")

STREAM = "node"


class NodeMessages:
    """Rank 0's side of the ``node`` stream (``leaders``: how many nodes take each message)."""

    def __init__(self, channel: Channel, leaders: int) -> None:
        self.channel, self.leaders = channel, leaders
        self._lock = threading.Lock()
        self._unacked: list[int] = []
        self._conn: "dist.Store | None" = None

    def commit(self, name: str, source: Committed) -> None:
        self._send({"op": "commit", "name": name, "manifest": base64.b64encode(source.manifest_raw).decode(),
                    "marker": base64.b64encode(source.marker_raw).decode()})

    def prune(self, p: PrunePlan) -> None:
        self._send({"op": "prune", "anchor": p.anchor, "delete": list(p.delete), "keep": list(p.keep)})

    def stop(self) -> None:
        self._send({"op": "stop"})

    def _send(self, message: dict[str, Any]) -> None:
        with self._lock:
            if self._conn is None:
                self._conn = self.channel.connection()
            n = self.channel.send(STREAM, message)
            still = []
            for old in self._unacked:  # read by every leader: no longer needed in the store
                if self.channel.acks(self._conn, STREAM, old) >= self.leaders:
                    self.channel.forget(self._conn, STREAM, old, replies=False)
                else:
                    still.append(old)
            self._unacked = [*still, n]


class NodeKeeper:
    """The thread on a node's leader that applies the ``node`` stream to ``root`` (this node's
    first tier; ``ranks``: the ranks of this node)."""

    def __init__(self, channel: Channel, root: Storage, ranks: Collection[int]) -> None:
        self.channel, self.root, self.ranks = channel, root, frozenset(ranks)
        self.pruner = NodePruner(root, self.ranks)
        conn = channel.connection()  # here, not on the thread: see ``Channel.connection``
        self._thread = threading.Thread(target=self._run, args=(conn,), name=f"ckptctl-node-{root.url}", daemon=True)
        self._thread.start()

    def _run(self, conn: "dist.Store") -> None:
        for n, msg in self.channel.messages(conn, STREAM):
            if msg.get("op") == "stop":
                self.channel.give_back(conn)  # idle for good
                return
            try:
                self._apply(msg)
            except CkptError as e:
                log.error("node-local tier %s: %s failed: %s", self.root.url, msg.get("op"), e)
            except Exception as e:  # a bug must not end this node's commits and retention for the run
                log.error("node-local tier %s: %s failed unexpectedly", self.root.url, msg.get("op"), exc_info=e)
            finally:
                self.channel.ack(conn, STREAM, n)

    def _apply(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "commit":
            ckpt = self.root.sub(str(msg["name"]))
            source = parse_committed(ckpt, base64.b64decode(msg["manifest"]), base64.b64decode(msg["marker"]))
            commit_here(ckpt, source, self.ranks)
        elif msg["op"] == "prune":
            self.pruner.apply(PrunePlan(str(msg["anchor"]), tuple(str(n) for n in msg["delete"]),
                                        tuple(str(n) for n in msg.get("keep", ()))))

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()
