"""Telling a slow rank from a dead one while rank 0 waits for a promotion round's replies.

A round's deadline grows with the bytes each rank must upload (``tiers.promotion_round``), up
to hours for a large shard: a slow rank must get that long, but a dead one must not hold the
promotion for as long. The save coordinator already tells them apart: every rank's heartbeat
thread adds 1 to ``alive/<rank>`` under ``ckptctl/<group name>/`` in the c10d store every
beat (``save/heartbeat.py``; docs/protocol.md, "Liveness"). While rank 0 waits, a ``Watch``
thread reads the counters of the ranks that have not replied yet, notes by its own clock when
each last changed, and answers for a rank whose counter stood still for ``liveness_s``: it
writes ``dead:<why>`` as that rank's reply (``compare_set`` on the absent key, so a real reply
is never overwritten), which ends the wait as a reply would. A rank that never beat (no
counter yet) is never taken as dead here: the deadline still bounds it.

May import: ``tiers.link``, leaves (and torch.distributed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ckptctl.tiers.link import Link, StoreGone

HEARTBEAT_PREFIX = "ckptctl/{group}/"  # the save coordinator's side channel: keys alive/<rank>
BEAT_MIN_S, BEAT_MAX_S = 0.2, 10.0  # how often the counters are read: liveness_s / 6, within these


class Watch:
    """Rank 0's watch over the ranks a round waits for. ``link``: a connection to the whole
    store (no prefix), for the watch's thread alone; ``replies_prefix``: the channel's."""

    def __init__(self, link: Link, group_name: str, replies_prefix: str, liveness_s: float) -> None:
        self.link, self.liveness_s = link, liveness_s
        self.beats = HEARTBEAT_PREFIX.format(group=group_name)
        self.replies = replies_prefix
        self.interval = min(max(liveness_s / 6, BEAT_MIN_S), BEAT_MAX_S)
        self.dead: list[int] = []  # the ranks the last watch answered for

    @contextmanager
    def during(self, keys: dict[int, str]) -> Iterator[None]:
        """While the caller waits for ``keys`` (each rank's reply key, under the channel's prefix)."""
        stop = threading.Event()
        self.dead = []
        t = threading.Thread(target=self._run, args=(keys, stop), name="ckptctl-round-watch", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def _run(self, keys: dict[int, str], stop: threading.Event) -> None:
        try:
            self._watch(keys, stop)
        except StoreGone:
            pass  # closing without a store: the round's own wait gives up with it

    def _watch(self, keys: dict[int, str], stop: threading.Event) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last changed)
        while not stop.wait(self.interval):
            pending = self.link.call(lambda st: [k for k, key in keys.items() if not self._replied(st, key)])
            if not pending:
                return
            counters = self.link.call(lambda st: self._counters(st, pending))
            now = time.monotonic()
            for k, count in counters.items():
                last = seen.get(k)
                if last is None or last[0] != count:
                    seen[k] = (count, now)
                elif now - last[1] >= self.liveness_s and k not in self.dead:
                    why = f"dead:no heartbeat from rank {k} for {now - last[1]:.0f} s (the process died or froze)"
                    self.link.call(lambda st: dist.PrefixStore(self.replies, st).compare_set(keys[k], "", why))
                    self.dead.append(k)

    def _replied(self, st: "dist.Store", key: str) -> bool:
        return dist.PrefixStore(self.replies, st).check([key])

    def _counters(self, st: "dist.Store", ranks: Collection[int]) -> dict[int, int]:
        beats = dist.PrefixStore(self.beats, st)
        found = {}
        for k in ranks:
            key = f"alive/{k}"
            if beats.check([key]):  # a ``get`` of an absent key would block until the store's timeout
                found[k] = int(beats.get(key))
        return found
