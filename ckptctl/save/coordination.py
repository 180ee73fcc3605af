"""Agreeing across ranks that a checkpoint is complete, and committing it exactly once.

Runs on each rank's background writer thread, after the rank's shard is durable (or its write
failed), over a gloo group of its own: coordination never queues behind, or in front of, the
training's NCCL collectives, and a CPU-only exchange needs no device memory.

One save is a barrier (through the c10d store, ``barrier``), a ``gather`` of one fixed-size
report per rank to rank 0, rank 0's decision (fail naming the ranks, compare replicas, plan,
or commit: ``save.decision``), and one ``broadcast`` of the outcome, so every rank's ``wait()`` returns the same
URL or raises the same error. Rank 0 receives O(ranks) bytes per save and O(tensors) per
re-plan, never ranks x tensors. A collective that fails leaves the group unusable: the
coordinator is then *broken* and every later save fails at once. A killed rank is noticed by
its stopped heartbeat within ``liveness_s``; a hung one by ``timeout_s``.

The whole protocol, its store keys, verdicts and every failure: ``docs/protocol.md``.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ckptctl.errors import CoordinationError, RefusedForSafety, UsageError
from ckptctl.format.manifest import FileEntry, TensorEntry
from ckptctl.save.barrier import StoreBarrier
from ckptctl.save.decision import covered, decide, merged_stats
from ckptctl.save.heartbeat import BEAT_MIN_S, DEFAULT_LIVENESS_S, Heartbeat, first_line
from ckptctl.save.messages import ANSWER_BYTES, REPORT_BYTES, RankReport, pack, unpack
from ckptctl.save.replicas import NAMED, bounds, combined, differing, replica_message
from ckptctl.save.replicas import ranks_text as _ranks
from ckptctl.save.save_id import NONCE_BYTES, new_nonce
from ckptctl.save.shard_layout import ShardLayout

DEFAULT_TIMEOUT_S = 900.0

# Verdicts for ``agree``, ordered so that the minimum over ranks is the collective one.
AGREE_FATAL, AGREE_SKIP, AGREE_OK = 0, 1, 2

# (files, tensors, stats) -> URL of the committed checkpoint; runs on rank 0 only.
CommitFn = Callable[[list[FileEntry], dict[str, TensorEntry], dict[str, float]], str]


class Coordinator:
    """One per Checkpointer; ``create`` is collective over the ranks of ``process_group``."""

    def __init__(
        self,
        group: "dist.ProcessGroup | None",
        *,
        timeout_s: float,
        liveness_s: float = DEFAULT_LIVENESS_S,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """``group`` None with ``rank``/``world_size`` given: rank 0's bookkeeping alone, no
        collectives (scripts/sim_scale.py measures it that way)."""
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.liveness_s = liveness_s
        self.broken: str | None = None  # why the group cannot be used any more
        self._last_layout: ShardLayout | None = None  # the layout of the last committed save
        self._tensors: dict[str, TensorEntry] | None = None  # rank 0: checked table of that layout
        self._structure: str | None = None
        self._store_barrier: StoreBarrier | None = None  # None: gloo's monitored_barrier instead
        self._heartbeat: Heartbeat | None = None
        self.nonce = new_nonce()  # rank 0's on every rank once ``create`` shared it (``save_id``)

    @classmethod
    def create(
        cls, process_group: "dist.ProcessGroup | None", timeout_s: float, *, liveness_s: float = DEFAULT_LIVENESS_S
    ) -> "Coordinator":
        """A dedicated gloo group over the ranks of ``process_group`` (default: all ranks).
        Every rank of that group must call this, in the same order as its other new groups.
        Starts this rank's heartbeat thread (see ``Heartbeat``); ``close`` stops it."""
        if not liveness_s >= 3 * BEAT_MIN_S:  # also refuses NaN
            raise UsageError(
                f"liveness_s={liveness_s!r}: must be at least {3 * BEAT_MIN_S:g}s",
                hint="a rank is taken as dead after liveness_s without a heartbeat; the default is 60s",
            )
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=timedelta(seconds=timeout_s),
            use_local_synchronization=True,  # ranks outside process_group need not take part
            group_desc="ckptctl_coordination",
        )
        coord = cls(group, timeout_s=timeout_s, liveness_s=liveness_s)
        nonce = torch.frombuffer(bytearray(coord.nonce), dtype=torch.uint8)
        dist.broadcast(nonce, group=group, group_src=0)  # once per Checkpointer: see ``save_id``
        coord.nonce = bytes(nonce.numpy().tobytes())[:NONCE_BYTES]
        store = _side_channel(group)
        clone = getattr(store, "clone", None)  # torch < 2.5 has none: timeout_s alone then
        if coord.world_size > 1 and clone is not None:
            coord._heartbeat = Heartbeat(clone(), coord.rank, coord.world_size, liveness_s)
        if store is not None:
            # A connection of its own: a blocking wait holds its client's lock, and on the
            # default connection it would stall the training thread's new_group() or lazy NCCL
            # set-up until the slowest rank finished writing.
            own = clone() if clone is not None else store
            coord._store_barrier = StoreBarrier(own, coord.rank, coord.world_size, coord.timeout, coord._heartbeat)
        return coord

    def close(self) -> None:
        # The group itself is left to destroy_process_group(): destroying a subgroup here
        # would need every rank to close at the same moment.
        if self.broken is None:
            self.broken = "the checkpointer is closed"
        if self._heartbeat is not None:
            self._heartbeat.stop()

    # --- one save ---------------------------------------------------------------------------

    def finish(
        self, step: int, file: FileEntry | None, error: str | None, layout: ShardLayout, stats: dict[str, float], commit: CommitFn,
        replicas: list[int] | None = None,
    ) -> str:
        """Agree on the outcome of ``step`` once this rank's write is over (``file`` written, or
        ``error``); returns the committed URL or raises ``CoordinationError`` naming the
        ranks that failed. Rank 0 calls ``commit`` when, and only when, every rank succeeded.
        ``replicas``: this rank's digest of each replicated tensor, by ``layout.table`` entry
        (0: not hashed; see ``save.replicas``); a save whose replicas differ fails, naming the
        tensors and the ranks."""
        if self.broken is not None:
            raise CoordinationError(
                f"step {step}: cannot coordinate: {self.broken}",
                hint="a rank was lost during an earlier save; restart the job and resume with load_latest",
            )
        digests = replicas if replicas is not None and len(replicas) == len(layout.table) else [0] * len(layout.table)
        report = RankReport(self.rank, step, file, error, layout.structure, layout is not self._last_layout, stats,
                            combined(digests))
        self._barrier(step)
        gathered = self._gather(step, asdict(report))
        # Rank 0 decides and, in the steady state, commits before answering: one broadcast.
        answer = None
        if self.rank == 0:
            answer = self._decide(gathered, layout)
            if answer[0] == "commit":
                answer = self._commit(step, gathered, commit)
        action, message = self._broadcast(step, answer)
        if action == "replicas":
            action, message = self._replica_round(step, layout, gathered, digests, commit)
        if action == "plan":
            action, message = self._plan_round(step, layout, gathered, commit)
        if action == "refused":  # another writer committed this step: see ``_commit``
            self._last_layout = None
            raise RefusedForSafety(message, hint="two jobs are saving into one root (a zombie job and its restart?); "
                                   "stop the other one and check this step with `ckptctl verify`")
        if action != "ok":
            self._last_layout = None  # the next save re-checks the layout from scratch
            raise CoordinationError(message, hint="no marker was written; the partial directory is left for `ckptctl prune`")
        self._last_layout = layout
        return message

    def _decide(self, gathered: list | None, layout: ShardLayout, *, replicas_checked: bool = False) -> tuple[str, str]:
        """Rank 0: fail, compare replicas, plan, or commit; from the gathered reports alone
        (``save.decision``)."""
        return decide(gathered, layout.structure, self._structure, replicas_checked=replicas_checked)

    def _replica_round(self, step: int, layout: ShardLayout, gathered: list | None, digests: list[int], commit: CommitFn) -> tuple[str, str]:
        """Replica digests differ: which tensors (MIN and MAX reduces, O(tensors) at rank 0),
        and which ranks hold which copy of up to ``NAMED`` of them (one gather); none after all
        (ranks hashed different sets): go on as ``_decide`` would. See ``save.replicas``."""
        lo, hi = bounds(digests)
        self._collective(step, "reduce", lambda: dist.reduce(lo, group=self.group, group_dst=0, op=dist.ReduceOp.MIN))
        self._collective(step, "reduce", lambda: dist.reduce(hi, group=self.group, group_dst=0, op=dist.ReduceOp.MAX))
        which = differing(lo, hi, NAMED) if self.rank == 0 else torch.empty(NAMED, dtype=torch.int64)
        self._collective(step, "broadcast", lambda: dist.broadcast(which, group=self.group, group_src=0))
        mine = torch.tensor([digests[i] if i >= 0 else 0 for i in which.tolist()], dtype=torch.int64)
        out = [torch.empty(NAMED, dtype=torch.int64) for _ in range(self.world_size)] if self.rank == 0 else None
        self._collective(step, "gather", lambda: dist.gather(mine, out, group=self.group, group_dst=0))
        answer = None
        if self.rank == 0:
            assert out is not None
            named = [i for i in which.tolist() if i >= 0]
            if named:
                answer = ("fail", replica_message(step, [layout.table[i].name for i in named],
                                                  [[int(t[k]) for t in out] for k in range(len(named))], lo, hi))
            else:
                answer = self._decide(gathered, layout, replicas_checked=True)
                if answer[0] == "commit":
                    answer = self._commit(step, gathered, commit)
        return self._broadcast(step, answer)

    def _plan_round(self, step: int, layout: ShardLayout, gathered: list | None, commit: CommitFn) -> tuple[str, str]:
        """Sum every rank's (chunks, elements) per tensor at rank 0, check coverage, commit."""
        cov = torch.tensor(layout.coverage or [], dtype=torch.int64).reshape(len(layout.table), 4)
        self._collective(step, "reduce", lambda: dist.reduce(cov, group=self.group, group_dst=0))
        answer = None
        if self.rank == 0:
            answer = self._check_coverage(step, layout, cov)
            if answer[0] == "commit":
                answer = self._commit(step, gathered, commit)
        return self._broadcast(step, answer)

    # Fixed-size JSON messages (see ``messages``): one collective each.

    def _gather(self, step: int, report: dict) -> list[dict] | None:
        """Every rank's report at rank 0 (None elsewhere)."""
        mine = pack(report, REPORT_BYTES, shorten="error")
        out = [torch.empty(REPORT_BYTES, dtype=torch.uint8) for _ in range(self.world_size)] if self.rank == 0 else None
        self._collective(step, "gather", lambda: dist.gather(mine, out, group=self.group, group_dst=0))
        return [unpack(t) for t in out] if out is not None else None

    def _broadcast(self, step: int, answer: tuple[str, str] | None) -> tuple[str, str]:
        """Rank 0's (action, message) on every rank."""
        buf = pack(list(answer), ANSWER_BYTES, shorten=1) if answer is not None else torch.empty(ANSWER_BYTES, dtype=torch.uint8)
        self._collective(step, "broadcast", lambda: dist.broadcast(buf, group=self.group, group_src=0))
        action, message = unpack(buf)
        return action, message

    def _check_coverage(self, step: int, layout: ShardLayout, cov: torch.Tensor) -> tuple[str, str]:
        tensors, failure = covered(step, layout, cov, self.world_size)
        if tensors is None:
            return "fail", failure
        self._tensors, self._structure = tensors, layout.structure  # the next saves skip the plan round
        return "commit", ""

    def _commit(self, step: int, gathered: list | None, commit: CommitFn) -> tuple[str, str]:
        """Rank 0: manifest and marker. Storage errors become the outcome every rank sees."""
        assert gathered is not None and self._tensors is not None
        files = [FileEntry(**r["file"]) for r in gathered]
        try:
            return "ok", commit(files, self._tensors, merged_stats(gathered))
        except RefusedForSafety as e:  # lost to another writer; every rank fails the same way
            return "refused", f"step {step}: {e}"
        except Exception as e:  # any failure must reach every rank, or they would wait on rank 0
            return "fail", f"step {step}: rank 0 could not commit: {type(e).__name__}: {e}"

    # --- loading ----------------------------------------------------------------------------

    def from_rank0(self, value: object) -> object:
        """Rank 0's ``value`` on every rank (e.g. its list of checkpoints to try)."""
        box = [value]
        self._usable("load")
        self._collective(None, "broadcast", lambda: dist.broadcast_object_list(box, group=self.group, group_src=0))
        return box[0]  # once per resume, of any size: the generic (two-step) broadcast is fine

    def agree(self, verdict: int) -> int:
        """The lowest of every rank's verdict (AGREE_FATAL < AGREE_SKIP < AGREE_OK)."""
        t = torch.tensor([verdict], dtype=torch.int64)
        self._usable("load")
        self._collective(None, "all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group))
        return int(t.item())

    def _usable(self, what: str) -> None:
        if self.broken is not None:
            raise CoordinationError(f"cannot coordinate the {what}: {self.broken}", hint="restart the job")

    # --- collectives ------------------------------------------------------------------------

    def _barrier(self, step: int) -> None:
        """Wait until every rank has finished writing, at most ``timeout_s``; every rank learns
        which ranks did not arrive, and whether they were lost to a timeout or to a heartbeat
        (see ``barrier.StoreBarrier``). Without a store, gloo's ``monitored_barrier``."""
        if self.world_size == 1:
            return
        if self._store_barrier is None:
            return self._monitored_barrier(step)
        try:
            cause, missing = self._store_barrier.wait()
        except dist.DistStoreError as e:  # rank 0 never answered
            self._lost(step, [0], f"within {self.timeout.total_seconds():g}s ({first_line(e)})", coordinator=True)
        except RuntimeError as e:  # DistNetworkError: the store is gone (it may have lived in rank 0)
            self._lost(step, [0], f": the c10d store failed ({first_line(e)})", coordinator=True)
        if cause == "coordinator":
            self._lost(step, [0], f": no heartbeat from rank 0 for {self.liveness_s:g}s", coordinator=True)
        if cause == "heartbeat":
            self._lost(step, missing, f": no heartbeat for {self.liveness_s:g}s (the process died or froze)")
        if missing:
            self._lost(step, missing, f"within {self.timeout.total_seconds():g}s")

    def _monitored_barrier(self, step: int) -> None:
        """Fallback without a store: gloo's own, which names the missing ranks on rank 0."""
        try:
            dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            found = sorted({int(x) for m in re.finditer(r"Ranks? ([\d, ]+?) failed to pass", str(e)) for x in re.findall(r"\d+", m.group(1))})
            why = f"within {self.timeout.total_seconds():g}s ({first_line(e)})"
            self._lost(step, found or [0], why, coordinator=not found)

    def _lost(self, step: int, missing: list[int], why: str, *, coordinator: bool = False) -> None:
        """``why`` completes "did not report": "within 900s", ": no heartbeat for 60s"."""
        who = "rank 0 (the coordinator), or the c10d store it answers through," if coordinator else _ranks(missing)
        self.broken = f"{who} did not report during the save of step {step}"
        raise CoordinationError(
            f"step {step}: {who} did not report{'' if why.startswith(':') else ' '}{why}; no marker was written",
            hint="a rank died or hung while saving; restart the job and resume with load_latest",
        )

    def _collective(self, step: int | None, what: str, fn: Callable[[], object]) -> None:
        """Run one collective; ``step`` None for a load. A failure breaks the coordinator."""
        where = f"step {step}" if step is not None else "load_latest"
        try:
            fn()
        except RuntimeError as e:
            self.broken = f"a rank was lost during the {what} of {where}"
            raise CoordinationError(
                f"{where}: coordination failed during {what}: {first_line(e)}"
                + ("; no marker was written" if step is not None else ""),
                hint="a rank died or hung; restart the job and resume with load_latest",
            ) from None


def _side_channel(group: "dist.ProcessGroup") -> "dist.Store | None":
    """The c10d store of the default group, under a prefix of this group's own; None where
    torch does not expose it (then the barrier falls back to ``monitored_barrier``)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # private, hence guarded

        return dist.PrefixStore(f"ckptctl/{group.group_name}/", _get_default_store())
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return None
