"""Errors of the POSIX backend: ``OSError`` translated into ckptctl's tree, and refused links."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import Iterator

from ckptctl.errors import CkptError, InvalidCheckpoint, NotFound, StorageError

LINK_REFUSED = "is a symlink; ckptctl does not follow links inside a checkpoint"
LINK_HINT = "replace the link with the real file or directory, or point the root at the target"

# The key does not exist, or a component of its path is a file rather than a directory.
MISSING = (FileNotFoundError, NotADirectoryError)


def os_error(err: OSError, shown: str) -> CkptError:
    """Translate an ``OSError`` about ``shown`` (a path as the user knows it) into our tree."""
    code = err.errno
    if code == errno.ENOENT:
        return NotFound(
            f"{shown}: no such file or directory",
            hint="check the path; the checkpoint may have been pruned or never committed",
        )
    if code in (errno.EACCES, errno.EPERM):
        return StorageError(
            f"permission denied: {shown}",
            hint=f"check that uid {os.geteuid()} may read and write {shown} and its parent directories",
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            f"disk full while writing {shown}",
            hint="free space (or raise the quota) on that filesystem and save again; "
            "the partial checkpoint is left uncommitted",
        )
    if code == errno.EROFS:
        return StorageError(
            f"read-only filesystem: {shown}",
            hint="remount it read-write or choose a root on a writable filesystem",
        )
    if code == errno.ELOOP:
        return InvalidCheckpoint(f"{shown} {LINK_REFUSED}", hint=LINK_HINT)
    reason = err.strerror or str(err)
    return StorageError(f"{shown}: {reason}", hint="check the filesystem (mount, health) and retry")


@contextmanager
def mapped(shown: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise os_error(err, shown) from err
