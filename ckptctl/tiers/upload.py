"""One rank's part of a promotion: the shard files it wrote, copied from its node's first tier
to the next tier, every byte checked on the way.

The same check as ``ops.transfer.copy.copy_checkpoint`` does per file (header bound to the manifest,
each chunk's checksum, the file checksum the manifest records), read once and written from the
same pieces: a file whose bytes do not check out is aborted at the destination, never
published. No manifest, no marker: those are rank 0's, once every rank's files are durable.

May import: ``layouts.shard_scan``, ``ops.transfer.uploads``, ``layouts.checked``, ``format``, ``storage``, leaves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.storage.base import Storage


@dataclass(frozen=True)
class Uploaded:
    files: int
    bytes: int
    seconds: float


def upload_files(src: Storage, dst: Storage, manifest: Manifest, files: Sequence[FileEntry]) -> Uploaded:
    """Copy ``files`` of the checkpoint ``manifest`` describes from the directory ``src`` to the
    directory ``dst``. Raises InvalidCheckpoint when a file is missing or its bytes do not match
    the manifest (nothing of it is left at ``dst``), StorageError when either side fails."""
    t0 = time.perf_counter()
    if files:
        before_copy(dst, [f.name for f in files])  # a killed earlier promotion's open uploads
    total = 0
    for f in files:
        problems: list[Problem] = []
        header = check_file(src, f, manifest, problems)
        if header is None:
            raise InvalidCheckpoint(f"{src.url}: {problems[0]}", hint="the shard on this node's first tier is damaged or gone")
        writer = dst.open_writer(f.name)
        try:
            problems, _ = stream_file(src, f, header, sink=writer.write)
        except BaseException:
            writer.abort()
            raise
        if problems:
            writer.abort()
            raise InvalidCheckpoint(f"{src.url}: {problems[0]}", hint="the shard changed after it was written")
        writer.commit()
        total += f.size
    return Uploaded(len(files), total, time.perf_counter() - t0)
