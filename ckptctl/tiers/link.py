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

**Giving up at close.** At the end of a job the store may be gone for good (its host, often
node 0's torchrun agent, exited or was killed), and retrying "for as long as the job runs"
would hang ``Checkpointer.close`` forever. So once close begins (``Closing.begin``, shared by
the links of one channel), a link that cannot reach the store retries only until
``settings.CLOSE_STORE_TIMEOUT_S`` have passed since the later of close's start and its first
failure, then raises ``StoreGone``; every link of the channel that fails after that gives up
at once. A healthy store is never given up on: a close waits for it as long as its own
timeouts say. While closing, a new connection is made on a helper thread and waited for only
until that deadline: c10d's connect retries for the store's whole timeout (30 minutes by
default) when nothing listens.

**New connections are few.** c10d resolves the peer's name (a reverse DNS query) on every new
connection, on the client and on the store's single server thread, and a resolver that drops
one of a burst of queries stalls every rank of the job for its retry timeout (glibc: 5 s). So
a connection left idle for good (a thread that took ``stop``, a closed channel) goes back to
a pool that the next ``Checkpointer`` of the process takes from (``_Pool``); one that failed
never does. And the users of one thread that never wait long share one link (``share``):
rank 0's after-commit thread sends the node and replica messages and reads the nodes' lists
on one connection.

May import: ``tiers.health``, ``settings``, ``errors``, leaves (and torch.distributed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

import torch.distributed as dist

from ckptctl.errors import EXIT_OPERATIONAL, CkptError
from ckptctl.settings import CLOSE_STORE_TIMEOUT_S
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


class StoreGone(CkptError):
    """A closing link gave up on a c10d store it could not reach (see the module's docstring).

    Operational (exit code 3), yet deliberately not an ``OperationalError``: those are retried
    (a promoter backs off and tries again), and nothing can succeed once the store is gone; as
    any other ``CkptError`` it ends the attempt at once (a promoter gives the step up, a
    thread's work fails), so close's waits end with it."""

    exit_code = EXIT_OPERATIONAL


class Closing:
    """When the links of one channel stop retrying an unreachable store: never while the job
    runs; from ``begin`` (the first step of close) on, after ``timeout_s`` without the store."""

    def __init__(self, timeout_s: float = CLOSE_STORE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.began: float | None = None  # time.monotonic() of close's start
        self.gone: str | None = None  # why the first link gave up: the others then give up at once
        self._wake = threading.Event()  # a link sleeping between retries retries at once when close begins

    def begin(self) -> None:
        if self.began is None:
            self.began = time.monotonic()
            self._wake.set()

    def left(self, failing_since: float) -> float | None:
        """Seconds a link failing since ``failing_since`` may still retry; None: not closing."""
        if self.began is None:
            return None
        if self.gone is not None:
            return 0.0
        return max(failing_since, self.began) + self.timeout_s - time.monotonic()

    def pause(self, seconds: float) -> None:
        if self.began is None:
            self._wake.wait(seconds)  # close's start ends the pause: its deadline counts from then
        else:
            time.sleep(seconds)


class Link:
    """One thread's connection to the store under ``prefix`` (none: the whole store):
    ``call(fn)`` runs ``fn(store)``,
    on a new connection after a network error (see the module's docstring). ``worker`` and
    ``tier`` name the thread in logs and in ``health``. Made by the thread that starts the
    worker, before it starts."""

    def __init__(self, base: "dist.Store", prefix: str, worker: str, tier: str, health: Health | None,
                 closing: Closing | None = None) -> None:
        self.base, self.prefix, self.worker, self.tier, self.health = base, prefix, worker, tier, health
        self.closing = closing if closing is not None else Closing()
        self._raw: "dist.Store | None" = POOL.take(base)  # None after a network error: made again
        self._lock = threading.Lock()  # a connection serves one request at a time
        self._users = 1  # ``share`` adds one; the connection goes back once every user gave it back
        self.reconnects = 0

    def share(self) -> "Link":
        """This link again, for another user on the same thread (no wait of one may hold up the
        other: rank 0's after-commit thread sends and reads short requests only). Each user
        calls ``give_back`` once; the last one returns the connection."""
        self._users += 1
        return self

    def _store(self, failing_since: float | None) -> "dist.Store":
        if self._raw is None:  # each raises DistNetworkError while the store is unreachable
            left = self.closing.left(time.monotonic() if failing_since is None else failing_since)
            if left is None:
                self._raw = self.base.clone()
            elif left > 0:
                self._raw = _clone_within(self.base, left)
            else:  # given up on already: no connection attempt that would outlive close
                raise RuntimeError(self.closing.gone or "the c10d store is unreachable")
            self.reconnects += 1
        return dist.PrefixStore(self.prefix, self._raw) if self.prefix else self._raw

    def call(self, fn: Callable[["dist.Store"], T]) -> T:
        with self._lock:
            return self._call(fn)

    def _call(self, fn: Callable[["dist.Store"], T]) -> T:
        delay, since, first = RETRY_FIRST_S, None, ""
        while True:
            try:
                out = fn(self._store(since))
            except dist.DistStoreError:
                raise  # a wait that timed out: the caller decides
            except RuntimeError as e:  # DistNetworkError and kin: this connection is gone
                self._raw = None  # never back to the pool: it may be half-closed
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if since is None:
                    since, first = time.monotonic(), why  # the first error says most (a refused reconnect, little)
                    if self.closing.gone is None:  # else it gives up at once, below: no "reconnecting"
                        log.warning("tiers: the %s lost its connection to the c10d store (%s); reconnecting",
                                    self.worker, why)
                if self.health is not None:
                    self.health.failing(self.worker, self.tier, f"the c10d store is unreachable ({why})")
                left = self.closing.left(since)
                if left is not None and left <= 0:
                    raise self._give_up(since, first) from None
                self.closing.pause(delay if left is None else min(delay, left))
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            if since is not None:
                log.warning("tiers: the %s is connected to the c10d store again after %.1f s", self.worker,
                            time.monotonic() - since)
                if self.health is not None:
                    self.health.recovered(self.worker)
            return out

    def _give_up(self, since: float, why: str) -> StoreGone:
        closing = self.closing
        if closing.gone is None:
            closing.gone = f"the c10d store has been unreachable for {time.monotonic() - since:.0f} s while closing ({why})"
            log.warning("tiers: the %s gives up on the c10d store: %s", self.worker, closing.gone)
        if self.health is not None:  # it stops for good: close's troubles must not say "retrying"
            self.health.died(self.worker, self.tier, f"gave up: {closing.gone}")
        return StoreGone(closing.gone, hint="the job's store is gone (its host exited); what the local tier holds stays "
                                            "valid: resume from it with load_latest")

    def give_back(self) -> None:
        """Idle for good, no request in flight and none to come: the next ``Checkpointer`` of
        this process may use the connection (once every user of a shared link said so)."""
        self._users -= 1
        if self._users > 0:
            return
        if self._raw is not None:
            POOL.give(self.base, self._raw)
        self._raw = None


def _clone_within(base: "dist.Store", seconds: float) -> "dist.Store":
    """``base.clone()``, waited for ``seconds`` at most (the clone then goes on, on its daemon
    thread, and its connection, if any, is dropped): see "Giving up at close"."""
    made: list["dist.Store"] = []
    failed: list[RuntimeError] = []

    def connect() -> None:
        try:
            made.append(base.clone())
        except RuntimeError as e:  # DistNetworkError: nothing listens there
            failed.append(e)

    t = threading.Thread(target=connect, name="ckptctl-store-connect", daemon=True)
    t.start()
    t.join(max(seconds, 0.0))
    if made:
        return made[0]
    if failed:
        raise failed[0]
    raise RuntimeError(f"no connection to the c10d store within {max(seconds, 0.0):.0f} s")


# What ``peek`` asks ``compare_set`` to expect and write: a value no key of ours ever holds.
_ABSENT = "\x00ckptctl: absent\x00"


def peek(st: "dist.Store", key: str) -> bytes | None:
    """``key``'s value, or None when it does not exist, in one request that never waits: a
    ``get`` of a key another rank deleted meanwhile (after a ``check`` or a ``wait`` said it was
    there) blocks until the store's timeout, 30 minutes by default. ``compare_set`` of an absent
    key with a non-empty expected value creates nothing and answers the expected value."""
    got = st.compare_set(key, _ABSENT, _ABSENT)
    return None if got == _ABSENT.encode() else got
