"""The one verify engine: any checkpoint, of any layout, at any level, checked by its layout.

``verify(ckpt, handler, level)`` asks the checkpoint's handler (its layout, or the file format
of a file named by itself: ``layouts.classify``) for its ``check`` and makes the report; every
verb that verifies goes through it (``verify``, ``latest``, prune's anchor, ``seal``'s test-load,
the pointers ``verify --latest`` judges, a copy's source and destination, ``reshard``'s).
Under a torchrun verb (``ops.distributed.current``) the check is split over the job's ranks
(``layouts.checked.Split``: each rank reads its share of the files where the layout shares
them, one rank reads it all where it does not) and every rank gets the same whole report.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence, TypeVar

from ckptctl.layouts.base import Checkpoint, numbered_by
from ckptctl.layouts.checked import ALONE, Checked, Level, Problem, Split
from ckptctl.layouts.classify import classify
from ckptctl.layouts.file_check import name_of
from ckptctl.ops.distributed import Job, attempt, current, gathered, mine
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage

T = TypeVar("T")


class Checks(Protocol):
    """What the engine asks of a handler: a layout, or a file format's (``layouts.files``)."""

    name: str

    def check(self, ckpt: Storage, level: Level, *, split: Split = ALONE,
              progress: Progress | None = None) -> Checked: ...


class _JobSplit:
    """The ranks of a torchrun job sharing one check (``ops.distributed``)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def mine(self, sizes: Sequence[int]) -> list[int]:
        return mine(self.job, sizes)

    def each(self, work: Callable[[], T]) -> list[T]:
        value, failure = attempt(work)
        return gathered(self.job, value, failure)  # type: ignore[arg-type]


def verify(ckpt: Storage, handler: Checks, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Check the checkpoint ``ckpt`` by ``handler``'s rules at ``level``; problems go in the
    report, nothing raises for them (only StorageError for storage that cannot be read, and
    UsageError for a reader that takes local paths only)."""
    t0 = time.perf_counter()
    job = current()
    checked = handler.check(ckpt, level, split=ALONE if job is None else _JobSplit(job), progress=progress)
    return VerifyReport(ckpt.url, checked, time.perf_counter() - t0, job.nodes if job is not None else (),
                        numbered_by(handler, name_of(ckpt)))  # type: ignore[arg-type]  # a file format: by step


def verify_entry(entry: Checkpoint, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Verify one catalog entry by its own layout's rules."""
    assert entry.storage is not None and entry.owner is not None, "a symlink or an unknown entry is never verified"
    return verify(entry.storage, entry.owner, level, progress)


def verify_checkpoint(ckpt: Storage, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Verify the checkpoint ``ckpt``, of whichever layout its name and files say it is
    (``layouts.classify``, asked of its URL; it is read through ``ckpt``): a path that is no
    checkpoint is a report with that problem."""
    found = classify(ckpt.url)
    if found.what in ("checkpoint", "file"):
        return verify(ckpt, found.handler, level, progress)
    why = found.reason or f"a root of {found.entries} checkpoint(s), not one checkpoint"
    return VerifyReport(ckpt.url, Checked(level, problems=[Problem(f"not a checkpoint: {ckpt.url} ({why})")]))
