"""One numbered stream of the tiers channel: rank 0's messages, every receiver's replies, and
how long each store key lives.

Rank 0 (``Outbox``) publishes message n of stream ``s`` (``promote``, ``node``, ``replica``);
each receiver's thread (``StreamWorker``) takes the messages in order, acts, and replies. The
keys, under the channel's prefix:

* ``s/<n>``: message n (JSON). Kept until every receiver has replied to it, so a slow
  receiver (a rank still busy with the previous round) reads it whenever it gets there;
  then deleted by rank 0 (at its next send, or when it collects the replies).
* ``s/<n>/r<k>``: receiver k's reply (text). Deleted by rank 0 as soon as it read it.
* ``s/floor``: the lowest message number rank 0 still keeps. A receiver reads it before each
  message and skips what is below it.
* A message given up before every receiver took it is not deleted at once but replaced by a
  tombstone (``GIVEN_UP``), deleted with the late replies: a receiver that read the floor just
  before rank 0 raised it and then waits for that message wakes on the tombstone and reads the
  floor again. Deleted at once, the message left such a receiver waiting ``WAIT_S`` for
  something that never came, and every round meanwhile waited out its deadline for its reply.

So the store holds, per stream, the messages some receiver has not finished, and no reply
for long. What bounds them when a receiver never finishes (its process died, its thread is
stuck): rank 0 keeps at most ``keep`` messages open; beyond that it deletes the oldest with
its pending replies, raises the floor, and names the receivers that fell behind (WARNING).
A stream whose messages are useless once a newer one is sent (``latest_only``: rank 0's
promotion rounds, each concluded before the next) keeps only the newest; a receiver still
busy with an older one skips to it. A reply rank 0's watch wrote for a dead rank
(``tiers.liveness``) ends rank 0's wait but is not that rank's: the message stays for it.
Replies that land after their message was given up are deleted at the next sends (a
receiver also replies only at or above the floor). At ``close``, rank 0 sends ``stop``, waits
a bounded time for every receiver to take it, and deletes the rest (a receiver that has not
taken it is left ``stop``, a floor pointing at it, a tombstone for each message it had not
finished, so that a wait for one of them ends at once, and its reply if it ever comes). A
stream's keys are thus bounded by ``keep`` messages and their replies, whatever happens, for
as long as the job runs.

Every store request goes through a ``tiers.link.Link``: a network error is retried on a new
connection, and a receiver's thread survives everything else its work raises; a thread that
ends anyway (a bug) is recorded in ``tiers.health`` and restarted from the message it was at
(``StreamWorker.revive``). Once close began, a link that gives up on a store that is gone
(``tiers.link.StoreGone``) ends the receiver's thread as ``stop`` would, and makes rank 0's
``send``, ``replies`` and ``finish`` raise it.

May import: ``tiers.link``, ``tiers.health``, leaves (and torch.distributed).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptctl.tiers.health import Health
from ckptctl.tiers.link import Link, StoreGone, peek

log = logging.getLogger("ckptctl")

# A receiver waits for rank 0's next message this long per store request, then looks at the
# floor and waits again: messages may be hours apart, c10d logs every wait that times out
# (two lines), and a connection that a middlebox dropped silently is noticed only when a wait
# ends.
WAIT_S = 3600.0
LATE_SENDS = 4  # replies (and tombstone) of a given-up message are deleted at this many later sends
GIVEN_UP = b'{"op": "given-up"}'  # what a given-up message's key holds until then


def _floor_of(st: "dist.Store", stream: str) -> int:
    return int(st.add(f"{stream}/floor", 0))  # one request; the key exists once read (0: none yet)


class Outbox:
    """Rank 0's side of ``stream``: ``receivers`` (ranks) reply to each message; at most
    ``keep`` messages stay open. ``collected``: rank 0 reads each message's replies
    (``replies``), so a sweep keeps what it finds for it; else replies are acks, deleted
    unread. Thread-safe; ``link`` serves ``send`` and the sweeps, and a thread that waits for
    replies passes its own."""

    def __init__(self, link: Link, stream: str, receivers: Collection[int], keep: int, *, collected: bool,
                 latest_only: bool = False) -> None:
        self.link, self.stream, self.receivers, self.keep = link, stream, frozenset(receivers), keep
        self.collected, self.latest_only = collected, latest_only
        self._lock = threading.Lock()
        self._sent = 0
        self._open: dict[int, set[int]] = {}  # message -> receivers that have not replied
        self._got: dict[int, dict[int, str]] = {}  # replies read by a sweep, until ``replies`` takes them
        self._collecting: set[int] = set()  # messages whose replies a thread waits for: not swept
        self._late: dict[int, tuple[set[int], int]] = {}  # given up -> (receivers, sends left)
        self._floor = 0

    def send(self, message: dict[str, Any]) -> int:
        """Publish the next message; returns its number. Sweeps what finished since."""
        with self._lock:
            self._sweep()
            self._sent += 1
            n = self._sent
            self.link.call(lambda st: st.set(f"{self.stream}/{n}", json.dumps(message).encode()))
            self._open[n] = set(self.receivers)
            if self.collected:
                self._got[n] = {}
            while len(self._open) > (1 if self.latest_only else self.keep):
                self._give_up(min(self._open), quiet=self.latest_only)
            return n

    def replies(self, link: Link, n: int, timeout_s: float) -> dict[int, str]:
        """Every receiver's reply to message ``n``, waiting ``timeout_s`` at most (one blocking
        wait: c10d logs each wait that times out); receivers that did not reply by then are
        absent, and the message stays for them. Each reply read is deleted."""
        with self._lock:
            self._collecting.add(n)
            got = dict(self._got.get(n, {}))
            pending = sorted(self._open.get(n, ()))
        keys = {k: f"{self.stream}/{n}/r{k}" for k in pending}

        def read(st: "dist.Store") -> dict[int, str]:
            if keys:
                try:
                    st.wait(list(keys.values()), timedelta(seconds=max(timeout_s, 0.001)))
                except dist.DistStoreError:
                    pass  # the deadline: take the replies that are there
            found = {k: st.get(key).decode() for k, key in keys.items() if st.check([key])}
            for k in found:
                st.delete_key(keys[k])
            return found

        try:
            got.update(link.call(read))
        finally:
            with self._lock:
                self._collecting.discard(n)
        with self._lock:
            self._got.pop(n, None)  # later replies are swept without being read
            left = self._open.get(n)
            if left is not None:  # an answer for a dead rank (``tiers.liveness``) leaves it the message
                left.difference_update(k for k, v in got.items() if not v.startswith("dead:"))
                if not left:
                    del self._open[n]
                    link.call(lambda st: st.delete_key(f"{self.stream}/{n}"))
        return got

    def stop(self) -> int:
        """Send ``stop`` (every receiver's thread ends when it takes it); returns its number."""
        n = self.send({"op": "stop"})
        with self._lock:
            self._got.pop(n, None)  # its replies are acks
        return n

    def finish(self, n: int, timeout_s: float) -> None:
        """After ``stop`` (message ``n``): wait up to ``timeout_s`` for every receiver to take it,
        then delete every other key of the stream. A receiver that had not taken ``stop`` by
        then (dead, or still busy) is left the ``stop`` message, a floor that skips to it, a
        tombstone for each message it had not finished (at most ``keep``), and replies to
        ``stop`` if it ever gets there: the only keys a closed stream may leave."""
        self.replies(self.link, n, timeout_s)
        with self._lock:
            left = self._open.pop(n, set())
            if left:
                log.info("tiers: rank%s %s did not take the %s stream's stop within %.0f s",
                         "s" if len(left) > 1 else "", ", ".join(map(str, sorted(left))), self.stream, timeout_s)
                self.link.call(lambda st: st.set(f"{self.stream}/floor", str(n)))
            # A message one of them has not finished may be what it waits for now, the floor read
            # before it was raised: a tombstone wakes it to read the floor again and take stop.
            # Deleted, it left that receiver waiting WAIT_S on a daemon thread.
            pending = {m: set(k) for m, k in self._open.items()}
            pending.update({m: set(late) for m, (late, _) in self._late.items()})
            for m, ranks in sorted(pending.items()):
                if ranks & left:
                    self.link.call(lambda st, m=m: st.set(f"{self.stream}/{m}", GIVEN_UP))
                    self._delete_replies(m, ranks)
                else:
                    self._delete(m, ranks)
            self._open.clear()
            self._late.clear()
            if not left:
                self.link.call(lambda st: st.delete_key(f"{self.stream}/floor"))
        self.link.give_back()

    # --- under the lock ----------------------------------------------------------------------

    def _sweep(self) -> None:
        """Read and delete the replies that came since; delete every message all have replied to."""
        if not self._open and not self._late:
            return

        def sweep(st: "dist.Store") -> None:
            for n, left in list(self._open.items()):
                if n in self._collecting:
                    continue
                for k in sorted(left):
                    key = f"{self.stream}/{n}/r{k}"
                    if st.check([key]):
                        if n in self._got:
                            self._got[n][k] = st.get(key).decode()
                        st.delete_key(key)
                        left.discard(k)
                if not left and n not in self._got:  # a collector still to come keeps it open
                    del self._open[n]
                    st.delete_key(f"{self.stream}/{n}")
            for n, (left, sends) in list(self._late.items()):
                for k in sorted(left):
                    if st.delete_key(f"{self.stream}/{n}/r{k}"):
                        left.discard(k)
                if not left or sends <= 1:  # every receiver it was left for replied, or gave up on it
                    del self._late[n]
                    st.delete_key(f"{self.stream}/{n}")
                else:
                    self._late[n] = (left, sends - 1)

        self.link.call(sweep)

    def _give_up(self, n: int, *, quiet: bool = False) -> None:
        """Delete message ``n`` before every receiver replied; ``quiet``: by design (a newer
        message makes it useless), else logged as a receiver fallen behind."""
        left = self._open.pop(n)
        self._got.pop(n, None)
        if left and not quiet:
            log.warning("tiers: rank%s %s did not take message %d of the %s stream before %d newer ones; it is "
                        "deleted, and %s skip%s to the newest", "s" if len(left) > 1 else "",
                        ", ".join(map(str, sorted(left))), n, self.stream, self.keep,
                        "they" if len(left) > 1 else "it", "" if len(left) > 1 else "s")
        self._floor = n + 1
        self.link.call(lambda st: st.set(f"{self.stream}/floor", str(self._floor)))
        if left:  # one of them may be about to wait for it, having read the floor before we raised it
            self.link.call(lambda st: st.set(f"{self.stream}/{n}", GIVEN_UP))
            self._delete_replies(n, left)
        else:
            self._delete(n, left)
        self._late[n] = (set(left), LATE_SENDS)

    def _delete(self, n: int, left: Collection[int]) -> None:
        self.link.call(lambda st: st.delete_key(f"{self.stream}/{n}"))
        self._delete_replies(n, left)

    def _delete_replies(self, n: int, ranks: Collection[int]) -> None:
        def delete(st: "dist.Store") -> None:
            for k in ranks:
                st.delete_key(f"{self.stream}/{n}/r{k}")

        self.link.call(delete)


class StreamWorker:
    """A receiver's thread: takes ``stream``'s messages in order, ``handle``s each and replies
    with what it returns; ends at ``stop`` (or any op it does not serve). Subclasses define
    ``handle`` (which must turn every failure of the work into a reply) and may define
    ``after`` (run once the reply is sent)."""

    ops: frozenset[str] = frozenset()

    def __init__(self, link: Link, stream: str, rank: int, health: Health | None) -> None:
        self.link, self.stream, self.rank, self.health = link, stream, rank, health
        self.rounds = 0  # the number of the last message handled
        self._next = 1
        self._stopped = False
        self._died_at: int | None = None  # the message the thread last ended at, unexpectedly
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"ckptctl-{self.stream}-{self.rank}", daemon=True)
        self._thread.start()

    def handle(self, n: int, msg: dict[str, Any]) -> str:
        raise NotImplementedError

    def after(self, n: int, msg: dict[str, Any]) -> None:
        """Runs after the reply to message ``n``."""

    def stopped(self) -> None:
        """Runs once the thread took ``stop``, before it ends."""

    def _run(self) -> None:
        try:
            while True:
                n, msg = self._take()
                if msg.get("op") not in self.ops:  # stop
                    self._reply(n, "stopped")
                    self._stopped = True
                    self.link.give_back()  # idle for good
                    self.stopped()
                    return
                self._reply(n, self.handle(n, msg))
                self.rounds, self._next = n, n + 1
                self.after(n, msg)
        except StoreGone:  # closing, and the store is gone: no message can come any more (logged by the link)
            self._stopped = True
        except Exception as e:  # a bug: recorded, and the thread is started again by ``revive``
            log.error("tiers: the %s ended unexpectedly at message %d", self.link.worker, self._next, exc_info=e)
            n = self._next
            if self._died_at == n:  # twice at the same message: the next start skips it
                self._next = n + 1
            self._died_at = n
            if self.health is not None:
                self.health.died(self.link.worker, self.link.tier, f"{type(e).__name__}: {e}")

    def _take(self) -> tuple[int, dict[str, Any]]:
        """The next message at or above the floor, waiting for it as long as the job runs."""
        while True:
            floor = self.link.call(lambda st: _floor_of(st, self.stream))
            if floor > self._next:
                log.warning("tiers: the %s fell behind: messages %d to %d of the %s stream were given up; "
                            "it goes on from %d", self.link.worker, self._next, floor - 1, self.stream, floor)
                self._next = floor
            key = f"{self.stream}/{self._next}"

            def get(st: "dist.Store") -> bytes | None:
                st.wait([key], timedelta(seconds=WAIT_S))
                return peek(st, key)  # None or GIVEN_UP: given up by rank 0, look at the floor again

            try:
                raw = self.link.call(get)
            except dist.DistStoreError:
                continue  # no message for WAIT_S: look at the floor again, and wait on
            if raw is not None and raw != GIVEN_UP:
                return self._next, json.loads(raw)

    def _reply(self, n: int, text: str) -> None:
        def put(st: "dist.Store") -> None:
            if _floor_of(st, self.stream) <= n:  # a message given up takes no reply: it would stay
                st.set(f"{self.stream}/{n}/r{self.rank}", text.encode())

        self.link.call(put)

    def revive(self) -> bool:
        """Start the thread again when it ended without ``stop``, from the message it was at;
        True when it did."""
        if self._stopped or self._thread is None or self._thread.is_alive():
            return False
        log.warning("tiers: restarting the %s at message %d", self.link.worker, self._next)
        self.start()
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait for rank 0's stop; True when the thread ended (else it is left on its daemon thread)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.alive
