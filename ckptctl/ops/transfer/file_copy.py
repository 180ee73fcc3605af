"""``cp`` and ``sync`` of a checkpoint that is one file (Lightning's ``*.ckpt``, Composer's
``*.pt``): copied whole through one atomic writer, so a copy cut short is never a file at the
destination, then checked there as ``verify`` will judge it (the CRC-32 of every zip record).
A file of that name already at the destination is left as is: "already present" when it holds
the same bytes, refused otherwise.
"""

from __future__ import annotations

import time

from ckptctl.errors import InvalidCheckpoint, NotFound, RefusedForSafety
from ckptctl.layouts.registry import layout_named
from ckptctl.ops.verify.engine import verify
from ckptctl.ops.transfer.stack_copy import StackSource, describe, source_problems
from ckptctl.ops.transfer.copy import CopyResult
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import StoredFile, open_file


def copy_stack_file(src: StackSource, dst_root: Storage, progress: Progress | None = None) -> CopyResult:
    """Copy a checkpoint that is one file (Lightning's ``.ckpt``) under ``dst_root``, whole,
    through one atomic writer (a copy cut short is never a file at DST), then check it there as
    ``verify`` will (its zip records' CRC-32s). A file of that name already at DST is left as
    is: "already present" when it has the same bytes, else RefusedForSafety."""
    t0 = time.perf_counter()
    result = CopyResult(src.storage.url, dst_root.url_of(src.name), src.step, "copied", layout=src.layout.name,
                        note="copied whole, then its zip records' CRC-32s checked at the destination")
    problems = source_problems(src)
    if problems:
        raise InvalidCheckpoint(describe(problems, src.storage.url), hint=problems[0].hint or "copy an older checkpoint")
    source = open_file(src.storage, "")
    if source is None:
        raise NotFound(f"{src.storage.url} is gone", hint="it was deleted while being copied")
    with source:
        there = dst_root.stat(src.name)
        if there is not None:
            if there.kind == "file" and _same_bytes(source, dst_root, src.name):
                result.status, result.files = "already present", 1
                result.seconds = time.perf_counter() - t0
                return result
            raise RefusedForSafety(f"{result.dst} already holds another file under this checkpoint's name",
                                   hint="choose another destination, or delete that file first")
        writer = dst_root.open_writer(src.name)
        try:
            source.seek(0)
            while piece := source.read(64 << 20):
                writer.write(piece)
                result.bytes_copied += len(piece)
                if progress is not None:
                    progress(len(piece))
        except BaseException:
            writer.abort()
            raise
        writer.commit()
    result.files = 1
    copy = dst_root.sub(src.name)
    problems = verify(copy, layout_named(src.layout.name, dst_root), "checksums").problems
    if problems:
        dst_root.delete(src.name)
        raise InvalidCheckpoint(describe(problems, f"{result.dst} (the copy, verified)"),
                                hint="the source changed while it was copied, or does not verify either")
    result.seconds = time.perf_counter() - t0
    return result


def _same_bytes(source: StoredFile, dst_root: Storage, name: str) -> bool:
    """Whether ``dst_root``'s file ``name`` holds exactly ``source``'s bytes (both read)."""
    other = open_file(dst_root, name)
    if other is None:
        return False
    with other:
        if other.size != source.size:
            return False
        source.seek(0)
        while piece := source.read(8 << 20):
            if other.read(len(piece)) != piece:
                return False
    return True
