"""The hook library's front door: ``Checkpointer``.

    >>> from ckptctl import Checkpointer
    >>> with Checkpointer("/ckpt") as ckpt:                       # doctest: +SKIP
    ...     start = ckpt.load_latest(state) or 0                  # resume, or start fresh; either
    ...     for step in range(start + 1, total):                  # way the staging buffer is made
    ...         train_step()                                      # in the background
    ...         if step % 500 == 0:
    ...             ckpt.save(step, state)                        # returns after the host copy

It composes parts that know nothing of each other: the save path (``save.saver``), the
load path (``load.loader``), when asked for, library retention (``ops.retention.background``,
the same policy and safety checks as ``ckptctl prune``) and tiers (``tiers``: commit to the
first, promote to the next in the background). Choosing which checkpoint to resume from, and
agreeing on it across ranks, is ``resume``'s (``load_newest``), beside this module, where the
two paths meet.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Sequence

from ckptctl.errors import CkptError, UsageError
from ckptctl.load.loader import load_checkpoint
from ckptctl.ops.retention.background import BackgroundRetention
from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.resume import load_newest
from ckptctl.save.coordination import AGREE_OK, AGREE_SKIP, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S
from ckptctl.save.saver import SaveHandle, Saver
from ckptctl.storage import Storage, open_storage
from ckptctl.tiers.chain import Tiers
from ckptctl.tiers.durability import Flushed
from ckptctl.tiers.health import Trouble
from ckptctl.tiers.node_chain import make_tiers
from ckptctl.tiers.spec import Tier

DEFAULT_PROMOTE_TIMEOUT_S = 600.0  # how long close() waits for the last checkpoint to reach the last tier
RELEASE_MARGIN_S = 30.0  # other ranks wait this much longer than rank 0's flush for its stop

__all__ = ["Checkpointer", "Flushed", "SaveHandle", "Tier", "Trouble"]

log = logging.getLogger("ckptctl")


class Checkpointer:
    """Asynchronous checkpoints under ``root`` (a path or ``s3://bucket/prefix``), or on
    ``tiers``."""

    def __init__(
        self,
        root: str | None = None,
        *,
        tiers: Sequence[Tier] | None = None,
        promote_timeout_s: float = DEFAULT_PROMOTE_TIMEOUT_S,
        async_save: bool = True,
        storage: Storage | None = None,
        retention: Policy | RetentionPolicy | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        process_group: "Any | None" = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        liveness_s: float = DEFAULT_LIVENESS_S,
        overlap_copies: bool = False,
        check_replicas: bool | None = None,
    ) -> None:
        """Each option in short; in full, with examples: ``docs/checkpointer.md``. Pass the
        same options on every rank.

        ``root``: a path or ``s3://bucket/prefix`` (``storage``: a ``Storage`` to use instead).
        ``tiers`` instead: ``[Tier("/nvme/ckpt", retention=KeepLast(2)), Tier("s3://lab/run7")]``:
        commit to the first, promote to each next one in the background, each pruned by its own
        retention; ``close`` waits up to ``promote_timeout_s`` for the last tier (``tiers``).

        ``retention`` (``KeepLast(3) | KeepEvery(1000) | KeepBest(2, "val_loss")``, or the
        shorthand ``keep_last``/``keep_every``): after each commit rank 0 prunes in the
        background with ``ckptctl prune``'s rules and safety checks; problems are logged, never
        fail a save.

        With torch.distributed: every rank of ``process_group`` (default: all) builds its
        Checkpointer at the same point, saves the same steps and sees the same root.
        ``timeout_s``: how long the ranks wait for each other once their shard is written;
        ``liveness_s``: a rank without a heartbeat that long is taken as dead sooner.

        ``async_save=False``: ``save`` returns once committed. ``overlap_copies`` (opt-in): the
        GPU copies of parameters and optimizer state run under the next forward/backward.
        ``check_replicas``: each rank hashes its copy of the tensors every rank holds whole, and
        a save whose copies differ fails (None: CPU-resident ones; True: all; False: none).

        Raises ``ValueError`` for a bad value or options that exclude each other, and
        ``UsageError`` for retention set on some ranks only."""
        self._tiers: Tiers | None = None
        if tiers is not None:
            if root is not None or storage is not None:
                raise ValueError("give either root (one tier) or tiers, not both")
            if retention is not None or keep_last is not None or keep_every is not None:
                raise ValueError("with tiers, give each Tier its own retention=")
            self._tiers = make_tiers(list(tiers))  # bad tiers or rules raise here, on every rank
            self.root = self._tiers.roots[0]
            background = self._tiers.first_retention
        else:
            if root is None:
                raise ValueError("Checkpointer needs a root (a path or s3://bucket/prefix) or tiers=")
            self.root = storage or open_storage(root)
            background = None
            if retention is not None or keep_last is not None or keep_every is not None:
                # Bad values raise here, on every rank, before any group is created.
                background = BackgroundRetention(self.root, keep_last, keep_every, retention=retention)
        self.promote_timeout_s = promote_timeout_s
        self._roots = self._tiers.roots if self._tiers is not None else [self.root]
        # A load from a later tier (S3) spools this rank's bytes on the first tier's disk (the
        # NVMe the checkpoints live on) rather than $TMPDIR, often a tmpfs: RAM the size of
        # the rank's share, exactly while the job is building its model.
        self._spool_dir = self._roots[0].local_path() if len(self._roots) > 1 else None
        on_save = background.after if background is not None else None
        if self._tiers is not None:
            on_save = self._tiers.after_save  # promotion first, then the first tier's retention
        self._saver = Saver(
            self.root,
            async_save=async_save,
            process_group=process_group,
            timeout_s=timeout_s,
            liveness_s=liveness_s,
            on_save=on_save,
            overlap_copies=overlap_copies,
            check_replicas=check_replicas,
            after_commit=background,  # every rank re-reads its own shard: retention reads no data
        )
        self._retention = background if self._saver.rank == 0 and self._tiers is None else None
        self.rank, self.world_size = self._saver.rank, self._saver.world_size
        try:
            self._begin(background, timeout_s, liveness_s)
        except BaseException:  # nothing of a Checkpointer that does not exist may keep running
            self._saver.close()
            if self._tiers is not None:
                self._tiers.close(join_s=0.0)
            raise

    def _begin(self, background: BackgroundRetention | None, timeout_s: float, liveness_s: float) -> None:
        coord = self._saver.coordinator
        if coord is not None:
            # The post-commit check is an exchange: every rank must take part, or none.
            mine = AGREE_OK if background is not None else AGREE_SKIP
            # ``agree`` is a minimum: a rank with retention learns that one lacks it, but not
            # the reverse. The maximum too (the minimum of the flipped verdicts), so that every
            # rank refuses at once instead of one waiting in its first save for a rank that left.
            low = self._saver.collective(coord.agree, mine)
            high = AGREE_OK + AGREE_SKIP - self._saver.collective(coord.agree, AGREE_OK + AGREE_SKIP - mine)
            if low != high:
                raise UsageError(
                    f"rank {self.rank}: retention (or keep_last/keep_every) is set here but not on every rank",
                    hint="pass the same retention options to the Checkpointer on every rank",
                )
        if self._tiers is not None:  # every rank, last (no tier thread starts before all is agreed)
            self._tiers.begin(self.rank, self.world_size, coord.group.group_name if coord is not None else None,
                              timeout_s, liveness_s)

    # --- saving -----------------------------------------------------------------------------

    def prepare(self, state: dict[str, Any]) -> bool:
        """Get ready to save ``state``: plan it, and allocate the host staging buffer and fault
        it in (or pin it, for GPU state) on a background thread. The first ``save`` then stalls
        only for its copy, like every later one, instead of also paying for memory the size of
        this rank's shard (a quarter of a second per GiB on a small host; pinning is slower).

        ``load_latest`` does it itself, whether or not it resumes; call it only in a job that
        never calls ``load_latest``: once the state has its final structure, after the first
        optimizer step, well before the first save. It returns at once (the planning takes
        milliseconds) and needs no other rank. Returns False, doing nothing, when an optimizer
        in ``state`` has not stepped yet (its state does not exist, so the buffer's size is not
        known) or a large enough buffer is held or being prepared.

            >>> step = ckpt.load_latest(state) or 0           # doctest: +SKIP
            >>> train_step(); ckpt.prepare(state)              # doctest: +SKIP
        """
        return self._saver.prepare(state)

    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, float] | None = None) -> SaveHandle:
        """Snapshot ``state`` into host memory and return; the write happens in the background.

        ``metrics`` (``{"val_loss": 0.213}``): finite numbers recorded in the manifest, for
        ``KeepBest`` and ``ckptctl prune --keep-best N --metric NAME``; at most 256, names of 1 to
        128 printable characters (``ValueError`` otherwise, before anything is copied). Across
        ranks, rank 0's are recorded.

        Raises the previous save's error if it failed and nobody has seen it yet, and
        ``RefusedForSafety`` if ``step`` is already committed (a checkpoint is never overwritten).
        Across ranks, an error raised here on one rank (a state that cannot be captured) is
        reported to the others at once: their save of this step fails naming this rank.
        """
        if self._tiers is not None:
            self._tiers.durability.started(step)
            self._tiers.revive()  # a tier thread that ended unexpectedly starts again
            for t in self._tiers.health.unannounced():
                log.warning("tiers: %s", t)
        return self._saver.save(step, state, metrics)

    def health(self) -> tuple[Trouble, ...]:
        """This rank's tier threads that are not doing their work now, each with the tier it
        serves and why (a thread retrying the c10d store, one that ended and was restarted at
        the last ``save``); empty when all is well, and without tiers."""
        return self._tiers.health.troubles() if self._tiers is not None else ()

    def time_to_durable(self, step: int | None = None) -> dict[str, float]:
        """Seconds from ``save(step)`` to durable on each tier it has reached so far, by URL
        (default: the newest step recorded). Rank 0's view; empty without tiers."""
        return self._tiers.durability.of(step) if self._tiers is not None else {}

    def time_to_replicated(self, step: int | None = None) -> dict[str, float]:
        """With peer replicas (``Tier(..., node_local=True, replicas=1)``), rank 0's view:
        ``{"replicated_s": seconds from save(step) until every rank's shard was on its partner
        node, "replica_bytes": bytes all ranks sent for it}`` (default: the newest step
        replicated); empty otherwise."""
        return self._tiers.durability.replication(step) if self._tiers is not None else {}

    def wait(self) -> str | None:
        """Wait for every pending save; returns the last committed URL, raises if it failed."""
        return self._saver.wait()

    @property
    def staging_held(self) -> bool:
        """Whether this rank holds a host staging buffer (or one is being prepared): memory
        the size of its shard, kept between saves and released by ``close``."""
        return self._saver.staging.held

    @property
    def staging_pinned(self) -> bool:
        """Whether that buffer is page-locked (GPU state is staged in pinned memory)."""
        return self._saver.staging.pinned

    @property
    def staging_pinned_bytes(self) -> int:
        """Bytes of that buffer page-locked now: exactly the shard's size (plus less than
        ``CKPTCTL_STAGING_ALIGN`` bytes of alignment per GPU tensor), or 0 (CPU state, a
        failed pin that fell back to ordinary memory, or after ``close``)."""
        return self._saver.staging.pinned_bytes

    # --- loading ----------------------------------------------------------------------------

    def load(self, path: "str | Storage", state: dict[str, Any], *, strict: bool = True, prepare: bool = True) -> int:
        """Restore ``state`` in place from the committed checkpoint at ``path``; returns its step.

        Every chunk is checked before ``state`` changes. Each byte is read once, into the
        staging buffer, when one is held (prepared, or kept from a save or a load) or the
        checkpoint is remote (S3: the buffer is made now and stays for the saves). Otherwise (a
        new process reading a local disk; ``prepare=False`` in a process that will not save)
        each chunk is read again into place, from the page cache or a local spool
        (``docs/decisions.md``, "All-or-nothing loads in one pass")."""
        ckpt = open_storage(path) if isinstance(path, str) else path
        # overlap_copies: the last save's copies may still read the tensors this load writes
        # (on the caller's stream); wait for them first, or that checkpoint mixes old and new
        # values under valid checksums.
        self._saver.staging.settle()
        spool = self._spool_dir if self._spool_dir is not None and os.path.isdir(self._spool_dir) else None
        if not prepare:
            return load_checkpoint(ckpt, state, strict=strict, rank=self.rank, spool_dir=spool)
        with self._saver.lending() as lend:
            return load_checkpoint(ckpt, state, strict=strict, rank=self.rank, spool_dir=spool, host=lend)

    def load_latest(self, state: dict[str, Any], *, strict: bool = True, prepare: bool = True) -> int | None:
        """Restore from the newest committed checkpoint; None when there is none.

        The next save is prepared (see ``prepare``) whether or not a checkpoint was found: in
        the background now, or right after every optimizer of ``state`` has stepped once
        (their state does not exist before). So the first save stalls for its copy only,
        without a ``prepare`` call. Pass ``prepare=False`` in a process that will not save (an
        evaluation), which then holds no buffer the size of its shard.

        If the newest one turns out to be corrupt while reading (a checksum mismatch, a shard
        header not bound to its manifest, a record that does not decode), the next older
        committed checkpoint is loaded instead and a warning is logged. A load is all or
        nothing (``load.into_state.load_into``): nothing of the bad one was applied, so the
        state is then exactly the older checkpoint's, RNG states included; and when none
        loads (None), ``state`` is as it was passed in.

        Across ranks the choice is collective: rank 0 lists the candidates and every rank
        uses its list, and a checkpoint counts as loaded only when every rank loaded its part
        of it; if any rank found its part corrupt, every rank moves on to the next older one
        together, so no two ranks ever resume from different steps.
        """
        step = load_newest(self._saver, self._tiers, self._roots,
                           lambda ckpt: self.load(ckpt, state, strict=strict, prepare=prepare))
        if prepare:
            self._saver.prepare_when_stepped(state)
        return step

    # --- lifetime ---------------------------------------------------------------------------

    def close(self, promote_timeout_s: float | None = None) -> Flushed | None:
        """Wait for pending saves, release the thread and buffers. Raises a failed save's
        error if nobody has seen it.

        With tiers (rank 0): then waits up to ``promote_timeout_s`` (default: the constructor's)
        for the newest checkpoint to reach the last tier, and returns what it found
        (``Flushed``: true when it got there); a warning is logged when it did not. Returns
        None without tiers, on other ranks, and when already closed.

        A node-local first tier talks through the c10d store; once it is unreachable for
        ``CKPTCTL_CLOSE_STORE_TIMEOUT`` seconds (default 60) after close began (its host, node
        0's torchrun agent, exited: the job is being torn down), close stops waiting for it on
        every rank: rank 0's ``Flushed`` names the step that did not reach the next tier and
        why, a warning names it (and an unfinished peer replica) on every rank, and what the
        first tier holds stays valid for ``load_latest``."""
        if self._saver.closed:
            return None
        flushed = None
        try:
            self._saver.close()
        finally:
            if self._retention is not None:
                self._retention.close()
            if self._tiers is not None:
                flushed = self._close_tiers(promote_timeout_s)
        return flushed

    def _close_tiers(self, timeout_s: float | None) -> Flushed | None:
        assert self._tiers is not None
        timeout = self.promote_timeout_s if timeout_s is None else timeout_s
        try:
            if self.rank != 0:
                self._tiers.release(timeout + RELEASE_MARGIN_S)  # node-local: serve rank 0's last round
                return None
            flushed = replace(self._tiers.flush(timeout), troubles=self._tiers.health.troubles())
            if not flushed:
                log.warning("close: step %d did not reach %s: %s; it is on %s, which a later load_latest resumes "
                            "from", flushed.step, flushed.missing, flushed.reason, ", ".join(flushed.tiers))
            for t in flushed.troubles:
                log.warning("close: tiers: %s", t)
            return flushed
        finally:
            self._tiers.close()

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
