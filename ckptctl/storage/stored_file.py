"""One stored file as a Python file object, on every backend: how the layouts read other
tools' files (a ``trainer_state.json``, a ``torch.save`` archive, a ``.safetensors`` file)
whether the checkpoint is a local directory or an ``s3://`` prefix.

``open_file`` gives a read-only, seekable, buffered file over ``Storage.open_reader``: ranged
reads, so a zip archive's directory at the end of a 10 GB object costs one small GET, not a
download. Locally the reader holds the descriptor ``LocalStorage`` opened without following a
link or blocking on a FIFO, so what is read is the file that was checked to be regular.

Some readers take a path, not a file (``torch.load`` with ``mmap``, ``safetensors.safe_open``):
``local_copy`` gives one. Locally it is ``/proc/self/fd/N`` of the open descriptor (no copy);
on object storage the object is streamed into a temporary file in pieces, so memory stays
bounded by the piece size whatever the file's size, and the copy is removed on exit.

    with open_file(store, "trainer_state.json") as f:   # None when there is no plain file
        raw = f.read()
"""

from __future__ import annotations

import errno
import io
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

from ckptctl.errors import InvalidCheckpoint, NotFound
from ckptctl.storage.base import Reader, Storage

BUFFER = 1 << 20  # one ranged GET per MiB read sequentially (pickle and zip scans read small)
PIECE = 8 << 20  # what a spool to a temporary file holds in memory at once
_PROC_FD = "/proc/self/fd"


class _ReaderIO(io.RawIOBase):
    """``Reader`` as a raw file: ``readinto`` at the current position, ``seek`` anywhere."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._pos = 0
        self.size = reader.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            # OSError, as a real file raises: readers probing a file too short for what they
            # look for (``zipfile.is_zipfile`` seeks 22 bytes back from the end) expect it.
            raise OSError(errno.EINVAL, f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, out: memoryview) -> int:  # type: ignore[override]
        want = min(len(out), max(0, self.size - self._pos))
        if want:
            # The object shrank since it was opened: the Reader says "truncated" (corrupt).
            self._reader.read_into(self._pos, memoryview(out).cast("B")[:want])
            self._pos += want
        return want

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()


class StoredFile(io.BufferedReader):
    """A stored file opened for reading: a buffered binary file with its ``size`` and, when it
    is local, the descriptor path readers that want a path can use."""

    def __init__(self, reader: Reader, url: str) -> None:
        raw = _ReaderIO(reader)
        super().__init__(raw, BUFFER)
        self.size = raw.size
        self.url = url
        fd = reader.local_fd()
        self.fd_path = f"{_PROC_FD}/{fd}" if fd is not None and os.path.isdir(_PROC_FD) else None


def open_file(store: Storage, key: str) -> StoredFile | None:
    """``key`` under ``store`` opened for reading (``""``: the file ``store`` is rooted at, for
    a checkpoint that is one file); None when nothing is there or it is not a plain file (a symlink, a FIFO, a device, a directory: never followed, never opened).
    Environmental failures (permission denied, unreachable) raise ``StorageError``."""
    try:
        reader = store.open_reader(key) if key else store.open_root_reader()
    except (NotFound, InvalidCheckpoint):
        return None
    return StoredFile(reader, store.url_of(key))


def regular_size(store: Storage, key: str) -> int | None:
    """The size of the plain file ``key``; None when it is missing or not a plain file."""
    f = open_file(store, key)
    if f is None:
        return None
    with f:
        return f.size


@contextmanager
def local_copy(f: StoredFile) -> Iterator[str]:
    """A local path holding exactly ``f``'s bytes, for readers that take a path: the open
    descriptor's own path locally; on object storage a temporary file filled piece by piece
    (memory bounded by ``PIECE``), removed on exit. The temporary file lives in ``$TMPDIR``."""
    if f.fd_path is not None:
        yield f.fd_path
        return
    with tempfile.NamedTemporaryFile(prefix="ckptctl-", suffix=".part") as tmp:
        f.seek(0)
        left = f.size
        while left:
            piece = f.read(min(PIECE, left))
            if not piece:
                raise InvalidCheckpoint(f"{f.url}: ended early while it was copied",
                                        hint="it changed while it was read; read it again")
            tmp.write(piece)
            left -= len(piece)
        tmp.flush()
        yield tmp.name
