"""Library retention: after each commit, prune older checkpoints in the background.

``ckptctl.Checkpointer(retention=KeepLast(3) | KeepBest(2, "val_loss"))`` (or its shorthand
``keep_last=``) builds one and hands its ``after`` to the save path as
a callable, so the save path never imports the verbs.

The policy and its safety checks are ``ckptctl prune``'s (``ops.retention.prune``): the new checkpoint is
fully verified before anything older is deleted. Only rank 0 prunes. A prune runs on a thread
of its own, so a slow one never delays the next write or, across ranks, rank 0's arrival at
the save's barrier. Retention problems are logged on the "ckptctl" logger and never fail a
save. A prune is owed from the moment a save commits until one runs: deferred to a newer save
(see ``_run``), or not run at all (the lock held by a cron prune), it is run after the next
save even when that save fails, so a full disk that made the save fail is freed for the next.

The full verification costs no download by rank 0: after each commit, every rank re-reads the
shard it just wrote (``check_shard``, on its writer thread: header bound to the file checksum
the manifest records, every chunk hashed and decoded, safetensors accepting it on POSIX), the
ranks agree on the verdicts (one ``all_reduce`` of one integer), and rank 0 records a ``load``
level success in the verification record (``ops.verify.cache``) with the checkpoint's
fingerprint taken before the re-reads, so the prune's anchor check finds it there and reads no
data. Each rank reads its own shard once more per save, in parallel: the cost per rank does not
grow with the number of ranks. What this check does not repeat, because the save proved it
when it planned: that the chunks tile every tensor (the coordinator's coverage round).
A checkpoint some rank could not check is not recorded; the prune then verifies it itself.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ckptctl.errors import CheckpointError, CkptError
from ckptctl.format.manifest import FileEntry
from ckptctl.format.shard_identity import header_matches
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS
from ckptctl.layouts.checked import Checked
from ckptctl.layouts.native_read import read_committed, read_header
from ckptctl.layouts.shard_scan import stream_file
from ckptctl.ops.retention.prune import prune
from ckptctl.ops.retention.policies import KeepEvery, KeepLast, Policy, RetentionPolicy
from ckptctl.ops.verify.cache import Fingerprint, VerifyCache, fingerprint
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")

SAVED = CHECKPOINTER_LAYOUTS[0]  # the layout the Checkpointer saves: what this retention prunes


class BackgroundRetention:
    def __init__(self, root: Storage, keep_last: int | None = None, keep_every: int | None = None, *,
                 retention: Policy | RetentionPolicy | None = None) -> None:
        """``retention``: the rules (``KeepLast(3) | KeepEvery(1000)``); ``keep_last`` and
        ``keep_every`` are shorthand for ``KeepLast``/``KeepEvery`` and cannot be given with it.
        Raises ``ValueError`` for bad values, at once (on every rank, not in a thread)."""
        self.root = root
        self.policy = retention_policy(retention, keep_last, keep_every)
        self._pool: ThreadPoolExecutor | None = None  # started by the first request
        self._lock = threading.Lock()
        self._requests: list[tuple[int, "Future[str | None]"]] = []  # saves not yet looked at by a run
        self._queued = False
        self._owed: int | None = None  # the newest committed save whose prune has not run yet
        self._verified: dict[str, tuple[Fingerprint, str]] = {}  # checked by its ranks, not yet recorded

    # --- the check of each commit by the ranks that wrote it (``save.after_commit.AfterCommit``) ---

    def snapshot(self, ckpt: Storage) -> Fingerprint | None:
        """Rank 0, before the ranks re-read their shards: the checkpoint's fingerprint."""
        return fingerprint(ckpt, SAVED)

    def check_shard(self, ckpt: Storage, entry: FileEntry) -> str | None:
        """Every rank: re-read the shard this rank wrote, as ``verify --level load`` reads each
        file; the first problem found as a line of text, or None."""
        return check_own_shard(ckpt, entry)

    def record(self, step: int, ckpt: Storage, before: Fingerprint | None) -> None:
        """Rank 0, once every rank's shard checked out: remember the verification, vouched for
        by a fingerprint unchanged since before the re-reads; the retention thread writes it
        to the verification record before it prunes."""
        if before is None or fingerprint(ckpt, SAVED) != before:
            return
        name = ckpt.url.rstrip("/").rsplit("/", 1)[-1]
        with self._lock:
            self._verified[name] = (before, ckpt.url)

    def _record_verified(self) -> None:
        with self._lock:
            pending, self._verified = self._verified, {}
        if not pending:
            return
        cache = VerifyCache.load(self.root)
        for name, (fp, url) in pending.items():
            try:
                manifest, _ = read_committed(self.root.sub(name))  # O(ranks + tensors), no data
            except CheckpointError as e:
                log.warning("retention: %s no longer reads as committed: %s", url, e)
                continue
            cache.record(name, fp, Checked("load", step=manifest.step, files=len(manifest.files),
                                           tensors=len(manifest.tensors),
                                           notes=["each rank re-read the shard it wrote, after the commit"]))
        cache.save()

    def after(self, step: int, save: "Future[str | None]") -> None:
        """Prune once ``save`` has committed. Requests coalesce: at most one prune runs and one
        waits, and the waiting one prunes after the newest save requested so far."""
        with self._lock:
            self._requests.append((step, save))
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
            requests, self._requests = self._requests, []
        if not requests:
            return
        # Every request coalesced into this run counts, not only the newest: a committed save
        # followed by one that failed still owes its prune.
        for step, save in requests:  # in save order: one writer thread commits them in turn
            if save.exception() is None and save.result() is not None:
                with self._lock:
                    self._owed = max(step, self._owed if self._owed is not None else step)
        with self._lock:
            owed = self._owed
        if owed is None:
            return  # nothing was committed since the last prune: nothing new to rely on
        if owed != requests[-1][0]:
            # A save that failed on a full disk must not end retention for good: every later
            # save would fail too. The prune owed since the last commit runs now.
            log.info("retention: the save of step %d did not commit; running the prune owed since step %d",
                     requests[-1][0], owed)
        try:
            self._record_verified()
            with self._lock:
                if self._queued:
                    # A newer save was requested meanwhile: it may be committed and not yet
                    # checked by its ranks, and then the prune would verify it by reading it
                    # all. Its own run prunes (``_owed`` keeps the request until one does).
                    return
            # ckptctl's own checkpoints only: other tools' in the same root are theirs to manage.
            plan, outcome = prune(self.root, self.policy, command=f"Checkpointer retention after step {owed}",
                                  layouts=CHECKPOINTER_LAYOUTS)
        except CkptError as e:  # lock held by a cron prune, nothing verifies, storage trouble
            # Still owed: the next save's run tries again, even if that save fails.
            log.warning("retention after step %d did not run: %s", owed, e)
            return
        with self._lock:
            if self._owed == owed:
                self._owed = None
        for item in plan.broken_left:
            log.warning("retention: %s is broken and was left in place: %s", item.url, item.reason)
        for note in plan.notes + (outcome.notes if outcome else []):
            log.info("retention: %s", note)
        if outcome is not None:
            for o in outcome.failed + outcome.skipped:
                log.warning("retention: %s %s: %s", o.result, o.name, o.detail)
            if outcome.deleted:
                log.info("retention after step %d deleted %s", owed, ", ".join(o.name for o in outcome.deleted))


def retention_policy(retention: Policy | RetentionPolicy | None, keep_last: int | None,
                     keep_every: int | None) -> RetentionPolicy:
    """The rules ``Checkpointer(retention=..., keep_last=..., keep_every=...)`` describe.
    ``ValueError`` when both forms are given, none is, or a value is bad.

    >>> retention_policy(None, 3, None).describe()
    'keep-last 3'
    >>> retention_policy(KeepLast(3), 2, None)
    Traceback (most recent call last):
    ...
    ValueError: keep_last/keep_every are shorthand for retention=KeepLast(n) | KeepEvery(steps); pass one or the other
    """
    shorthand: list[Policy] = []
    if keep_last is not None:
        shorthand.append(KeepLast(keep_last))
    if keep_every is not None:
        shorthand.append(KeepEvery(keep_every))
    if retention is not None and shorthand:
        raise ValueError("keep_last/keep_every are shorthand for retention=KeepLast(n) | KeepEvery(steps); "
                         "pass one or the other")
    if retention is None:
        return RetentionPolicy(shorthand)  # empty: ValueError (InvalidPolicy)
    if not isinstance(retention, (Policy, RetentionPolicy)):
        raise TypeError(f"retention must be a retention policy such as KeepLast(3), got {retention!r}")
    return RetentionPolicy.of(retention)


def _log_unexpected(future: "Future[None]") -> None:
    # Nobody waits on a retention task: an unexpected error (a bug) would vanish without this.
    exc = future.exception()
    if exc is not None:
        log.error("retention failed unexpectedly", exc_info=exc)


def check_own_shard(ckpt: Storage, entry: FileEntry) -> str | None:
    """Re-read one shard as ``verify --level load`` reads each file: its size and header
    against ``entry`` (what the manifest records for it), then every byte, each chunk hashed
    and decoded as its dtype, and the file checksum rebuilt; a local file must also open with
    safetensors. The first problem as a line of text, or None."""
    info = ckpt.stat(entry.name)
    if info is None or info.size != entry.size:
        return f"{ckpt.url_of(entry.name)}: {'missing' if info is None else f'{info.size} bytes'}, manifest says {entry.size}"
    try:
        h = read_header(ckpt, entry.name)
    except CheckpointError as e:
        return str(e)
    if len(h.chunks) != entry.chunks or not header_matches(h, entry):
        return f"{ckpt.url_of(entry.name)}: shard header does not match the file checksum in the manifest"
    problems, _ = stream_file(ckpt, entry, h, decode=True)
    if problems:
        return f"{ckpt.url_of(entry.name)}: {problems[0]}"
    path = ckpt.local_path(entry.name)
    if path is not None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            return f"{ckpt.url_of(entry.name)}: safetensors refuses the file: {e}"
    return None
