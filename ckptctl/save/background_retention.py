"""The Checkpointer's own retention: after each commit, prune older checkpoints in the background.

The policy and its safety checks are ``ckptctl prune``'s (``ops.prune``): the new checkpoint is
fully verified before anything older is deleted. Only rank 0 prunes. A prune runs on a thread
of its own, so a slow one (it reads the new checkpoint back in full) never delays the next
write or, across ranks, rank 0's arrival at the save's barrier. Retention problems are logged
on the "ckptctl" logger and never fail a save.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ckptctl.errors import CkptError
from ckptctl.storage import Storage

log = logging.getLogger("ckptctl")


class BackgroundRetention:
    def __init__(self, root: Storage, keep_last: int | None, keep_every: int | None) -> None:
        """Raises ``UsageError`` for bad values, at once (on every rank, not in a thread)."""
        # Imported here, not at the top: retention lives in ops/, a layer above save/ (see
        # ARCHITECTURE.md), and only a Checkpointer that was asked to prune needs it.
        from ckptctl.ops.retention import from_options

        self.root = root
        self.policy = from_options(keep_last, keep_every, None, ())
        self._pool: ThreadPoolExecutor | None = None  # started by the first request
        self._lock = threading.Lock()
        self._next: tuple[int, "Future[str]"] | None = None  # the newest save to prune after
        self._queued = False

    def after(self, step: int, save: "Future[str]") -> None:
        """Prune once ``save`` has committed. Requests coalesce: at most one prune runs and one
        waits, and the waiting one prunes after the newest save requested so far."""
        with self._lock:
            self._next = (step, save)
            if self._queued:
                return
            self._queued = True
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-retention")
            pool = self._pool
        pool.submit(self._run).add_done_callback(_log_unexpected)

    def close(self) -> None:
        """Wait for the prune in progress (and the one waiting, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _run(self) -> None:
        with self._lock:
            self._queued = False
            assert self._next is not None
            step, save = self._next
        if save.exception() is not None:
            return  # nothing new was committed, so there is nothing new to rely on
        from ckptctl.ops.prune import prune  # ops/ sits above save/, as in __init__

        try:
            plan, outcome = prune(self.root, self.policy, command=f"Checkpointer retention after step {step}")
        except CkptError as e:  # lock held by a cron prune, nothing verifies, storage trouble
            log.warning("retention after step %d did not run: %s", step, e)
            return
        for item in plan.broken_left:
            log.warning("retention: %s is broken and was left in place: %s", item.url, item.reason)
        for note in plan.notes + (outcome.notes if outcome else []):
            log.info("retention: %s", note)
        if outcome is not None:
            for o in outcome.failed + outcome.skipped:
                log.warning("retention: %s %s: %s", o.result, o.name, o.detail)
            if outcome.deleted:
                log.info("retention after step %d deleted %s", step, ", ".join(o.name for o in outcome.deleted))


def _log_unexpected(future: "Future[None]") -> None:
    # Nobody waits on a retention task: an unexpected error (a bug) would vanish without this.
    exc = future.exception()
    if exc is not None:
        log.error("retention failed unexpectedly", exc_info=exc)
