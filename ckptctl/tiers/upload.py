"""One rank's part of a promotion: the shard files it wrote, copied from its node's first tier
to the next tier by the copy engine's file copier (``ops.transfer.files.copy_files``), as ``cp`` copies
them: every byte checked on the way (header bound to the manifest, each chunk's checksum, the
file checksum), read once and written from the same pieces, published only where nothing has
its name. A file already at the next tier holding exactly its bytes (a retried round, a
relaunch) is kept, not uploaded again; a name holding other bytes (another job promoting the
same step) is refused for safety, never replaced. No manifest, no marker: those are rank 0's,
once every rank's files are durable.

May import: ``ops.transfer.files``, ``ops.transfer.uploads``, ``layouts.native``, ``format``,
``storage``, leaves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.layouts.native import files_to_copy
from ckptctl.ops.transfer.files import Ends, copy_files
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.storage.base import Storage


@dataclass(frozen=True)
class Uploaded:
    files: int
    bytes: int
    seconds: float
    reused: int = 0  # already at the next tier with their bytes proven (a retried round)


def upload_files(src: Storage, dst: Storage, manifest: Manifest, files: Sequence[FileEntry]) -> Uploaded:
    """Copy ``files`` of the checkpoint ``manifest`` describes from the directory ``src`` to the
    directory ``dst``. Raises InvalidCheckpoint when a file is missing or its bytes do not match
    the manifest (nothing of it is published at ``dst``), RefusedForSafety when a name at ``dst``
    holds other bytes, StorageError when either side fails."""
    t0 = time.perf_counter()
    names = {f.name for f in files}
    items = [item for item in files_to_copy(manifest) if item.name in names]

    def clear() -> None:  # a killed earlier promotion's open uploads, aborted beside the header checks
        before_copy(dst, [item.name for item in items])

    done = copy_files(Ends(src, dst), items, threads=1, before_writing=clear if items else None)
    for name, problems in done.problems.items():
        hint = "the shard on this node's first tier is damaged or gone" if done.before_copy else "the shard changed after it was written"
        raise InvalidCheckpoint(f"{src.url}: {problems[0]}" if problems[0].file else f"{src.url_of(name)}: {problems[0]}",
                                hint=hint)
    return Uploaded(len(items), done.bytes_copied, time.perf_counter() - t0, done.reused)
