"""Sealing each checkpoint a stack has just written, on a background thread, then applying a
ckptctl retention policy to its root: what the Trainer callback and the accelerate hook share.

The Trainer and ``Accelerator.save_state`` write their files themselves and hand no bytes
over; ``integrations.savehooks`` hashes each file they write through ``torch.save`` and
safetensors' ``save_file`` from the page cache as soon as it is closed, during the save. Here,
after the save: every file and directory of the checkpoint is fsynced (the stacks fsync
nothing, and a seal vouches for bytes on disk), each file's entry is the one hashed during the
save if the file is still exactly the file hashed, else the file is read once now (JSON files,
other processes' RNG files), and the seal ``ckptctl seal`` writes is created
(``ops.seal.sealing.seal_just_written``: the checkpoint must be complete by its stack's rule
and unchanged while sealed). ``sources`` says which files were hashed during the save and
which after it. The retention policy (``KeepBest(2, "eval_loss") | KeepLast(2)``) is applied
by ``ckptctl prune`` itself (``ops.retention.prune``): the newest checkpoint is fully
verified, test-loaded, before anything older is deleted, pointer targets and the Trainer's
best checkpoint are kept, and a checkpoint still being written is never touched.

One thread does both in save order, so training never waits for either; a failure is logged on
the "ckptctl" logger and never stops training (an unsealed checkpoint is still the stack's
complete checkpoint, and ``ckptctl seal`` can seal it later). ``wait`` lets the end of
training wait for the last one.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptctl.errors import CkptError
from ckptctl.format.seal import SealedFile
from ckptctl.integrations.savehooks import Recorded
from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.ops.retention.prune import prune
from ckptctl.ops.seal.sealing import SealResult, seal_just_written
from ckptctl.storage import open_storage

log = logging.getLogger("ckptctl")


@dataclass
class Sources:
    """When the files of one sealed checkpoint were hashed (names relative to it)."""

    during_save: list[str] = field(default_factory=list)  # as each was closed, while the save went on
    after_save: list[str] = field(default_factory=list)  # by the sealer: no hook saw them written, or they changed


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path``, then ``path``'s own entry in its parent:
    the checkpoint is durable before its seal is written. Raises OSError."""
    for top, _dirs, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(top, name))
        _fsync(top)
    _fsync(os.path.dirname(os.path.abspath(path)))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.sources: dict[str, Sources] = {}  # by checkpoint path: when each file was hashed

    def submit(self, path: str, root: str, written: Recorded | None = None) -> "Future[SealResult | None]":
        """Seal the checkpoint at ``path`` (under ``root``), then apply the retention policy.
        ``written``: the files hashed during the save (the sealer reads the others)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-seal")
            self._last = self._pool.submit(self._run, path, root, written)
            return self._last

    def _run(self, path: str, root: str, written: Recorded | None) -> SealResult | None:
        result = None
        sources = Sources()

        def entry(key: str, chunk_size: int) -> SealedFile | None:
            got = written.entry(os.path.join(path, key), chunk_size) if written is not None else None
            (sources.during_save if got is not None else sources.after_save).append(key)
            return got

        try:
            fsync_tree(path)
            result = seal_just_written(path, written=entry)
            self.results.append(result)
            self.sources[path] = sources
            log.info("ckptctl: sealed %s: %d files hashed during the save (%s), %d after it (%s)", path,
                     len(sources.during_save), ", ".join(sources.during_save), len(sources.after_save),
                     ", ".join(sources.after_save))
        except OSError as e:
            log.warning("ckptctl: %s not sealed: %s (hint: check the disk, then run `ckptctl seal` on it)", path, e)
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
