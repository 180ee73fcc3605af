"""Opening one local file that another tool wrote, by path, without ever blocking or following
a link: the one way the layouts and the readers of other formats open such files.

``LocalStorage`` walks from a root; other tools' files are named by path (a checkpoint
directory given on the command line, a file inside it), and some of their readers (``torch.load``
with ``mmap``, ``safetensors.safe_open``) take a path, not a file object. A plain ``open`` of a
FIFO planted under a checkpoint's name would wait forever for a writer, and checking with
``stat`` first leaves a window in which the name can be swapped. So the file is opened with
``O_NONBLOCK | O_NOFOLLOW`` and checked with ``fstat`` on the descriptor; a reader that wants a
path gets ``fd_path``: ``/proc/self/fd/N`` on Linux, which reopens the very file that was
checked, never whatever the name points at by then.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_PROC_FD = "/proc/self/fd"


def open_plain(path: str) -> BinaryIO | None:
    """Open a regular file for reading without following a link and without ever blocking;
    None when there is no plain file there (missing, a symlink, a FIFO, a device, a
    directory). Other ``OSError`` (permission denied) are raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        # ELOOP: a symlink, never followed; ENXIO: a socket; EISDIR cannot happen for O_RDONLY.
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def fd_path(f: BinaryIO, path: str) -> str:
    """A path that opens the same file as the open ``f`` (for readers that take a path):
    ``/proc/self/fd/N`` where the system has it, else ``path`` itself."""
    proc = f"{_PROC_FD}/{f.fileno()}"
    return proc if os.path.isdir(_PROC_FD) else path
