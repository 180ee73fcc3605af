"""The tiers' channel between ranks: numbered messages from rank 0, replies from each rank,
through the c10d store of the default group.

Why the store and not a gloo group: a rank waits for rank 0's next message for as long as a job
runs (hours between promotions), which a gloo collective cannot do without its timeout
breaking the group; and store operations never queue behind, or in front of, the save
coordinator's gloo collectives or the training's NCCL ones. A rank that dies leaves its reply
missing, which rank 0 sees at its deadline, and nothing else breaks: the next round uses new
keys. Every thread that waits holds a connection of its own (``Store.clone``), because a
TCPStore connection serves one request at a time.

New connections are few: c10d resolves the peer's name (a reverse DNS query) on every new
connection, on the client and on the store's single server thread, and a resolver that drops
one of a burst of queries stalls every rank of the job for its retry timeout (glibc: 5 s). So
the collectives of the caller's thread (``exchange``, ``to_rank0``) share one connection; each
thread's is made by the thread that starts it; and a connection left idle (a thread that took
``stop``, a closed channel) goes back to a pool that the next ``Checkpointer`` of the process
takes from (``_Pool``).

Keys, under ``ckptctl-tiers/<group name>/``:

* ``<stream>/<n>``: rank 0's n-th message on ``stream`` (``promote``, ``node`` or ``replica``), JSON;
* ``<stream>/<n>/r<k>``: rank k's reply to it (``promote`` and ``replica``);
* ``<stream>/<n>/acks``: how many ranks took it (``node``), so rank 0 deletes it once all did;
* ``nodes/<k>``: rank k's node, exchanged once when the ``Checkpointer`` is built;
* ``steps/<n>/<k>``: the steps node leader k's node holds committed, for rank 0's n-th
  candidate list (``tiers.node_candidates``), deleted by rank 0 once read.

May import: leaves only (and torch.distributed).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection
from datetime import timedelta
from typing import Any, Iterator

import torch.distributed as dist

from ckptctl.errors import CoordinationError

log = logging.getLogger("ckptctl")

# A thread waits for rank 0's next message this long per store request: a wait that times out
# is logged by c10d, and messages may be hours apart.
WAIT_S = 86400.0


def _default_store() -> "dist.Store":
    from torch.distributed.distributed_c10d import _get_default_store  # private: guarded by the caller

    return _get_default_store()


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


_POOL = _Pool()


class Channel:
    """One ``Checkpointer``'s tiers channel. ``rank``/``world_size``: in its process group."""

    def __init__(self, group_name: str, rank: int, world_size: int) -> None:
        try:
            base = _default_store()
        except (ImportError, AttributeError, ValueError, RuntimeError) as e:
            raise CoordinationError(f"node-local tiers need the c10d store of the default group: {e}",
                                    hint="initialise torch.distributed with a store (torchrun does)") from None
        self._base = base
        self._prefix = f"ckptctl-tiers/{group_name}/"
        self._store = dist.PrefixStore(self._prefix, base)
        self.rank, self.world_size = rank, world_size
        self._send_lock = threading.Lock()
        self._sender: dist.Store | None = None
        self._own_lock = threading.Lock()  # the caller's thread's collectives: one connection
        self._own: dist.Store | None = None
        self._sent = {"promote": 0, "node": 0, "replica": 0}

    def connection(self) -> "dist.Store":
        """A connection of its own, for one thread: made by the thread that starts it, before
        it starts (see the module's docstring). ``give_back`` it once idle for good."""
        return dist.PrefixStore(self._prefix, _POOL.take(self._base))

    def give_back(self, conn: "dist.Store") -> None:
        """``conn`` (from ``connection``) is idle for good, no request in flight and none to
        come: the next ``Checkpointer`` of this process may use it. Not after a store error."""
        under = getattr(conn, "underlying_store", None)
        if under is not None:
            _POOL.give(self._base, under)

    def close(self) -> None:
        """The connections of the caller's thread and of ``send`` go back to the pool (call it
        once this channel's collectives and sends are over)."""
        with self._own_lock, self._send_lock:
            for conn in (self._own, self._sender):
                if conn is not None:
                    self.give_back(conn)
            self._own = self._sender = None

    def _caller(self) -> "dist.Store":
        """The connection of the collectives below (hold ``_own_lock``)."""
        if self._own is None:
            self._own = self.connection()
        return self._own

    # --- rank 0 -------------------------------------------------------------------------------

    def send(self, stream: str, message: dict[str, Any]) -> int:
        """Publish the next message on ``stream``; returns its number."""
        with self._send_lock:
            if self._sender is None:
                self._sender = self.connection()
            self._sent[stream] += 1
            n = self._sent[stream]
            self._sender.set(f"{stream}/{n}", json.dumps(message).encode())
            return n

    def replies(self, conn: "dist.Store", stream: str, n: int, timeout_s: float) -> dict[int, str]:
        """Every rank's reply to message ``n``, waiting ``timeout_s`` at most; ranks that did
        not reply by then are absent. One blocking wait, not a poll: c10d logs every wait
        that times out, and a store's load grows with the number of polling ranks."""
        keys = {k: f"{stream}/{n}/r{k}" for k in range(self.world_size)}
        try:
            conn.wait(list(keys.values()), timedelta(seconds=max(timeout_s, 0.001)))
        except dist.DistStoreError:
            pass  # the deadline: take the replies that are there
        return {k: conn.get(key).decode() for k, key in keys.items() if conn.check([key])}

    def forget(self, conn: "dist.Store", stream: str, n: int, *, replies: bool) -> None:
        """Delete message ``n`` (and its replies): everyone has read it."""
        conn.delete_key(f"{stream}/{n}")
        if replies:
            for k in range(self.world_size):
                conn.delete_key(f"{stream}/{n}/r{k}")
        else:
            conn.delete_key(f"{stream}/{n}/acks")

    def acks(self, conn: "dist.Store", stream: str, n: int) -> int:
        return int(conn.add(f"{stream}/{n}/acks", 0))

    # --- every rank ---------------------------------------------------------------------------

    def receive(self, conn: "dist.Store", stream: str, n: int) -> dict[str, Any] | None:
        """Message ``n`` of ``stream`` once rank 0 sent it (waiting as long as the job runs);
        None when the store is gone (the job is ending)."""
        key = f"{stream}/{n}"
        while True:
            try:
                conn.wait([key], timedelta(seconds=WAIT_S))
                return json.loads(conn.get(key))
            except dist.DistStoreError:
                continue  # a day without a message: wait on
            except RuntimeError as e:  # DistNetworkError and kin: the store's host has exited
                log.info("tiers channel: the c10d store is gone (%s); this rank stops promoting", e)
                return None

    def messages(self, conn: "dist.Store", stream: str) -> Iterator[tuple[int, dict[str, Any]]]:
        """Rank 0's messages on ``stream`` in order, each with its number (from 1), as they are
        sent; ends when the store is gone."""
        n = 0
        while (msg := self.receive(conn, stream, n + 1)) is not None:
            n += 1
            yield n, msg

    def reply(self, conn: "dist.Store", stream: str, n: int, text: str) -> None:
        conn.set(f"{stream}/{n}/r{self.rank}", text.encode())

    def ack(self, conn: "dist.Store", stream: str, n: int) -> None:
        conn.add(f"{stream}/{n}/acks", 1)

    def exchange(self, key: str, mine: str, timeout_s: float) -> list[str]:
        """Every rank's ``mine`` for ``key``, by rank (a collective: every rank calls it)."""
        with self._own_lock:
            conn = self._caller()
            conn.set(f"{key}/{self.rank}", mine.encode())
            keys = [f"{key}/{k}" for k in range(self.world_size)]
            try:
                conn.wait(keys, timedelta(seconds=timeout_s))
            except dist.DistStoreError as e:
                raise CoordinationError(f"tiers: not every rank built its Checkpointer within {timeout_s:.0f} s ({e})",
                                        hint="construct the Checkpointer at the same point on every rank") from None
            return [v.decode() for v in conn.multi_get(keys)]

    def to_rank0(self, key: str, mine: str | None, senders: Collection[int], timeout_s: float) -> dict[int, str]:
        """Gather ``mine`` from each of ``senders`` on rank 0 (each sender calls it; other ranks
        need not). A sender publishes and returns ``{}`` at once; rank 0 waits ``timeout_s`` at
        most, returns what arrived by sender (a sender that did not publish in time is absent),
        and deletes the keys. Store traffic: one key per sender, not one per rank."""
        with self._own_lock:
            return self._to_rank0(self._caller(), key, mine, senders, timeout_s)

    def _to_rank0(self, conn: "dist.Store", key: str, mine: str | None, senders: Collection[int],
                  timeout_s: float) -> dict[int, str]:
        if self.rank != 0:
            if mine is not None:
                conn.set(f"{key}/{self.rank}", mine.encode())
            return {}
        keys = {k: f"{key}/{k}" for k in senders if k != 0}
        got = {0: mine} if mine is not None and 0 in senders else {}
        if not keys:
            return got
        try:
            conn.wait(list(keys.values()), timedelta(seconds=max(timeout_s, 0.001)))
        except dist.DistStoreError:
            pass  # the deadline: take what is there
        for k, name in keys.items():
            if conn.check([name]):
                got[k] = conn.get(name).decode()
                conn.delete_key(name)
        return got
