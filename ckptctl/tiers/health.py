"""What the training process is told about the tiers' background threads: which one is in
trouble, for which tier, and why.

Each background thread of the tiers (rank 0's promoters and after-commit work, every rank's
upload, replica and node threads) survives what it can: a store or network error is retried
with backoff on a new connection (``tiers.link``), a failed round or prune is logged and the
next one tried. Two things it cannot fix alone: the c10d store unreachable for long, and the
thread itself ended by a bug. Both are recorded here, and the ``Checkpointer`` reads them at
each ``save()`` (one WARNING per trouble, when it starts: a dead thread is restarted there, so
node retention never stops while saves go on), in ``health()`` and in ``close()``'s ``Flushed``.

May import: leaves only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

# A store error is not worth a warning at ``save()`` until the thread has been without the
# store this long: a blip that one reconnection fixes is logged where it happens, once.
STALLED_AFTER_S = 60.0


@dataclass(frozen=True)
class Trouble:
    """One background thread that is not doing its work: ``worker`` (what it does, and on
    which rank), ``tier`` (the URL of the tier it serves), ``why``; ``dead``: the thread ended
    (else it is still retrying), ``for_s``: how long it has been so."""

    worker: str
    tier: str
    why: str
    dead: bool
    for_s: float

    def __str__(self) -> str:
        state = "stopped" if self.dead else f"retrying for {self.for_s:.0f} s"
        return f"{self.worker} for {self.tier} {state}: {self.why}"


@dataclass
class _Entry:
    tier: str
    why: str
    dead: bool
    since: float
    warned: bool = False


class Health:
    """The troubles of one ``Checkpointer``'s tier threads on this rank. Thread-safe: the
    threads record, the training thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._troubles: dict[str, _Entry] = {}

    def failing(self, worker: str, tier: str, why: str) -> None:
        """``worker`` cannot reach what it needs and keeps retrying (the first failure sets
        the time it started)."""
        with self._lock:
            e = self._troubles.get(worker)
            if e is None or e.dead:
                self._troubles[worker] = _Entry(tier, why, False, time.monotonic())
            else:
                e.why = why

    def died(self, worker: str, tier: str, why: str) -> None:
        """``worker``'s thread ended without being told to stop (again: still told once)."""
        with self._lock:
            e = self._troubles.get(worker)
            if e is not None and e.dead:
                e.why = why
            else:
                self._troubles[worker] = _Entry(tier, why, True, time.monotonic())

    def recovered(self, worker: str) -> None:
        with self._lock:
            self._troubles.pop(worker, None)

    def troubles(self, *, min_s: float = 0.0) -> tuple[Trouble, ...]:
        """Every trouble now (a retrying one only once it lasted ``min_s``), oldest first."""
        now = time.monotonic()
        with self._lock:
            items = sorted(self._troubles.items(), key=lambda kv: kv[1].since)
            return tuple(Trouble(w, e.tier, e.why, e.dead, now - e.since) for w, e in items
                         if e.dead or now - e.since >= min_s)

    def unannounced(self) -> tuple[Trouble, ...]:
        """The troubles not yet reported to the training process (dead threads, and threads
        retrying for ``STALLED_AFTER_S``); each is returned once, until it recovers."""
        found = self.troubles(min_s=STALLED_AFTER_S)
        with self._lock:
            fresh = []
            for t in found:
                e = self._troubles.get(t.worker)
                if e is not None and not e.warned:
                    e.warned = True
                    fresh.append(t)
            return tuple(fresh)
