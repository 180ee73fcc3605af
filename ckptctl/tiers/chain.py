"""The tiers of one ``Checkpointer`` wired together: what happens after each save commits on
the first tier, and what ``close`` waits for.

After a commit on tier k (a save for k = 0, a promotion otherwise), in this order: the time to
durable is recorded, the promoter to tier k+1 is offered the checkpoint (it chooses by its
cadence and pins what it chose), and only then is tier k's retention asked to prune, so a
prune never plans without the pin of the checkpoint that just committed.

A tier's retention also runs again whenever its promoter releases a pin (a promotion from it
completed: what was kept for it may go now) and after a save that failed: a first tier that
filled up while promotion lagged frees itself as soon as promotion catches up, instead of
failing every later save. Once ``close`` began, a promoter finishing late (left on its daemon
thread) touches nothing.

Here only rank 0 promotes (whole checkpoints: the first tier must then be a filesystem every
rank writes to, as a single root is); a node-local first tier (``Tier(..., node_local=True)``)
is wired by ``tiers.node_chain`` instead, whose promotion is a round of every rank.

May import: ``ops``, ``storage``, ``tiers.spec``, ``tiers.promoter``, ``tiers.guarded``,
``tiers.durability``, ``tiers.recovery``, leaves.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Iterator

from ckptctl.errors import CkptError
from ckptctl.ops.transfer.copy import CopyResult, copy_checkpoint
from ckptctl.storage.base import Storage
from ckptctl.tiers.durability import Durability, Flushed
from ckptctl.tiers.guarded import GuardedRetention
from ckptctl.tiers.health import Health
from ckptctl.tiers.promoter import CopyFn, Promoter
from ckptctl.tiers.recovery import committed_across
from ckptctl.tiers.spec import Tier, check_tiers

log = logging.getLogger("ckptctl")


def _name_of(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


class Tiers:
    """``tiers[0]`` receives every save; each later tier receives from the one before it."""

    def __init__(self, tiers: list[Tier]) -> None:
        self.specs = check_tiers(tiers)
        self.roots: list[Storage] = [t.open() for t in self.specs]
        self.durability = Durability()
        # Retention of each tier (bad rules raise here, on every rank, before any thread).
        self.retentions: list[GuardedRetention | None] = [
            GuardedRetention(root, t.retention) if t.retention is not None else None
            for root, t in zip(self.roots, self.specs)]
        self.promoters: list[Promoter] = []
        self.health = Health()  # this rank's tier threads in trouble (``Checkpointer.health``)
        self._newest: tuple[int, str] | None = None  # newest (step, name) committed on the first tier in this run
        self._newest_on: dict[int, tuple[int, str]] = {}  # tier -> newest (step, name) committed there in this run
        self._flushing = False
        self._closing = False

    def begin(self, rank: int, world_size: int, group_name: str | None, timeout_s: float, liveness_s: float) -> None:
        """Called on every rank once the saver exists (``tiers.node_chain`` overrides it)."""
        if rank == 0:
            self.start()

    def revive(self) -> None:
        """At each ``save()``: start again any tier thread of this rank that ended without being
        told to (``tiers.node_chain``'s; here the promoters survive every error)."""

    def start(self, first_copy: CopyFn = copy_checkpoint) -> None:
        """Start promoting (rank 0 only: it alone learns of each commit). ``first_copy``
        promotes from the first tier (a node-local one's is a round of every rank)."""
        for k in range(len(self.specs) - 1):
            nxt = self.specs[k + 1]
            p = Promoter(self.roots[k], self.roots[k + 1], every=nxt.every, retry_max_s=nxt.retry_max_s,
                         lag_warning_s=nxt.lag_warning_s, on_promoted=self._promoted_callback(k + 1),
                         copy=first_copy if k == 0 else copy_checkpoint)
            self.promoters.append(p)
            guard = self.retentions[k]
            if guard is not None:
                guard.pins, guard.to = p.pins, self.roots[k + 1].url

    @property
    def first_retention(self) -> GuardedRetention | None:
        return self.retentions[0]

    # --- after each commit ----------------------------------------------------------------------

    def after_save(self, step: int, save: "Future[str | None]") -> None:
        """The saver's ``on_save`` (rank 0): chain promotion and retention to the commit."""
        gate: Future[str | None] = Future()

        def committed(f: "Future[str | None]") -> None:
            error = f.exception()
            url = f.result() if error is None else None
            if url is not None:
                try:
                    self._newest = (step, _name_of(url))
                    self._reached(0, step, _name_of(url))
                except Exception as e:  # a bug here must not keep retention from running
                    log.error("tiers: after the commit of step %d", step, exc_info=e)
            if error is not None:  # retention runs after the pin, whatever happened above
                gate.set_exception(error)
                self._prune_again(0)  # a full disk may have failed it: what is no longer pinned goes
            else:
                gate.set_result(url)

        save.add_done_callback(committed)
        guard = self.retentions[0]
        if guard is not None:
            guard.after(step, gate)

    def _prune_again(self, k: int) -> None:
        """Tier k's retention, again, anchored on its newest checkpoint of this run: a pin was
        released, or a save failed."""
        guard, newest = self.retentions[k], self._newest_on.get(k)
        if guard is None or newest is None or self._closing:
            return
        done: Future[str | None] = Future()
        done.set_result(self.roots[k].sub(newest[1]).url)
        try:
            guard.after(newest[0], done)
        except RuntimeError:  # its pool was shut down by a close that began meanwhile
            log.info("retention of %s not run again: closing", self.roots[k].url)

    def _promoted_callback(self, k: int):
        def promoted(step: int, name: str, result: CopyResult) -> None:
            if self._closing:  # a promotion that finished after close: nothing to run it on
                return
            self._reached(k, step, name)
            self._prune_again(k)
            self._prune_again(k - 1)  # the promoter's pin on it was released

        return promoted

    def _reached(self, k: int, step: int, name: str) -> None:
        self._newest_on[k] = (step, name)
        seconds = self.durability.reached(step, self.roots[k].url)
        if seconds is not None:
            log.info("step %d durable on %s %.2f s after its save", step, self.roots[k].url, seconds)
        if k < len(self.promoters):
            final = self._flushing and self._newest is not None and step == self._newest[0]
            self.promoters[k].offer(step, name, force=final)

    # --- closing --------------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> Flushed:
        """Wait up to ``timeout_s`` for the newest checkpoint committed on the first tier in this
        run to reach the last tier (promoted whatever the cadence says)."""
        t0 = time.monotonic()
        if self._newest is None or not self.promoters:
            step = self._newest[0] if self._newest is not None else None
            return Flushed(True, step, (self.roots[0].url,) if step is not None else ())
        step, name = self._newest
        self._flushing = True
        deadline = t0 + timeout_s
        reached = [self.roots[0].url]
        for k, p in enumerate(self.promoters):
            p.offer(step, name, force=True)  # the tier before holds it now: due whatever the cadence
            why = p.wait_for(step, deadline)
            if why is not None:
                return Flushed(False, step, tuple(reached), self.roots[k + 1].url, why, time.monotonic() - t0,
                               self.durability.of(step))
            reached.append(self.roots[k + 1].url)
        return Flushed(True, step, tuple(reached), None, "", time.monotonic() - t0, self.durability.of(step))

    # --- resuming ------------------------------------------------------------------------------

    def gather(self) -> None:
        """Called on every rank before rank 0 lists the candidates (a node-local first tier
        gathers what the other nodes hold here); nothing when every rank shares the tiers."""

    def candidates(self) -> Iterator[tuple[int, str]]:
        """``(tier, name)`` to try, newest step first, nearest tier first."""
        return committed_across(self.roots)

    def checkpoint(self, tier: int, name: str) -> Storage:
        """Where this rank reads candidate ``name`` of ``tier``."""
        return self.roots[tier].sub(name)

    def avoid(self, view: Storage, error: CkptError) -> bool:
        """This rank's load of ``view`` failed with ``error``: whether another attempt at the
        same candidate could read other copies (``tiers.node_resume``'s can; here each tier's
        copy is a candidate of its own already)."""
        return False

    def loaded(self, view: Storage) -> None:
        """This rank loaded ``view`` (what ``checkpoint`` returned): say where its files came
        from when that is not obvious (``tiers.node_resume``); here one tier served them all."""

    def release(self, timeout_s: float) -> None:
        """On ranks other than 0, at close: nothing to wait for here (see ``tiers.node_chain``)."""

    def close(self, join_s: float = 5.0) -> None:
        """Stop the promoters (a copy still running is left to its daemon thread after
        ``join_s``: an unreachable tier must not hang the job's exit), then wait for each
        tier's prune in progress."""
        for p in self.promoters:
            p.close(join_s)
        self._closing = True
        for guard in self.retentions:
            if guard is not None:
                guard.close()
