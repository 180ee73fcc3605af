"""Time to durable per tier, time to replicated (peer replicas), and what
``Checkpointer.close()`` reports about the last tier.

May import: ``tiers.health``, leaves.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptctl.tiers.health import Trouble

KEEP_STEPS = 256  # a week-long job saves thousands of times: remember the recent ones only


class Durability:
    """Seconds from ``save()`` to durable on each tier, per step (rank 0's view: the commit
    on the first tier, each promotion after it). Thread-safe: the writer and the promoters
    record, the training thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}
        self._newest_started: int | None = None
        self._durable: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._replicated: OrderedDict[int, dict[str, float]] = OrderedDict()

    def started(self, step: int) -> None:
        with self._lock:
            self._started[step] = time.monotonic()
            self._newest_started = max(step, self._newest_started if self._newest_started is not None else step)

    def newest_started(self) -> int | None:
        """The newest step a ``save()`` was started for in this process (None before the first)."""
        with self._lock:
            return self._newest_started

    def reached(self, step: int, tier: str) -> float | None:
        """Record that ``step`` is durable on ``tier`` now; returns the seconds since its save."""
        with self._lock:
            t0 = self._started.get(step)
            if t0 is None:
                return None  # saved before this process started (a resume promoting on)
            seconds = time.monotonic() - t0
            self._durable.setdefault(step, {})[tier] = seconds
            self._durable.move_to_end(step)
            while len(self._durable) > KEEP_STEPS:
                old, _ = self._durable.popitem(last=False)
                self._started.pop(old, None)
            return seconds

    def replicated(self, step: int, nbytes: int) -> float | None:
        """Record that every rank's shard of ``step`` is on its partner node now, ``nbytes``
        sent over the network for it by all ranks together; returns the seconds since its
        save (None: saved before this process started)."""
        with self._lock:
            t0 = self._started.get(step)
            if t0 is None:
                return None
            seconds = time.monotonic() - t0
            self._replicated[step] = {"replicated_s": seconds, "replica_bytes": float(nbytes)}
            self._replicated.move_to_end(step)
            while len(self._replicated) > KEEP_STEPS:
                self._replicated.popitem(last=False)
            return seconds

    def replication(self, step: int | None = None) -> dict[str, float]:
        """``{"replicated_s": seconds from save to every replica complete, "replica_bytes":
        bytes sent}`` for ``step`` (default: the newest replicated); empty when not replicated."""
        with self._lock:
            if step is None:
                step = next(reversed(self._replicated), None)
            return dict(self._replicated.get(step, {})) if step is not None else {}

    def of(self, step: int | None = None) -> dict[str, float]:
        """``{tier URL: seconds}`` for ``step``: the tiers it reached so far. By default, for
        every tier reached in this run, the newest step that reached it: the newest save is
        often on the first tier only (the next tier's cadence did not choose it, or its
        promotion is still running), and the slower tiers are what a caller asks about."""
        with self._lock:
            if step is not None:
                return dict(self._durable.get(step, {}))
            newest: dict[str, float] = {}
            for reached in reversed(self._durable.values()):
                for tier, seconds in reached.items():
                    newest.setdefault(tier, seconds)
            return newest


@dataclass(frozen=True)
class Flushed:
    """What ``close()`` found: whether the newest committed checkpoint (``step``) reached the
    last tier within the wait (``complete``), the tiers it is on, and why not when it is not.
    ``step`` None: nothing was committed in this run, so nothing was owed. ``troubles``: rank
    0's tier threads that were not doing their work at the end (``Checkpointer.health()``)."""

    complete: bool
    step: int | None
    tiers: tuple[str, ...] = ()
    missing: str | None = None  # the first tier it did not reach
    reason: str = ""
    waited_s: float = 0.0
    durable_s: dict[str, float] = field(default_factory=dict)  # time to durable per tier reached
    troubles: tuple[Trouble, ...] = ()

    def __bool__(self) -> bool:
        return self.complete
