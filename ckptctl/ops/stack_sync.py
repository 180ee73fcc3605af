"""``sync`` of other tools' checkpoints: every complete checkpoint of another stack under SRC
that DST lacks is copied by ``ops.stack_copy`` (data files, then the commit files, then the
seal, then the stack's pointer, never moved to an older step), oldest first, so DST's pointer
ends on SRC's newest complete checkpoint. One already at DST is checked, not copied again
(``stack_copy``'s "already present": the same seal and every byte matching it, or, unsealed,
the same files with the same bytes).

Lightning's checkpoints are single files: each is copied through one atomic writer and then
checked at DST as ``verify`` will judge it (its zip records' CRC-32s), so a copy cut short is
never a complete ``.ckpt``.

Cost: an unsealed checkpoint has no checksums to compare, so its copy is test-loaded at DST,
and one already present is read at both ends on every run. Seal SRC's checkpoints first
(``ckptctl seal ROOT``) and later runs check DST against the seal instead.

``--delete`` removes only ckptctl's own checkpoints (``ops.sync``): other stacks' are never
deleted by a sync, whose pointer files would otherwise have to be rewritten under their feet.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint, NotFound, RefusedForSafety
from ckptctl.layouts.stack import StackLayout
from ckptctl.ops.layout_verify import bound_layout, verify_stack
from ckptctl.ops.seal_check import hash_object
from ckptctl.ops.stack_copy import StackSource, copy_stack_checkpoint, stack_sources
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage


@dataclass(frozen=True)
class StackSynced:
    """What happened to one checkpoint of another stack (``ops.sync`` makes a ``SyncItem``)."""

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
                                   0 if present else sum(i.size for i in source.storage.list()),
                                   "something is there already; a real run checks it" if present else None))
            continue
        try:
            if source.layout.files_are_checkpoints:
                out.append(_sync_file(source, src, dst, progress))
                continue
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


def _sync_file(source: StackSource, src_root: Storage, dst_root: Storage, progress: Progress | None) -> StackSynced:
    """A one-file checkpoint (Lightning's ``.ckpt``): copied whole through one atomic writer,
    then checked at DST at the checksums level; a DST file of that name that checks out and has
    the same bytes is left as is."""
    name, layout = source.name, source.layout
    url = dst_root.url_of(name)
    there = dst_root.stat(name)
    if there is not None:
        here = hash_object(src_root, name, 64 << 20)
        theirs = hash_object(dst_root, name, 64 << 20) if there.kind == "file" else None
        if here is not None and theirs is not None and (theirs.xxh3, theirs.size) == (here.xxh3, here.size):
            return StackSynced(source.step, name, url, layout.name, "present", detail="the same bytes are there")
        raise RefusedForSafety(f"{url} holds another file under this checkpoint's name; left as is",
                               hint="delete it, or sync into another root")
    writer = dst_root.open_writer(name)
    try:
        got = hash_object(src_root, name, 64 << 20, progress=progress, sink=writer.write)
    except BaseException:
        writer.abort()
        raise
    if got is None:
        writer.abort()
        raise InvalidCheckpoint(f"{src_root.url_of(name)}: the copy was stopped", hint="sync again")
    writer.commit()
    bound: StackLayout = bound_layout(layout.name, dst_root)
    problems = verify_stack(dst_root.sub(name), bound, "checksums").problems
    if problems:
        dst_root.delete(name)
        raise InvalidCheckpoint(f"{url} (the copy, verified): {problems[0]}", hint="the source does not verify either")
    return StackSynced(source.step, name, url, layout.name, "copied", got.size)
