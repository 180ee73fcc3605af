"""A thread's connection to the c10d store, made again after a network error, and the pool of
idle connections the ``Checkpointer``s of one process share.

**Surviving the network.** A TCPStore connection that breaks (the store's host briefly
unreachable, a middlebox resetting a connection that waited for hours) raises
``DistNetworkError`` from the request in flight, and every later request on it fails too. A
tiers thread must not end there: the node's commits and retention, a rank's uploads and
replicas would stop for the rest of the run while training goes on. So every request of a
``Link`` that fails that way is retried on a new connection, after 0.5 s, doubling up to
30 s, for as long as the job runs; the first failure is logged once at WARNING, the recovery
once, and a thread that stays without the store for long is reported to the training
process (``tiers.health``). Every request the tiers make is safe to repeat: ``set`` and
``delete_key`` are idempotent, a ``wait``/``get`` reads again, and the counters the tiers
keep are lists of ranks (``append``), read as sets. A ``DistStoreError`` (a wait that timed
out) is not a network error: it goes to the caller.

**New connections are few.** c10d resolves the peer's name (a reverse DNS query) on every new
connection, on the client and on the store's single server thread, and a resolver that drops
one of a burst of queries stalls every rank of the job for its retry timeout (glibc: 5 s). So
a connection left idle for good (a thread that took ``stop``, a closed channel) goes back to
a pool that the next ``Checkpointer`` of the process takes from (``_Pool``); one that failed
never does.

May import: ``tiers.health``, leaves (and torch.distributed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

import torch.distributed as dist

from ckptctl.tiers.health import Health

log = logging.getLogger("ckptctl")

T = TypeVar("T")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


class _Pool:
    """Idle connections to the default store (clones of it, no prefix of ours), for the next
    ``Channel`` of this process. Only connections with no request in flight come back; one made
    for an earlier default store (a re-initialised job) is never handed out."""

    MAX = 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple["dist.Store", "dist.Store"]] = []  # (base store, its clone)

    def take(self, base: "dist.Store") -> "dist.Store":
        with self._lock:
            self._idle = [(b, c) for b, c in self._idle if b is base]  # an old job's: dropped
            if self._idle:
                return self._idle.pop()[1]
        return base.clone()

    def give(self, base: "dist.Store", conn: "dist.Store") -> None:
        with self._lock:
            if len(self._idle) < self.MAX:
                self._idle.append((base, conn))


POOL = _Pool()


class Link:
    """One thread's connection to the store under ``prefix`` (none: the whole store):
    ``call(fn)`` runs ``fn(store)``,
    on a new connection after a network error (see the module's docstring). ``worker`` and
    ``tier`` name the thread in logs and in ``health``. Made by the thread that starts the
    worker, before it starts."""

    def __init__(self, base: "dist.Store", prefix: str, worker: str, tier: str, health: Health | None) -> None:
        self.base, self.prefix, self.worker, self.tier, self.health = base, prefix, worker, tier, health
        self._raw: "dist.Store | None" = POOL.take(base)  # None after a network error: made again
        self._lock = threading.Lock()  # a connection serves one request at a time
        self.reconnects = 0

    def _store(self) -> "dist.Store":
        if self._raw is None:
            self._raw = self.base.clone()  # raises DistNetworkError while the store is unreachable
            self.reconnects += 1
        return dist.PrefixStore(self.prefix, self._raw) if self.prefix else self._raw

    def call(self, fn: Callable[["dist.Store"], T]) -> T:
        with self._lock:
            return self._call(fn)

    def _call(self, fn: Callable[["dist.Store"], T]) -> T:
        delay, since = RETRY_FIRST_S, None
        while True:
            try:
                out = fn(self._store())
            except dist.DistStoreError:
                raise  # a wait that timed out: the caller decides
            except RuntimeError as e:  # DistNetworkError and kin: this connection is gone
                self._raw = None  # never back to the pool: it may be half-closed
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if since is None:
                    since = time.monotonic()
                    log.warning("tiers: the %s lost its connection to the c10d store (%s); reconnecting",
                                self.worker, why)
                if self.health is not None:
                    self.health.failing(self.worker, self.tier, f"the c10d store is unreachable ({why})")
                time.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            if since is not None:
                log.warning("tiers: the %s is connected to the c10d store again after %.1f s", self.worker,
                            time.monotonic() - since)
                if self.health is not None:
                    self.health.recovered(self.worker)
            return out

    def give_back(self) -> None:
        """Idle for good, no request in flight and none to come: the next ``Checkpointer`` of
        this process may use the connection."""
        if self._raw is not None:
            POOL.give(self.base, self._raw)
        self._raw = None


# What ``peek`` asks ``compare_set`` to expect and write: a value no key of ours ever holds.
_ABSENT = "\x00ckptctl: absent\x00"


def peek(st: "dist.Store", key: str) -> bytes | None:
    """``key``'s value, or None when it does not exist, in one request that never waits: a
    ``get`` of a key another rank deleted meanwhile (after a ``check`` or a ``wait`` said it was
    there) blocks until the store's timeout, 30 minutes by default. ``compare_set`` of an absent
    key with a non-empty expected value creates nothing and answers the expected value."""
    got = st.compare_set(key, _ABSENT, _ABSENT)
    return None if got == _ABSENT.encode() else got
