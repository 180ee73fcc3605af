"""Each node's keeper of its first tier: applies rank 0's node messages, in order, on a thread
of the node's leader (its lowest rank).

Rank 0 (``NodeMessages``) sends on the channel's ``node`` stream, after each save commits:
``commit`` (the checkpoint's manifest and marker, for the node-local commit rule of
``tiers.node_commit``), then, when the tier has retention rules, ``prune`` (a
``node_retention.PrunePlan``: what to delete, possibly nothing, and what to keep); and
``stop`` when the ``Checkpointer`` closes. One stream, so a node always commits a step before
it is asked to anchor a prune on it. Each leader replies ``ok`` once a message is applied
(or failed: logged), and rank 0 deletes each message once every leader did
(``tiers.stream``); a leader that falls far behind skips to the newest, whose prune plan
covers what it missed. After each prune a leader also publishes which steps its node holds
committed (``held/<leader>``, one key per node, overwritten), and rank 0 plans over those too:
a step rank 0's node no longer holds is still decided by the rules on the others.

May import: ``tiers.stream``, ``tiers.channel``, ``tiers.link``, ``tiers.node_commit``, ``tiers.node_retention``,
``layouts``, ``storage``, leaves.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Collection
from typing import Any

import torch.distributed as dist

from ckptctl.errors import CkptError
from ckptctl.layouts.native_read import Committed
from ckptctl.storage.base import Storage
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.link import Link
from ckptctl.tiers.node_commit import commit_here, parse_committed
from ckptctl.tiers.node_retention import NodePruner, PrunePlan, held
from ckptctl.tiers.stream import StreamWorker

log = logging.getLogger("ckptctl")

STREAM = "node"
HELD = "held"  # held/<leader>: the steps that leader's node holds committed, after its last prune
KEEP = 16  # node messages open at once (each leader applies them in order, a commit and a prune per save)


class NodeMessages:
    """Rank 0's side of the ``node`` stream (``leaders``: each node's lowest rank), on ``link``
    (rank 0's after-commit thread's; else one of its own): the messages and the nodes' lists."""

    def __init__(self, channel: Channel, leaders: Collection[int], link: Link | None = None) -> None:
        link = link or channel.link("node messages", "")
        self.outbox = channel.outbox(STREAM, leaders, KEEP, collected=False, link=link)
        self.leaders = sorted(k for k in leaders if k != 0)
        self._reader = link.share()

    def elsewhere(self) -> list[list]:
        """What the other nodes last said they hold (``node_retention.held``), by step."""
        def read(st: "dist.Store") -> list[bytes]:
            return [st.get(k) for k in (f"{HELD}/{r}" for r in self.leaders) if st.check([k])]

        found: list[list] = []
        for raw in self._reader.call(read):
            try:
                items = json.loads(raw)
                found += [[str(n), int(s), float(t), {str(k): float(v) for k, v in m.items()}] for n, s, t, m in items]
            except (ValueError, TypeError, AttributeError):
                log.warning("tiers: a node's list of its steps does not read; left out of this plan")
        return found

    def forget(self) -> None:
        """At close: the nodes' lists go."""
        self._reader.call(lambda st: [st.delete_key(f"{HELD}/{r}") for r in self.leaders])
        self._reader.give_back()

    def commit(self, name: str, source: Committed) -> None:
        self.outbox.send({"op": "commit", "name": name, "manifest": base64.b64encode(source.manifest_raw).decode(),
                          "marker": base64.b64encode(source.marker_raw).decode()})

    def prune(self, p: PrunePlan) -> None:
        self.outbox.send({"op": "prune", "anchor": p.anchor, "delete": list(p.delete), "keep": list(p.keep),
                          "failed": list(p.failed)})

    def stop(self) -> int:
        return self.outbox.stop()


class NodeKeeper(StreamWorker):
    """The thread on a node's leader that applies the ``node`` stream to ``root`` (this node's
    first tier; ``ranks``: the ranks of this node)."""

    ops = frozenset({"commit", "prune"})

    def __init__(self, channel: Channel, root: Storage, ranks: Collection[int]) -> None:
        self.root, self.ranks = root, frozenset(ranks)
        self.pruner = NodePruner(root, self.ranks)
        # The link is made here, not on the thread: see ``tiers.link``.
        super().__init__(channel.link(f"node keeper (rank {channel.rank})", root.url), STREAM, channel.rank,
                         channel.health)
        self.start()

    def handle(self, n: int, msg: dict[str, Any]) -> str:
        try:
            self._apply(msg)
        except CkptError as e:
            log.error("node-local tier %s: %s failed: %s", self.root.url, msg.get("op"), e)
        except Exception as e:  # a bug must not end this node's commits and retention for the run
            log.error("node-local tier %s: %s failed unexpectedly", self.root.url, msg.get("op"), exc_info=e)
        return "ok"

    def _apply(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "commit":
            ckpt = self.root.sub(str(msg["name"]))
            source = parse_committed(ckpt, base64.b64decode(msg["manifest"]), base64.b64decode(msg["marker"]))
            commit_here(ckpt, source, self.ranks)
        elif msg["op"] == "prune":
            self.pruner.apply(PrunePlan(str(msg["anchor"]), tuple(str(n) for n in msg["delete"]),
                                        tuple(str(n) for n in msg.get("keep", ())),
                                        tuple(str(n) for n in msg.get("failed", ()))))
            if self.rank != 0:  # for rank 0's next plan: what this node still holds (one key per node)
                listed = json.dumps(held(self.root))
                self.link.call(lambda st: st.set(f"{HELD}/{self.rank}", listed.encode()))
