"""The save path of one rank: snapshot into host memory on the caller's thread, write and
commit on a background thread.

``save`` copies every tensor into a reusable host staging buffer and returns; the writer thread
checksums and writes this rank's shard, then (rank 0, once every rank's shard is durable) the
manifest, then the marker. Every file is published without replacing any, so a zombie job
saving the same step loses cleanly (``layouts.native_commit.commit``, ``save.save_id``). A second
``save`` while one is still writing first waits for it (back-pressure: memory stays one
snapshot). ``prepare`` makes that buffer ready ahead of the first save, so the first save
stalls no longer than the others.

The public front door is ``ckptctl.Checkpointer``, which composes a ``Saver`` with the load
path and with library retention.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch.distributed as dist

from ckptctl.errors import CkptError, CoordinationError, RefusedForSafety, SaveFailed
from ckptctl.format.layout import MARKER, attempt_name, shard_name, step_dir
from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry, check_metrics
from ckptctl.layouts.native_commit import commit
from ckptctl.save.after_commit import AfterCommit, check_committed
from ckptctl.save.coordination import DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S, Coordinator
from ckptctl.save.replicas import replica_digests
from ckptctl.save.save_id import SaveIds
from ckptctl.save.shard_layout import ShardLayout, make_layout, signature_of
from ckptctl.save.shard_writer import ShardReport, abort_quietly, open_early, write_shard
from ckptctl.save.overlap import hold_steps, overlap_plan
from ckptctl.save.staging import StagingBuffer
from ckptctl.state.capture import Captured, capture
from ckptctl.state.pinned import HostRegion
from ckptctl.state.roles import role_of
from ckptctl.storage.base import Storage, Writer

log = logging.getLogger("ckptctl")

T = TypeVar("T")

# Called on rank 0 after each save is handed to the writer, with the step and the future of
# its commit (library retention: see ``ckptctl.Checkpointer``).
OnSave = Callable[[int, "Future[str]"], None]

# What a rank reports when its save failed before anything was written: no tensors, no
# structure to compare (rank 0 fails the round on the error before it looks at structures).
_NOTHING = ShardLayout(slots=(), nbytes=0, signature=(), needs_pinned=False)


class SaveHandle:
    """One save in flight. ``wait()`` returns the committed checkpoint's URL or raises
    ``SaveFailed`` (the underlying error is its ``__cause__``)."""

    def __init__(self, step: int, url: str, future: "Future[str]", save_id: str = "") -> None:
        self.step = step
        self.url = url
        self.save_id = save_id  # this attempt's id: in its manifest, and in any attempt-named file
        self._future = future
        self.observed = False  # whether the caller has seen this save's outcome

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        self.observed = True
        return self._future.result(timeout)


class Saver:
    """This rank's saves under ``root``. With a ``Coordinator`` (torch.distributed), the ranks
    agree on each save's outcome and rank 0 commits."""

    def __init__(
        self,
        root: Storage,
        *,
        async_save: bool = True,
        process_group: "dist.ProcessGroup | None" = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        liveness_s: float = DEFAULT_LIVENESS_S,
        on_save: OnSave | None = None,
        overlap_copies: bool = False,
        check_replicas: bool | None = None,
        after_commit: AfterCommit | None = None,
    ) -> None:
        self.root = root
        self._after_commit = after_commit
        self.check_replicas = check_replicas  # see ``save.replicas``: None = CPU-resident ones
        self.async_save = async_save
        self.overlap_copies = overlap_copies  # opt-in: see staging's "the opt-in overlap"
        self._step_holds: list[Any] = []  # one-shot optimizer step pre-hooks of the last save
        self._prepare_hooks: list[Any] = []  # step post-hooks that prepare once every optimizer stepped
        self.coordinator: Coordinator | None = None
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.coordinator = Coordinator.create(process_group, timeout_s, liveness_s=liveness_s)
            self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        self._on_save = on_save if self.rank == 0 else None  # rank 0 alone prunes
        self._save_ids = SaveIds(self.coordinator.nonce if self.coordinator is not None else None)
        self.staging = StagingBuffer()
        self._layout: ShardLayout | None = None
        self._pending: SaveHandle | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-writer")
        self._looks = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-look")  # save()'s marker look
        self._lock = threading.Lock()  # one save() at a time, even from several threads
        self.closed = False

    def prepare(self, state: dict[str, Any]) -> bool:
        """See ``Checkpointer.prepare``."""
        unstepped = _unstepped(state)
        if unstepped:
            log.info("prepare: optimizer %s has not stepped yet; nothing prepared", ", ".join(map(repr, unstepped)))
            return False
        with self._lock:
            self._check_open()
            captured = capture(state, with_rng=False)  # planning needs the tensors only
            layout = self._layout_for(captured)
            if self._pending is not None and not self._pending.done():
                return False  # a write still reads the buffer: the next save sizes it after draining
            return self.staging.prepare(layout, captured.tensors)  # pinned under the tensors' GPU

    def prepare_when_stepped(self, state: dict[str, Any]) -> None:
        """``prepare(state)`` now, or, when an optimizer of ``state`` has not stepped yet, right
        after each of them has stepped once (a one-shot step post-hook): the first save then
        finds its buffer faulted in without the job calling ``prepare``. A failure to prepare
        is logged, never raised into the optimizer's ``step()``."""
        self._drop_prepare_hooks()
        unstepped = [state[k] for k in _unstepped(state)]
        if not unstepped:
            self.prepare(state)
            return
        waiting = {id(opt) for opt in unstepped}

        def stepped(opt: Any, _args: Any, _kwargs: Any) -> None:
            if id(opt) in waiting:
                waiting.discard(id(opt))
                if not waiting:
                    try:
                        self.prepare(state)
                    except (CkptError, RuntimeError) as e:  # a state that cannot be captured; closed
                        log.warning("could not prepare the staging buffer after the first optimizer step: %s", e)

        # Removed at the next save or close: a hook cannot remove itself (torch iterates over
        # the hook dict while calling them).
        self._prepare_hooks = [opt.register_step_post_hook(stepped) for opt in unstepped]

    def _drop_prepare_hooks(self) -> None:
        for handle in self._prepare_hooks:
            handle.remove()
        self._prepare_hooks = []

    @contextlib.contextmanager
    def lending(self) -> Iterator[Callable[[int, int | None, bool], HostRegion | None]]:
        """Lend the staging buffer to a load while the context is open (``StagingBuffer.lend``):
        no save starts meanwhile, and a load that takes the buffer first waits for the last
        save's write, which reads it. That save's error, if any, is left for ``wait()`` or the
        next ``save()`` to raise."""

        def lend(nbytes: int, pin_device: int | None, map_new: bool) -> HostRegion | None:
            if self._pending is not None:
                wait([self._pending._future])
            return self.staging.lend(nbytes, pin_device, map_new)

        with self._lock:
            self._check_open()
            yield lend

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None = None) -> SaveHandle:
        """See ``Checkpointer.save``."""
        self._check_open()
        self._drop_prepare_hooks()  # fired or not: this save sizes the buffer itself
        recorded = check_metrics(metrics if metrics is not None else {})  # a bad one raises before any work
        with self._lock:
            t0 = time.perf_counter()
            self._drain()  # back-pressure: the staging buffer is still being written
            waited = time.perf_counter() - t0
            ckpt = self.root.sub(step_dir(step))
            save_id = self._save_ids.next(step)  # on every rank alike, even if this save fails here
            # Is the step committed already? Asked beside the snapshot, answered before save
            # returns: on object storage the look is a round trip (retried by botocore when the
            # store stumbles), which the training thread used to wait for before copying.
            looked = self._looks.submit(ckpt.stat, MARKER)
            early: Writer | None = None
            try:
                t1 = time.perf_counter()
                captured = capture(state, per_rank=self.world_size > 1)
                layout = self._layout_for(captured)
                early = open_early(ckpt, shard_name(self.rank, self.world_size), layout)
                # Replicas are hashed before save returns: training may change them after.
                replicas = replica_digests(layout, captured.tensors, self.check_replicas, captured.buffers) if self.coordinator is not None else None
                t2 = time.perf_counter()
                deferred, optimizers = overlap_plan(state, captured.tensors) if self.overlap_copies else (frozenset(), [])
                buf = self.staging.snapshot(layout, captured.tensors, deferred=deferred)
                fence = self.staging.fence
                t3 = time.perf_counter()
                # Inside: the other ranks learn it at once. A node-local root answers per node (a
                # step committed on one node's disk only), and they would otherwise wait for it.
                if looked.result() is not None:
                    self.staging.settle()  # the refused snapshot's copies land before anything reuses the buffer
                    raise RefusedForSafety(
                        f"{ckpt.url} is already committed; a checkpoint is never overwritten",
                        hint="save under a new step, or delete the old checkpoint with `ckptctl rm` or `ckptctl prune`",
                    )
                self._hold_steps(optimizers, fence)
            except BaseException as e:
                wait([looked])  # a failed snapshot leaves no look running against a closing storage
                abort_quietly(early)
                self._report_lost_save(step, ckpt, e)
                raise
            # The stall, and its two parts: finding the tensors (and planning, when the state's
            # structure changed) and copying them. Across ranks the manifest keeps the maxima.
            stats = {"bytes": float(layout.nbytes), "stall_s": t3 - t1, "capture_s": t2 - t1, "copy_s": t3 - t2, "wait_s": waited}

            written: list[FileEntry] = []  # this rank's file, once written

            def job() -> str:
                if fence is not None:  # copies left in flight land before anything is hashed
                    try:
                        fence.synchronize()
                    except BaseException:
                        abort_quietly(early)
                        raise
                if self.coordinator is not None:
                    return self._write_and_coordinate(step, ckpt, layout, buf, captured, stats, replicas, written, save_id,
                                                      recorded, early)
                t = time.perf_counter()
                name = shard_name(self.rank, self.world_size)
                report = write_shard(ckpt, name, layout, buf, rank=self.rank, rank_state=captured.rank_state,
                                     fallback=attempt_name(name, save_id), writer=early)
                written.append(report.file)
                stats["write_s"] = time.perf_counter() - t
                manifest = manifest_from_reports(step, self.world_size, [report], captured.tree, stats, save_id, recorded)
                commit(ckpt, manifest, published=[report.file.name])
                return ckpt.url

            handle = self._pending = SaveHandle(step, ckpt.url, self._pool.submit(_as_save_failure(step, ckpt.url, job)), save_id)
            checked = handle._future
            if self._after_commit is not None:  # queued right behind the save, on the writer thread
                checked = self._pool.submit(check_committed, self._after_commit, self.coordinator, self.rank, step, ckpt,
                                            handle._future, written)
            if self._on_save is not None:
                self._on_save(step, checked)
        if not self.async_save:
            handle.wait()
        return handle

    def _hold_steps(self, optimizers: list[Any], fence: Any) -> None:
        for handle in self._step_holds:  # the previous save's copies are done: stop waiting on them
            handle.remove()
        self._step_holds = hold_steps(optimizers, fence) if fence is not None else []

    def _report_lost_save(self, step: int, ckpt: Storage, error: BaseException) -> None:
        """This rank failed before handing its save to the writer: tell the other ranks now,
        through the same round they are in, so they fail at once naming this rank instead of
        waiting out ``timeout_s`` (and the round counters stay in step for the next save)."""
        if self.coordinator is None:
            return
        why = f"save() failed on this rank before writing: {type(error).__name__}: {error}"
        coord = self.coordinator
        fut = self._pool.submit(coord.finish, step, None, why, _NOTHING, {}, _never_commits)
        # Nobody waits on this round's outcome: the caller gets the original error now.
        handle = self._pending = SaveHandle(step, ckpt.url, fut)
        handle.observed = True

    def _write_and_coordinate(self, step: int, ckpt: Storage, layout: ShardLayout, buf, captured: Captured, stats: dict[str, float],
                              replicas: list[int] | None, written: list[FileEntry] | None, save_id: str,
                              metrics: dict[str, float] | None = None, early: Writer | None = None) -> str:
        """Multi-rank: write this rank's shard, then let the coordinator decide (writer thread).

        A failed write is reported to rank 0 rather than raised here, so the other ranks learn
        it at once instead of waiting out the timeout; every rank then raises the same error."""
        assert self.coordinator is not None
        t = time.perf_counter()
        name = shard_name(self.rank, self.world_size)
        entry, error, failure = None, None, None
        try:
            entry = write_shard(ckpt, name, layout, buf, rank=self.rank, rank_state=captured.rank_state,
                                fallback=attempt_name(name, save_id), writer=early).file
            if written is not None:
                written.append(entry)
        except Exception as e:  # any failure is reported to every rank, then raised below
            error, failure = f"could not write {ckpt.url_of(name)}: {type(e).__name__}: {e}", e
        stats["write_s"] = time.perf_counter() - t

        def commit_on_rank0(files: list[FileEntry], tensors: dict[str, TensorEntry], all_stats: dict[str, float]) -> str:
            all_stats["commit_s"] = time.perf_counter() - t
            # Rank 0 commits, so rank 0's metrics are the ones recorded.
            manifest = Manifest.new(step, self.world_size, files, tensors, captured.tree, all_stats, save_id=save_id,
                                    metrics=metrics)
            # Every rank's file was published by this save (``write_shard``): a lost race deletes them.
            commit(ckpt, manifest, published=[f.name for f in files])
            return ckpt.url

        try:
            return self.coordinator.finish(step, entry, error, layout, stats, commit_on_rank0, replicas)
        except CoordinationError as e:
            if failure is not None:
                raise e from failure
            raise

    def collective(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the writer thread, where every collective of this rank's
        coordination group runs: queued behind any save in flight, never beside it."""
        return self._pool.submit(fn, *args).result()

    def wait(self) -> str | None:
        """Wait for the pending save; returns its committed URL, raises if it failed."""
        h = self._pending
        return h.wait() if h is not None else None

    def _drain(self) -> None:
        h, self._pending = self._pending, None
        if h is None:
            return
        try:
            h._future.result()
        except (SaveFailed, CoordinationError):
            if not h.observed:  # raise each failure once: to wait(), or else here
                h.observed = True
                raise

    def _layout_for(self, captured: Captured) -> ShardLayout:
        sig = signature_of(captured.tensors)
        if self._layout is None or self._layout.signature != sig:
            self._layout = make_layout(captured.tensors, sig, rank=self.rank, world_size=self.world_size)
        return self._layout

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Checkpointer is closed")

    def close(self) -> None:
        """Wait for the pending save, then release the thread, the buffer and the group.
        Raises a failed save's error if nobody has seen it."""
        if self.closed:
            return
        try:
            with self._lock:
                self._drain()
        finally:
            self.closed = True
            self._pool.shutdown(wait=True)
            self._looks.shutdown(wait=True)
            self._hold_steps([], None)
            self._drop_prepare_hooks()
            self.staging.release()
            if self.coordinator is not None:
                self.coordinator.close()


def manifest_from_reports(step: int, world_size: int, reports: Sequence[ShardReport], tree: dict[str, Any], stats: dict[str, float],
                          save_id: str | None = None, metrics: dict[str, float] | None = None) -> Manifest:
    """The manifest of a save whose every shard report is at hand (one process): each tensor's
    chunks counted over the shards."""
    tensors: dict[str, TensorEntry] = {}
    for r in reports:
        for s in r.slots:
            t = tensors.get(s.name)
            tensors[s.name] = TensorEntry(s.dtype, s.global_shape, s.group, (t.chunks if t else 0) + 1)
    return Manifest.new(step, world_size, [r.file for r in reports], tensors, tree, stats, save_id=save_id,
                        metrics=metrics)


def _unstepped(state: dict[str, Any]) -> list[str]:
    """The keys of ``state``'s optimizers that have not stepped yet (their state is empty)."""
    return [k for k, v in state.items() if role_of(v) == "optimizer" and not v.state]


def _never_commits(*_: object) -> str:
    raise AssertionError("a round with a failed rank is never committed")


def _as_save_failure(step: int, url: str, job: Callable[[], str]) -> Callable[[], str]:
    def run() -> str:
        try:
            return job()
        except Exception as e:  # any failure of the background write becomes SaveFailed
            raise SaveFailed(f"save of step {step} to {url} failed: {e}", hint=getattr(e, "hint", None)) from e

    return run
