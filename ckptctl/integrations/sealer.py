"""Sealing each checkpoint a stack has just written, on a background thread, then applying a
ckptctl retention policy to its root: what the Trainer callback and the accelerate hook share.

The Trainer and ``Accelerator.save_state`` write their files themselves and hand no bytes
over, so each file is read back once, right after the save (from the page cache), hashed and
recorded in the seal ``ckptctl seal`` writes (``ops.seal.sealing.seal_just_written``: the
checkpoint must be complete by its stack's rule and unchanged while hashed). The retention
policy (``KeepBest(2, "eval_loss") | KeepLast(2)``) is applied by ``ckptctl prune`` itself
(``ops.retention.prune``): the newest checkpoint is fully verified, test-loaded, before
anything older is deleted, pointer targets and the Trainer's best checkpoint are kept, and a
checkpoint still being written is never touched.

One thread does both in save order, so training never waits for either; a failure is logged on
the "ckptctl" logger and never stops training (an unsealed checkpoint is still the stack's
complete checkpoint, and ``ckptctl seal`` can seal it later). ``wait`` lets the end of
training wait for the last one.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ckptctl.errors import CkptError
from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.ops.retention.prune import prune
from ckptctl.ops.seal.sealing import SealResult, seal_just_written
from ckptctl.storage import open_storage

log = logging.getLogger("ckptctl")


class BackgroundSealer:
    """Seals checkpoints one after another on a thread of its own; see the module docstring.
    ``retention``: the rules applied to the root after each seal (None: none, the stack's
    own rotation, if any, goes on as before)."""

    def __init__(self, retention: Policy | RetentionPolicy | None = None) -> None:
        self.policy = None if retention is None else RetentionPolicy.of(retention)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._last: Future[SealResult | None] | None = None
        self.results: list[SealResult] = []

    def submit(self, path: str, root: str) -> "Future[SealResult | None]":
        """Seal the checkpoint at ``path`` (under ``root``), then apply the retention policy."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-seal")
            self._last = self._pool.submit(self._run, path, root)
            return self._last

    def _run(self, path: str, root: str) -> SealResult | None:
        result = None
        try:
            result = seal_just_written(path)
            self.results.append(result)
        except CkptError as e:
            log.warning("ckptctl: %s not sealed: %s (hint: %s)", path, e, e.hint or "run `ckptctl seal` on it later")
        if self.policy is not None:
            try:
                _plan, outcome = prune(open_storage(root), self.policy, command="integration retention")
                if outcome is not None and outcome.deleted:
                    log.info("ckptctl: retention deleted %s", ", ".join(o.name for o in outcome.deleted))
            except CkptError as e:
                log.warning("ckptctl: retention under %s did not run: %s (hint: %s)", root, e, e.hint or "")
        return result

    def wait(self) -> None:
        """Wait until every checkpoint submitted so far is sealed (and pruned after)."""
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        self.wait()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
