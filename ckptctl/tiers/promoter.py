"""The background promoter of one hop: committed checkpoints of one tier copied to the next.

One thread per hop, never the training thread nor the writer thread, so a slow or unreachable
next tier never stalls training nor delays the next save. Each promotion is
``ops.transfer.copy.copy_checkpoint`` (from a node-local first tier, a round in which every rank
uploads its own shards: ``tiers.promotion_round``): every byte checked on the way, the marker
written last, so the next tier never holds a checkpoint that looks complete and is not.

Choosing: a checkpoint committed on the source tier is *chosen* when the destination's cadence
says it is due (``Tier.every``; always, without one). When the promoter falls behind, it takes
the newest chosen checkpoint and skips the older ones, logging each skip; during an outage it
switches to the newest one at every retry, so once the tier is back it catches up in one copy.
``pins()`` are the steps retention of the source tier must keep: the one being copied and the
newest waiting one.

Failures: an operational error (the next tier unreachable, throttled past botocore's retries)
is retried with exponential backoff up to ``retry_max_s``, with the newest chosen checkpoint
(or the same one, when the failed attempt got more of it to the destination than any before:
``Progressed``, and the copy does not send again what is there); a warning is logged once when the
destination lags the source by more than ``lag_warning_s`` (and an info line when it caught
up). A source that no longer verifies or is gone, or a destination step that holds another
checkpoint, gives that checkpoint up with an error logged; the next one is promoted as usual.

May import: ``ops.transfer.copy``, ``tiers.spec``, ``storage``, leaves.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ckptctl.errors import CheckpointError, CkptError, OperationalError, RefusedForSafety, StorageError
from ckptctl.ops.transfer.copy import CopyResult, copy_checkpoint
from ckptctl.storage.base import Storage
from ckptctl.tiers.spec import RETRY_FIRST_S, Cadence

log = logging.getLogger("ckptctl")

# Called on the promoter's thread once ``name`` (step) is committed on the destination.
OnPromoted = Callable[[int, str, CopyResult], None]
# Copies one committed checkpoint directory to another: ``copy_checkpoint``, or a node-local
# first tier's promotion round (``tiers.promotion_round``), which raises the same errors.
CopyFn = Callable[[Storage, Storage], CopyResult]


class Progressed(StorageError):
    """A copy that failed after it got more of the checkpoint to the destination than any
    earlier attempt: the retry takes the same checkpoint rather than a newer one, whose copy
    would start from nothing (a round's ranks that got their files there are done with them)."""


@dataclass(frozen=True)
class Offer:
    step: int
    name: str  # the checkpoint's directory under both tiers' roots
    committed_at: float  # time.monotonic() of its commit on the source tier


class Promoter:
    """Promotes ``src`` root's committed checkpoints to ``dst`` root, on a thread of its own."""

    def __init__(self, src: Storage, dst: Storage, *, every: Cadence | None, retry_max_s: float,
                 lag_warning_s: float, on_promoted: OnPromoted, copy: CopyFn = copy_checkpoint) -> None:
        self.src, self.dst = src, dst
        self._copy = copy
        self.every = every
        self.retry_max_s, self.lag_warning_s = retry_max_s, lag_warning_s
        self._on_promoted = on_promoted
        self._cond = threading.Condition()
        self._waiting: list[Offer] = []  # chosen, not started, oldest first
        self._current: Offer | None = None  # being copied (or retried)
        self._last_chosen: tuple[int, float] | None = None  # (step, time) for the cadence
        self.promoted: int | None = None  # newest step committed on dst by this promoter
        self.given_up: dict[int, str] = {}  # step -> why it will not be promoted
        self._behind_since: float | None = None  # commit time of the oldest unpromoted chosen one
        self._warned = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"ckptctl-promote-{dst.url}", daemon=True)
        self._thread.start()

    # --- called from other threads ------------------------------------------------------------

    def offer(self, step: int, name: str, *, force: bool = False) -> bool:
        """``name`` (``step``) is committed on the source tier now. Returns whether it was
        chosen (due by the cadence, or ``force``: the final checkpoint at ``close``)."""
        now = time.monotonic()
        with self._cond:
            if self.promoted is not None and step <= self.promoted:
                return False  # already there, or older than what is there
            if any(o.step == step for o in self._waiting) or (self._current is not None and self._current.step == step):
                return True
            last_step, last_time = self._last_chosen or (None, None)
            if not force and self.every is not None and not self.every.due(step, now, last_step, last_time):
                return False
            self._last_chosen = (step, now)
            self._waiting.append(Offer(step, name, now))
            if self._behind_since is None:
                self._behind_since = now
            self._cond.notify_all()
            return True

    def pins(self) -> frozenset[int]:
        """Steps the source tier's retention must keep: being copied, and next to be."""
        with self._cond:
            held = {o.step for o in (self._current, *self._waiting[-1:]) if o is not None}
        return frozenset(held)

    def wait_for(self, step: int, deadline: float) -> str | None:
        """Wait until ``step`` (or a newer one) is promoted; None then, else why not: given
        up, or still not there at ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            while self.promoted is None or self.promoted < step:
                if step in self.given_up:
                    return self.given_up[step]
                left = deadline - time.monotonic()
                if left <= 0:
                    what = "still being copied" if self._current is not None and self._current.step == step else "not copied"
                    return f"{what} to {self.dst.url} when the wait ended"
                self._cond.wait(left)
            return None

    def close(self, timeout: float | None = None) -> None:
        """Stop after the copy in progress (an unfinished copy leaves no marker at dst)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- the promoter's thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._current = self._take_newest()
            try:
                self._promote(self._current)
            except Exception as e:  # a bug must not end promotion for the rest of the run
                log.error("promotion of step %d to %s failed unexpectedly", self._current.step, self.dst.url, exc_info=e)
                self._give_up(self._current, f"unexpected {type(e).__name__}: {e}")
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _take_newest(self) -> Offer:
        newest, skipped = self._waiting[-1], self._waiting[:-1]
        self._waiting = []
        if skipped:
            log.warning("promotion to %s is behind: promoting step %d, skipping step%s %s", self.dst.url, newest.step,
                        "s" if len(skipped) > 1 else "", ", ".join(str(o.step) for o in skipped))
        return newest

    def _promote(self, offer: Offer) -> None:
        delay = RETRY_FIRST_S
        while True:
            try:
                result = self._copy(self.src.sub(offer.name), self.dst.sub(offer.name))
            except OperationalError as e:  # unreachable, throttled, lock trouble: retry later
                self._check_lag(e)
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                    if self._stopping:
                        return
                    if self._waiting and not isinstance(e, Progressed):  # a newer one was chosen meanwhile
                        newer = self._take_newest()
                        log.info("promotion to %s: step %d was never copied; trying newer step %d",
                                 self.dst.url, offer.step, newer.step)
                        offer = self._current = newer
                delay = min(2 * delay, self.retry_max_s)
                continue
            except (CheckpointError, RefusedForSafety) as e:  # no retry makes this one promotable
                self._give_up(offer, str(e))
                return
            except CkptError as e:
                self._give_up(offer, f"{type(e).__name__}: {e}")
                return
            break
        with self._cond:
            self.promoted = offer.step
            oldest = min((o.committed_at for o in self._waiting), default=None)
            self._behind_since = oldest
            if self._warned:
                log.warning("promotion to %s caught up: step %d is there", self.dst.url, offer.step)
                self._warned = False
            self._cond.notify_all()
        log.info("promoted step %d to %s (%s, %d bytes, %.2f s)", offer.step, self.dst.url, result.status,
                 result.bytes_copied, result.seconds)
        self._on_promoted(offer.step, offer.name, result)

    def _check_lag(self, error: Exception) -> None:
        with self._cond:
            behind = self._behind_since
            if behind is None or self._warned:
                return
            lag = time.monotonic() - behind
            if lag <= self.lag_warning_s:
                return
            self._warned = True
        log.warning("%s lags by %.0f s (more than %.0f s): promotion keeps failing and is retried: %s",
                    self.dst.url, lag, self.lag_warning_s, error)

    def _give_up(self, offer: Offer, why: str) -> None:
        log.error("not promoting step %d to %s: %s", offer.step, self.dst.url, why)
        with self._cond:
            self.given_up[offer.step] = why
            self._behind_since = min((o.committed_at for o in self._waiting), default=None)
            self._cond.notify_all()
