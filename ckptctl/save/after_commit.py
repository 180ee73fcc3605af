"""The check of each committed save by the ranks that wrote it, before anything relies on it
(library retention's: ``ops.retention.background`` implements ``AfterCommit``).

Queued on each rank's writer thread right behind the save, so no new save's write runs beside
it: every rank re-reads the shard it wrote (no rank reads another's data), the ranks agree on
one verdict, and rank 0 records the save as verified only when every shard checked out. The
prune that follows then downloads nothing (``docs/protocol.md``, step 11 of a save, "Post-commit check").
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Protocol

from ckptctl.errors import CkptError, CoordinationError
from ckptctl.format.manifest import FileEntry
from ckptctl.save.coordination import AGREE_OK, AGREE_SKIP, Coordinator
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")


class AfterCommit(Protocol):
    """A check of each committed save by the ranks that wrote it. On every rank, after the
    commit and on the writer thread: ``snapshot`` (rank 0), ``check_shard`` (every rank re-reads
    the shard it wrote; a problem as a line of text, or None), one ``agree`` over the ranks, and
    ``record`` (rank 0, only when every rank's shard checked out)."""

    def snapshot(self, ckpt: Storage) -> Any: ...

    def check_shard(self, ckpt: Storage, entry: FileEntry) -> str | None: ...

    def record(self, step: int, ckpt: Storage, snapshot: Any) -> None: ...


def check_committed(after: AfterCommit, coordinator: Coordinator | None, rank: int, step: int, ckpt: Storage,
                    save: "Future[str]", written: list[FileEntry]) -> str | None:
    """Every rank re-reads the shard it wrote; rank 0 records the save as verified when every
    rank's checked out. Returns the URL, or None when the save failed (every rank knows that
    alike, so none of them takes part in the exchange)."""
    if save.exception() is not None or not written:
        return None
    try:
        before = after.snapshot(ckpt) if rank == 0 else None
        problem = after.check_shard(ckpt, written[0])
    except CkptError as e:  # storage trouble: no verdict from this rank
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        log.error("rank %d: re-reading its shard of step %d after the commit: %s", rank, step, problem)
    ok = problem is None
    if coordinator is not None:
        try:
            ok = coordinator.agree(AGREE_OK if ok else AGREE_SKIP) == AGREE_OK
        except CoordinationError as e:
            log.warning("step %d: the ranks could not exchange their shard checks: %s", step, e)
            ok = False
    if ok and rank == 0:
        after.record(step, ckpt, before)
    return save.result()
