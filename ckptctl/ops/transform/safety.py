"""The safety rules a transform (``reshard``, ``convert``) keeps around what it writes.

- The target: never the source itself nor inside it, never the directory of another step; a
  target that exists is refused (``RefusedForSafety``) unless ``overwrite``, which removes a
  committed one marker first, so an interrupted overwrite never looks committed
  (``prepare_target``, ``same_place``).
- The source: verified before anything is committed, its structure first (``check_source``:
  no tensor data read), then each file's checksum from the headers a reader parsed
  (``check_source_files``); the chunks' bytes are checked as they are read
  (``reshard_source``, ``stream_shard``).
- The result: verified before success is reported; one that fails loses its marker
  (``require_verified(..., after_write=True)``).

May import what ``ops.transform`` may (``ops/transform/__init__.py``): here ``format``,
``storage``, ``load``, ``layouts``, ``ops.verify`` and the leaves.
"""

from __future__ import annotations

import os
from typing import Literal

from ckptctl.errors import InvalidCheckpoint, RefusedForSafety, UsageError
from ckptctl.format.checksum import file_checksum
from ckptctl.format.layout import MARKER
from ckptctl.layouts.checked import Level
from ckptctl.layouts.native_commit import check_target_name, remove, uncommit
from ckptctl.load.reader import CheckpointReader
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.storage.base import Storage


def prepare_target(src: Storage, dst: Storage, *, overwrite: bool | Literal["uncommitted"], step: int | None = None) -> None:
    """Refuse to write onto the source, into the directory of another step than ``step`` or,
    without ``overwrite``, onto anything that exists. With ``overwrite`` a committed target is
    removed, marker first; an uncommitted one's files (an interrupted run's) are left alone:
    the new shards are published beside them without replacing any (their names taken, under
    the attempt's own), and only the files the manifest names count. ``"uncommitted"``: the
    same, but a committed target is refused, never removed (a restore that found the step
    uncommitted, while another writer may commit it meanwhile)."""
    if same_place(src, dst):
        raise UsageError(f"{dst.url} is the source itself", hint="write the result to a new directory; the source is never modified")
    if step is not None:
        check_target_name(dst, step)
    existing = list(dst.list())
    if not existing:
        return
    if not overwrite:
        raise RefusedForSafety(f"{dst.url} already exists and holds {len(existing)} file(s)",
                               hint="choose a new directory, or pass --overwrite to replace it")
    if dst.stat(MARKER) is not None:
        if overwrite == "uncommitted":
            raise RefusedForSafety(f"{dst.url} was committed by another writer meanwhile; it was not replaced",
                                   hint=f"check it with `ckptctl verify {dst.url}`")
        remove(dst)  # marker first: an interrupted overwrite must never leave a committed-looking target


def same_place(a: Storage, b: Storage) -> bool:
    """Whether two storages are the same place, or one lies inside the other."""
    pa, pb = a.local_path(), b.local_path()
    if pa is not None and pb is not None:
        ra, rb = os.path.realpath(pa), os.path.realpath(pb)
        return ra == rb or rb.startswith(ra.rstrip("/") + "/") or ra.startswith(rb.rstrip("/") + "/")
    ua, ub = a.url.rstrip("/") + "/", b.url.rstrip("/") + "/"
    return ua.startswith(ub) or ub.startswith(ua)


def check_source(src: Storage) -> None:
    """Rank 0's check of the source before anything is written: ``quick`` (marker, manifest,
    every file present at its size, headers that agree with the manifest), no tensor data read.
    Every chunk of a source that passes has a checksum (``quick`` refuses a shard with a chunk
    without one: ``format.shard_identity``), so its data is checked chunk by chunk as it is read."""
    require_verified(src, level="quick")


def check_source_files(reader: CheckpointReader) -> None:
    """Each source file's checksum, rebuilt from the header bytes the reader parsed and the
    chunk checksums it will check the data against (the file checksum is defined that way,
    ``format.checksum.file_checksum``): the headers in use are the committed ones. The data is
    checked chunk by chunk as it is read, before anything is committed: pass 1
    (``checked_source_checksums``) checks every source chunk it reads, pass 2 checks every
    whole source chunk it copies against that chunk's checksum, and every chunk is one or the
    other. With ``check_source`` that is the whole ``checksums`` verification, each source byte
    read for it as part of a pass that reads it anyway."""
    for f in reader.manifest.files:
        h = reader.headers[f.name]
        chunks = sorted(h.chunks, key=lambda c: c.begin)
        # Every chunk has a checksum: the reader refused any header without one (shard_identity);
        # were one missing, "" makes the file checksum differ: refused, never skipped.
        if file_checksum(h.header_bytes, [c.checksum or "" for c in chunks]) != f.checksum:
            raise InvalidCheckpoint(
                f"{reader.storage.url}: the source failed verification: {f.name}: file checksum does not match the manifest",
                hint="run `ckptctl verify` on it; reshard a good checkpoint instead (`ckptctl latest`)",
            )


def require_verified(ckpt: Storage, *, level: Level = "checksums", after_write: bool = False) -> VerifyReport:
    """Verify ``ckpt``; raise InvalidCheckpoint naming the first problem. A freshly written
    target that fails loses its marker, so it never looks committed."""
    rep = verify_checkpoint(ckpt, level)
    if rep.ok:
        return rep
    if after_write:
        uncommit(ckpt)
    first = rep.problems[0]
    more = f" (and {len(rep.problems) - 1} more problem(s))" if len(rep.problems) > 1 else ""
    what = "the result" if after_write else "the source"
    raise InvalidCheckpoint(
        f"{ckpt.url}: {what} failed verification: {first}{more}",
        hint=first.hint or ("nothing was committed; check the target storage and retry" if after_write
                            else "run `ckptctl verify` on it; reshard a good checkpoint instead (`ckptctl latest`)"),
    )
