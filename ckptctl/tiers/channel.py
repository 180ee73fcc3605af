"""The tiers' channel between ranks: numbered messages from rank 0, replies from each rank,
through the c10d store of the default group.

Why the store and not a gloo group: a rank waits for rank 0's next message for as long as a job
runs (hours between promotions), which a gloo collective cannot do without its timeout
breaking the group; and store operations never queue behind, or in front of, the save
coordinator's gloo collectives or the training's NCCL ones. A rank that dies leaves its reply
missing, which rank 0 sees at its deadline (sooner when its heartbeat stops:
``tiers.liveness``), and nothing else breaks. Every thread that waits holds a connection of its
own (a ``tiers.link.Link``: one request at a time per TCPStore connection, made again after a
network error, taken from and given back to a pool so that new connections stay few). The
channel's links share one ``tiers.link.Closing``: once close began (``begin_closing``), they
give up on a store they cannot reach after ``settings.CLOSE_STORE_TIMEOUT_S``.

Keys, under ``ckptctl-tiers/<group name>/``, each deleted once read by everyone who needs it
(``tiers.stream`` says when, for the streams; the store holds a bounded number of keys
whatever fails, for as long as the job runs):

* ``<stream>/<n>``, ``<stream>/<n>/r<k>``, ``<stream>/floor``: rank 0's n-th message on
  ``stream`` (``promote``, ``node`` or ``replica``), rank k's reply, the lowest message kept
  (``tiers.stream``);
* ``nodes/<k>``: rank k's node, exchanged once when the ``Checkpointer`` is built; deleted by
  the last rank to read them all (``nodes/read`` lists who did);
* ``steps/<n>/<k>``: the steps node leader k's node holds committed, for rank 0's n-th
  candidate list (``tiers.node_candidates``), deleted by rank 0 once read, or at its next
  gather (and at close) when it came after rank 0 stopped waiting.

May import: ``tiers.link``, ``tiers.stream``, ``tiers.health``, leaves (and torch.distributed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from datetime import timedelta

import torch.distributed as dist

from ckptctl.errors import CoordinationError
from ckptctl.tiers.health import Health
from ckptctl.tiers.link import Closing, Link, StoreGone, peek
from ckptctl.tiers.stream import Outbox

log = logging.getLogger("ckptctl")


def _default_store() -> "dist.Store":
    from torch.distributed.distributed_c10d import _get_default_store  # private: guarded by the caller

    return _get_default_store()


class Channel:
    """One ``Checkpointer``'s tiers channel. ``rank``/``world_size``: in its process group;
    ``health``: where its threads' troubles are recorded."""

    def __init__(self, group_name: str, rank: int, world_size: int, health: Health | None = None) -> None:
        try:
            base = _default_store()
        except (ImportError, AttributeError, ValueError, RuntimeError) as e:
            raise CoordinationError(f"node-local tiers need the c10d store of the default group: {e}",
                                    hint="initialise torch.distributed with a store (torchrun does)") from None
        self.base, self.group_name = base, group_name
        self.prefix = f"ckptctl-tiers/{group_name}/"
        self.rank, self.world_size, self.health = rank, world_size, health
        self.closing = Closing()
        self._own_lock = threading.Lock()  # the caller's thread's collectives: one connection
        self._own = self.link(f"tiers channel of rank {rank}", "")
        self._late: list[str] = []  # rank 0: ``to_rank0`` keys that came after the deadline, to delete

    def link(self, worker: str, tier: str, *, prefixed: bool = True) -> Link:
        """A connection of its own, for one thread (``worker``, serving ``tier``), under this
        channel's prefix (or, not ``prefixed``, to the whole store): made by the thread that
        starts it, before it starts (see ``tiers.link``). ``give_back`` it once idle for good."""
        return Link(self.base, self.prefix if prefixed else "", worker, tier, self.health, self.closing)

    def outbox(self, stream: str, receivers: Collection[int], keep: int, *, collected: bool,
               latest_only: bool = False, link: Link | None = None) -> Outbox:
        """Rank 0's side of ``stream`` (``tiers.stream``), on ``link`` (the sending thread's,
        under no prefix of the channel), else a connection of its own."""
        return Outbox(link or self.link(f"{stream} sender", ""), stream, receivers, keep, collected=collected,
                      latest_only=latest_only)

    def begin_closing(self) -> None:
        """From now on this channel's links give up on an unreachable store (``tiers.link``)."""
        self.closing.begin()

    def close(self) -> None:
        """Delete what rank 0 still holds of late gathers; the caller's thread's connection goes
        back to the pool (call it once this channel's collectives are over)."""
        with self._own_lock:
            try:
                self._delete_late()
            except StoreGone:
                pass  # they went with the store
            self._own.give_back()

    # --- collectives of the caller's thread -------------------------------------------------------

    def exchange(self, key: str, mine: str, timeout_s: float) -> list[str]:
        """Every rank's ``mine`` for ``key``, by rank (a collective: every rank calls it). The
        last rank to have read them all deletes them."""
        keys = [f"{key}/{k}" for k in range(self.world_size)]

        def run(st: "dist.Store") -> list[str]:
            st.set(f"{key}/{self.rank}", mine.encode())
            try:
                st.wait(keys, timedelta(seconds=timeout_s))
            except dist.DistStoreError as e:
                raise CoordinationError(f"tiers: not every rank built its Checkpointer within {timeout_s:.0f} s ({e})",
                                        hint="construct the Checkpointer at the same point on every rank") from None
            return [v.decode() for v in st.multi_get(keys)]

        def done(st: "dist.Store") -> None:
            st.append(f"{key}/read", f"{self.rank},")  # a list of ranks, not a counter: safe to repeat
            # Between the append and the read, the last rank may have read the list whole and
            # deleted it: absent then, and a ``get`` would block for the store's timeout.
            read = peek(st, f"{key}/read")
            if read is not None and len(set(read.decode().split(",")) - {""}) == self.world_size:
                for k in [*keys, f"{key}/read"]:
                    st.delete_key(k)  # by the last reader (two at once: both delete, harmlessly)

        with self._own_lock:
            values = self._own.call(run)
            self._own.call(done)
        return values

    def to_rank0(self, key: str, mine: str | None, senders: Collection[int], timeout_s: float) -> dict[int, str]:
        """Gather ``mine`` from each of ``senders`` on rank 0 (each sender calls it; other ranks
        need not). A sender publishes and returns ``{}`` at once; rank 0 waits ``timeout_s`` at
        most, returns what arrived by sender (a sender that did not publish in time is absent),
        and deletes the keys (a late one at the next call, or at ``close``). Store traffic: one
        key per sender, not one per rank."""
        with self._own_lock:
            if self.rank != 0:
                if mine is not None:
                    self._own.call(lambda st: st.set(f"{key}/{self.rank}", mine.encode()))
                return {}
            self._delete_late()
            keys = {k: f"{key}/{k}" for k in senders if k != 0}
            got = {0: mine} if mine is not None and 0 in senders else {}
            if keys:
                got.update(self._own.call(lambda st: _gather(st, keys, timeout_s)))
                self._late += [name for k, name in keys.items() if k not in got]
            return got

    def _delete_late(self) -> None:
        if self._late:
            late, self._late = self._late, []
            self._own.call(lambda st: [st.delete_key(k) for k in late])


def _gather(st: "dist.Store", keys: dict[int, str], timeout_s: float) -> dict[int, str]:
    try:
        st.wait(list(keys.values()), timedelta(seconds=max(timeout_s, 0.001)))
    except dist.DistStoreError:
        pass  # the deadline: take what is there
    got = {}
    for k, name in keys.items():
        if st.check([name]):
            got[k] = st.get(name).decode()
            st.delete_key(name)
    return got
