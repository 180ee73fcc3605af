"""``sync`` of other tools' checkpoints: every complete checkpoint of another stack under SRC
that DST lacks is copied by ``ops.transfer.stack_copy`` (data files, then the commit files, then the
seal, then the stack's pointer, never moved to an older step), oldest first, so DST's pointer
ends on SRC's newest complete checkpoint. One already at DST is checked, not copied again
(``stack_copy``'s "already present": the same seal and every byte matching it, or, unsealed,
the same files with the same bytes).

Lightning's checkpoints are single files: each is copied by ``file_copy.copy_stack_file``
(one atomic writer, then checked at DST as ``verify`` will judge it), so a copy cut short is
never a complete ``.ckpt``.

Cost: an unsealed checkpoint has no checksums to compare, so its copy is test-loaded at DST,
and one already present is read at both ends on every run. Seal SRC's checkpoints first
(``ckptctl seal ROOT``) and later runs check DST against the seal instead.

``--delete`` removes only ckptctl's own checkpoints (``ops.transfer.sync``): other stacks' are never
deleted by a sync, whose pointer files would otherwise have to be rewritten under their feet.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint, NotFound, RefusedForSafety
from ckptctl.ops.transfer.file_copy import copy_stack_file
from ckptctl.ops.transfer.stack_copy import StackSource, copy_stack_checkpoint, stack_sources
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import open_file


@dataclass(frozen=True)
class StackSynced:
    """What happened to one checkpoint of another stack (``ops.transfer.sync`` makes a ``SyncItem``)."""

    step: int
    name: str
    url: str
    layout: str
    action: str  # "copied", "present", "would copy", "failed"
    bytes: int = 0
    detail: str | None = None


def sync_stacks(src: Storage, dst: Storage, *, dry_run: bool, progress: Progress | None = None) -> list[StackSynced]:
    """Copy every complete checkpoint of another stack under ``src`` that ``dst`` lacks,
    oldest first (see the module's doc). A checkpoint that fails its checks is a "failed"
    item; the others go on."""
    out: list[StackSynced] = []
    for source in sorted(stack_sources(src, with_files=True), key=lambda s: (s.step, s.name)):
        target = dst.sub(source.name)
        if dry_run:
            present = dst.stat(source.name) is not None or bool(dst.children(source.name))
            out.append(StackSynced(source.step, source.name, target.url, source.layout.name,
                                   "present" if present else "would copy",
                                   0 if present else _size(source),
                                   "something is there already; a real run checks it" if present else None))
            continue
        try:
            if source.layout.files_are_checkpoints:
                copied = copy_stack_file(source, dst, progress)
            else:
                copied = copy_stack_checkpoint(source, target, dst, progress)
        except NotFound as e:
            out.append(StackSynced(source.step, source.name, target.url, source.layout.name, "failed",
                                   detail=f"gone from SRC during the sync: {e}"))
            continue
        except (InvalidCheckpoint, RefusedForSafety) as e:
            out.append(StackSynced(source.step, source.name, target.url, source.layout.name, "failed", detail=str(e)))
            continue
        action = "present" if copied.status == "already present" else "copied"
        out.append(StackSynced(source.step, source.name, target.url, source.layout.name, action,
                               copied.bytes_copied, copied.note))
    return out


def has_stack_checkpoints(src: Storage) -> bool:
    """Whether ``src`` holds a committed checkpoint of another stack (``sync --delete``'s
    empty-source check)."""
    return next(iter(stack_sources(src, with_files=True)), None) is not None


def _size(source: StackSource) -> int:
    """The bytes a copy of ``source`` reads: its files, or the one file it is."""
    if source.layout.files_are_checkpoints:
        f = open_file(source.storage, "")
        if f is None:
            return 0
        with f:
            return f.size
    return sum(i.size for i in source.storage.list())
