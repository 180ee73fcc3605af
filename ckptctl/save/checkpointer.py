"""The hook library's front door: ``Checkpointer``.

    >>> from ckptctl import Checkpointer
    >>> with Checkpointer("/ckpt") as ckpt:                       # doctest: +SKIP
    ...     start = ckpt.load_latest(state) or 0                  # resume, or start fresh
    ...     for step in range(start + 1, total):
    ...         train_step()
    ...         if step == start + 1:
    ...             ckpt.prepare(state)                           # staging buffer, in the background
    ...         if step % 500 == 0:
    ...             ckpt.save(step, state)                        # returns after the host copy

``save`` copies every tensor into a reusable host staging buffer and returns; a background
thread checksums and writes the shard, then the manifest, then the marker. A second ``save``
while one is still writing first waits for it (back-pressure: memory stays one snapshot).
``prepare`` makes that buffer ready ahead of the first save (``load_latest`` does it after a
resume), so the first save stalls no longer than the others.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from ckptctl.errors import CkptError, CoordinationError, InvalidCheckpoint, NotFound, RefusedForSafety, SaveFailed, StateError
from ckptctl.format.checkpoint import newest_committed
from ckptctl.format.layout import MARKER, shard_name, step_dir
from ckptctl.load.reader import CheckpointReader
from ckptctl.load.restore import restore
from ckptctl.save.background_retention import BackgroundRetention
from ckptctl.save.commit import build_manifest, commit, manifest_of
from ckptctl.save.coordination import AGREE_FATAL, AGREE_OK, AGREE_SKIP, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S, Coordinator
from ckptctl.save.plan import Plan, make_plan, signature_of
from ckptctl.save.shard_writer import write_shard
from ckptctl.save.staging import StagingBuffer
from ckptctl.state.capture import Captured, capture, kind_of
from ckptctl.storage import Storage, open_storage

log = logging.getLogger("ckptctl")


class SaveHandle:
    """One save in flight. ``wait()`` returns the committed checkpoint's URL or raises
    ``SaveFailed`` (the underlying error is its ``__cause__``)."""

    def __init__(self, step: int, url: str, future: "Future[str]") -> None:
        self.step = step
        self.url = url
        self._future = future
        self.observed = False  # whether the caller has seen this save's outcome

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        self.observed = True
        return self._future.result(timeout)


class Checkpointer:
    """Asynchronous checkpoints under ``root`` (a path or ``s3://bucket/prefix``)."""

    def __init__(
        self,
        root: str,
        *,
        async_save: bool = True,
        storage: Storage | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        process_group: "dist.ProcessGroup | None" = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        liveness_s: float = DEFAULT_LIVENESS_S,
    ) -> None:
        """``keep_last``/``keep_every``: after each commit, rank 0 prunes older checkpoints in
        the background with the same policy and safety checks as ``ckptctl prune`` (the new
        checkpoint is fully verified before anything is deleted). Retention problems are
        logged on the "ckptctl" logger and never fail a save.

        When torch.distributed is initialised, every rank of ``process_group`` (default: all
        ranks) must construct its Checkpointer at the same point (this creates the gloo group
        that coordinates saves), call ``save`` with the same steps, and see the same ``root``
        (a shared filesystem or bucket). ``timeout_s`` bounds how long the ranks wait for
        each other once their own shard is written: a rank that does not report by then
        (killed, hung) fails the save on every rank, naming it. ``liveness_s``: a rank whose
        process has shown no sign of life (a heartbeat through the c10d store) for this long
        is taken as dead sooner than ``timeout_s``."""
        self.root = storage or open_storage(root)
        retention = None
        if keep_last is not None or keep_every is not None:
            retention = BackgroundRetention(self.root, keep_last, keep_every)  # bad values raise here
        self.async_save = async_save
        self._coordinator: Coordinator | None = None
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            self._coordinator = Coordinator.create(process_group, timeout_s, liveness_s=liveness_s)
            self.rank, self.world_size = self._coordinator.rank, self._coordinator.world_size
        self._staging = StagingBuffer()
        self._plan: Plan | None = None
        self._pending: SaveHandle | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-writer")
        self._retention = retention if self.rank == 0 else None  # rank 0 alone prunes
        self._lock = threading.Lock()  # one save() at a time, even from several threads
        self._closed = False

    # --- saving -----------------------------------------------------------------------------

    def prepare(self, state: dict[str, Any]) -> bool:
        """Get ready to save ``state``: plan it, and allocate the host staging buffer and fault
        it in (or pin it, for GPU state) on a background thread. The first ``save`` then stalls
        only for its copy, like every later one, instead of also paying for memory the size of
        this rank's shard (a quarter of a second per GiB on a small host; pinning is slower).

        Call it once the state has its final structure, after the first optimizer step, well
        before the first save; ``load_latest`` does it itself when it resumes. It returns at
        once (the planning takes milliseconds) and needs no other rank. Returns False, doing
        nothing, when an optimizer in ``state`` has not stepped yet: its state does not exist,
        so the buffer's size is not known.

            >>> step = ckpt.load_latest(state) or 0           # doctest: +SKIP
            >>> train_step(); ckpt.prepare(state)              # doctest: +SKIP
        """
        unstepped = [k for k, v in state.items() if kind_of(v) == "optimizer" and not v.state]
        if unstepped:
            log.info("prepare: optimizer %s has not stepped yet; nothing prepared", ", ".join(map(repr, unstepped)))
            return False
        with self._lock:
            if self._closed:
                raise RuntimeError("Checkpointer is closed")
            plan = self._plan_for(capture(state, with_rng=False))  # planning needs the tensors only
            if self._pending is not None and not self._pending.done():
                return False  # a write still reads the buffer: the next save sizes it after draining
            return self._staging.prepare(plan)

    def _plan_for(self, captured: Captured) -> Plan:
        sig = signature_of(captured.tensors)
        if self._plan is None or self._plan.signature != sig:
            self._plan = make_plan(captured.tensors, sig, rank=self.rank, world_size=self.world_size)
        return self._plan

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Snapshot ``state`` into host memory and return; the write happens in the background.

        Raises the previous save's error if it failed and nobody has seen it yet, and
        ``RefusedForSafety`` if ``step`` is already committed (a checkpoint is never overwritten).
        """
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        with self._lock:
            t0 = time.perf_counter()
            self._drain()  # back-pressure: the staging buffer is still being written
            waited = time.perf_counter() - t0
            ckpt = self.root.sub(step_dir(step))
            if ckpt.stat(MARKER) is not None:
                raise RefusedForSafety(
                    f"{ckpt.url} is already committed; a checkpoint is never overwritten",
                    hint="save under a new step, or delete the old checkpoint with `ckptctl prune`",
                )
            t1 = time.perf_counter()
            captured = capture(state, per_rank=self.world_size > 1)
            plan = self._plan_for(captured)
            t2 = time.perf_counter()
            buf = self._staging.snapshot(plan, captured.tensors)
            t3 = time.perf_counter()
            # The stall, and its two parts: finding the tensors (and planning, when the state's
            # structure changed) and copying them. Across ranks the manifest keeps the maxima.
            stats = {"bytes": float(plan.nbytes), "stall_s": t3 - t1, "capture_s": t2 - t1, "copy_s": t3 - t2, "wait_s": waited}

            def job() -> str:
                t = time.perf_counter()
                if self._coordinator is not None:
                    return self._write_and_coordinate(step, ckpt, plan, buf, captured, stats)
                report = write_shard(ckpt, shard_name(self.rank, self.world_size), plan, buf, rank=self.rank, rank_state=captured.rank_state)
                stats["write_s"] = time.perf_counter() - t
                manifest = build_manifest(step, self.world_size, [report], captured.tree, stats)
                commit(ckpt, manifest)
                return ckpt.url

            future = self._pool.submit(_wrap(step, ckpt.url, job))
            handle = self._pending = SaveHandle(step, ckpt.url, future)
            if self._retention is not None:
                self._retention.after(step, future)
        if not self.async_save:
            handle.wait()
        return handle

    def _write_and_coordinate(self, step: int, ckpt: Storage, plan: Plan, buf, captured, stats: dict[str, float]) -> str:
        """Multi-rank: write this rank's shard, then let the coordinator decide (writer thread).

        A failed write is reported to rank 0 rather than raised here, so the other ranks learn
        it at once instead of waiting out the timeout; every rank then raises the same error."""
        assert self._coordinator is not None
        t = time.perf_counter()
        entry, error, failure = None, None, None
        try:
            entry = write_shard(ckpt, shard_name(self.rank, self.world_size), plan, buf, rank=self.rank, rank_state=captured.rank_state).file
        except (CkptError, OSError, RuntimeError, ValueError) as e:  # what storage and torch raise
            error, failure = f"could not write {ckpt.url_of(shard_name(self.rank, self.world_size))}: {e}", e
        stats["write_s"] = time.perf_counter() - t

        def commit_on_rank0(files, tensors, all_stats) -> str:
            if ckpt.stat(MARKER) is not None:  # checked again here: only rank 0 may commit
                raise RefusedForSafety(f"{ckpt.url} is already committed; a checkpoint is never overwritten")
            all_stats["commit_s"] = time.perf_counter() - t
            commit(ckpt, manifest_of(step, self.world_size, files, tensors, captured.tree, all_stats))
            return ckpt.url

        try:
            return self._coordinator.finish(step, entry, error, plan, stats, commit_on_rank0)
        except CoordinationError as e:
            if failure is not None:
                raise e from failure
            raise

    def wait(self) -> str | None:
        """Wait for every pending save; returns the last committed URL, raises if it failed."""
        h = self._pending
        return h.wait() if h is not None else None

    def _drain(self) -> None:
        h, self._pending = self._pending, None
        if h is None:
            return
        try:
            h._future.result()
        except SaveFailed:
            if not h.observed:  # raise each failure once: to wait(), or else here
                h.observed = True
                raise

    # --- loading ----------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict: bool = True) -> int:
        """Restore ``state`` in place from the committed checkpoint at ``path``; returns its step."""
        ckpt = open_storage(path) if isinstance(path, str) else path
        with CheckpointReader(ckpt) as reader:
            return restore(reader, state, strict=strict, rank=self.rank).step

    def load_latest(self, state: dict[str, Any], *, strict: bool = True, prepare: bool = True) -> int | None:
        """Restore from the newest committed checkpoint; None when there is none.

        After a resume, the next save is prepared (see ``prepare``): the staging buffer is
        allocated in the background. Pass ``prepare=False`` in a process that will not save
        (an evaluation), which then holds no buffer the size of its shard.

        If the newest one turns out to be corrupt while reading (a checksum mismatch), the
        next older committed checkpoint is loaded instead and a warning is logged: every
        tensor is overwritten again, so nothing of the bad one survives.

        Across ranks the choice is collective: rank 0's list of candidates is used by all, and
        a checkpoint counts as loaded only when every rank loaded its part of it; if any rank
        found its part corrupt, every rank moves on to the next older one together, so no
        two ranks ever resume from different steps.
        """
        step = self._load_latest(state, strict)
        if step is not None and prepare:
            self.prepare(state)
        return step

    def _load_latest(self, state: dict[str, Any], strict: bool) -> int | None:
        candidates = newest_committed(self.root)
        if self._coordinator is None:
            for entry, ckpt in candidates:
                try:
                    return self.load(ckpt, state, strict=strict)
                except (InvalidCheckpoint, NotFound) as e:
                    log.warning("skipping %s: %s", ckpt.url, e)
            return None
        coord = self._coordinator
        # Collectives run on the writer thread only: queued behind any save in flight.
        names = self._pool.submit(coord.from_rank0, [e.name for e, _ in candidates]).result()
        for name in names:
            ckpt = self.root.sub(name)
            step, error = None, None
            try:
                step = self.load(ckpt, state, strict=strict)
                verdict = AGREE_OK
            except (InvalidCheckpoint, NotFound) as e:
                error, verdict = e, AGREE_SKIP
            except CkptError as e:  # a mismatch with the state: no older checkpoint fixes it
                error, verdict = e, AGREE_FATAL
            everyone = self._pool.submit(coord.agree, verdict).result()
            if everyone == AGREE_OK:
                return step
            if everyone == AGREE_FATAL:
                if error is not None and verdict == AGREE_FATAL:
                    raise error
                raise StateError(
                    f"{ckpt.url}: another rank could not load its part of this checkpoint",
                    hint="the failing rank's error says why (for example a shape mismatch)",
                )
            log.warning("skipping %s: %s", ckpt.url, error or "another rank found its part of it corrupt or missing")
        return None

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending saves, release the thread and buffers. Raises a failed save's
        error if nobody has seen it."""
        if self._closed:
            return
        try:
            with self._lock:
                self._drain()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self._retention is not None:
                self._retention.close()
            self._staging.release()
            if self._coordinator is not None:
                self._coordinator.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with a save error
            try:
                self.close()
            except CkptError as e:
                log.error("while closing after an error: %s", e)


def _wrap(step: int, url: str, job):
    def run() -> str:
        try:
            return job()
        except Exception as e:  # any failure of the background write becomes SaveFailed
            raise SaveFailed(f"save of step {step} to {url} failed: {e}", hint=getattr(e, "hint", None)) from e

    return run
