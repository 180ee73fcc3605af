"""What a killed ``seal`` or ``cp`` leaves in another tool's checkpoint directory, and removing
it before a rerun decides anything.

ckptctl writes every file of such a directory through a local writer that fills a hidden
temporary (``.NAME.tmp-PID-HEX``, ``storage.local_io.TEMPORARY``) and then renames or links it
into place. A SIGKILL between those steps leaves the temporary: beside a seal it would read as
a file "added after sealing", and a rerun that took the directory as it is would seal it, copy
it, or report a copy complete that ``verify`` then fails. So ``seal`` and ``cp`` first remove
the temporaries whose writer is gone, by that one pattern: no other tool writes these names,
and a temporary is never part of a checkpoint (it becomes one of its files only by the rename
that the kill prevented).

A temporary whose writer process is still running on this host is left alone (a concurrent
run is still writing it); one made by a process of another host sharing the filesystem cannot
be told from a dead one, and is removed: that writer's commit then fails with an error, which
loses nothing.
"""

from __future__ import annotations

import os

from ckptctl.storage.base import Storage
from ckptctl.storage.local_io import temporary_of


def writer_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (ours included: a writer of this very run)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    except OSError:
        return True  # cannot tell: leave it
    return True


def remove_temporaries(ckpt: Storage) -> list[str]:
    """Remove, at any depth of the local directory ``ckpt``, the temporaries of ckptctl writers
    that are no longer running. Returns the keys removed (nothing on object storage, where
    writes are never visible before they complete)."""
    if ckpt.local_path() is None:
        return []
    removed = []
    for info in list(ckpt.list()):
        found = temporary_of(info.key.rsplit("/", 1)[-1])
        if info.kind != "file" or found is None or writer_running(found[1]):
            continue
        if ckpt.delete(info.key):
            removed.append(info.key)
    return removed
