"""Reading and writing one file of the POSIX backend.

``LocalReader`` reads positionally from a descriptor it holds open. ``LocalWriter`` makes
nothing visible until it is durable: it fills a hidden temporary file in the final directory,
and ``commit`` = fsync the file, rename it over the final name, fsync the directory. A crash
leaves at most a ``.NAME.tmp-PID-RANDOM`` file, never a short file under the real name.

Large files are written behind (``settings.WRITE_BEHIND``): each window is handed to the disk
as soon as it is written, and the window two before it is waited for and dropped from the
page cache. This changes when bytes reach the disk, never what the commit guarantees: the fsync,
rename and directory fsync still run, in that order, before anything is visible.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from typing import Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.storage.base import Reader, Writer, byte_view
from ckptctl.storage.local_errors import mapped, os_error
from ckptctl.settings import WRITE_BEHIND, WRITE_BEHIND_LAG
from ckptctl.storage.local_fs import CREATE_FLAGS, SYNC_WAIT, SYNC_WRITE, close_fd, drop_cached, sync_range

# The one pattern of the temporaries this backend (and ``interop.torch_io``) writes: ``.NAME.tmp-PID-HEX``.
# A rerun after a kill removes leftovers by it (``ops.seal.leftovers``), so only names made here match.
TEMPORARY = re.compile(r"\.(.+)\.tmp-([0-9]+)-[0-9a-f]+\Z", re.ASCII | re.DOTALL)


def temporary_name(name: str) -> str:
    """A fresh temporary name for a file about to become ``name``: hidden, next to it. Long
    names are cut so that it stays within NAME_MAX (255)."""
    return f".{name[:180]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def temporary_of(name: str) -> tuple[str, int] | None:
    """(the name it was to become, possibly cut, the writer's pid) when ``name`` is one of
    these temporaries; None otherwise."""
    m = TEMPORARY.match(name)
    return (m.group(1), int(m.group(2))) if m is not None else None


# Filesystems without hard links (some FUSE and SMB mounts) answer link() with these.
_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if _HAVE_PREADV:
        # preadv fills the caller's buffer in place and drops the GIL while it waits.
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, min(len(view), 64 << 20), offset)  # platforms without preadv
    view[: len(data)] = data
    return len(data)


_HAVE_PREADV = hasattr(os, "preadv")


def _peek(dir_fd: int, name: str, limit: int, shown: str) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``name`` (None: no such file); never a
    link followed or a FIFO waited on."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InvalidCheckpoint(f"{shown} is a symlink; never followed",
                                    hint="replace it with a regular file by hand") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidCheckpoint(f"{shown} is not a regular file", hint="replace it with a regular file by hand")
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def _inode(dir_fd: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return None


class LocalReader(Reader):
    """Positional reads from one open file descriptor (kept open until ``close``).

    Holding the descriptor means a concurrent prune that unlinks the file cannot cut a read
    short: POSIX keeps the inode alive until the last descriptor closes.
    """

    def __init__(self, fd: int, shown: str) -> None:
        self._fd: int | None = fd
        self._shown = shown
        self.size = os.fstat(fd).st_size

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        fd = self._require_open()
        view = byte_view(out)
        want = len(view)
        done = 0
        while done < want:
            with mapped(self._shown):
                got = _pread_into(fd, view[done:], offset + done)
            if got == 0:
                with mapped(self._shown):
                    size = os.fstat(fd).st_size
                raise InvalidCheckpoint(
                    f"{self._shown}: truncated: wanted {want} bytes at offset {offset}, "
                    f"file has {size}",
                    hint="the file was cut short (interrupted copy or full disk); "
                    "restore it or use an older checkpoint",
                )
            done += got

    def close(self) -> None:
        fd, self._fd = self._fd, None
        close_fd(fd)

    def local_fd(self) -> int | None:
        return self._fd

    def _require_open(self) -> int:
        if self._fd is None:
            raise ValueError(f"reader for {self._shown} is closed")
        return self._fd


class LocalWriter(Writer):
    """Streams into a hidden temporary file next to the final name; see the module docstring."""

    def __init__(self, dir_fd: int, name: str, shown: str) -> None:
        self._dir_fd: int | None = dir_fd
        self._name = name
        self._shown = shown
        self._tmp = temporary_name(name)
        with mapped(shown):
            self._fd: int | None = os.open(self._tmp, CREATE_FLAGS, 0o666, dir_fd=dir_fd)
        self._size = 0  # bytes written so far
        self._queued = 0  # bytes before this were handed to the disk (write-behind)
        self._dropped = 0  # bytes before this are on disk and out of the page cache
        self._behind = WRITE_BEHIND > 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._require_open()
        view = byte_view(data)
        pos = 0
        # One call per window, so that write-behind follows the writes closely.
        step = WRITE_BEHIND if self._behind else len(view)
        try:
            while pos < len(view):
                # os.write may write less than asked (Linux caps one call near 2 GiB); slicing a
                # memoryview does not copy, so the caller's buffer goes to the kernel as is.
                n = os.write(fd, view[pos : pos + step])
                pos += n
                self._size += n
                if self._behind and self._size - self._queued >= WRITE_BEHIND:
                    self._write_behind(fd)
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err

    def overwrite(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` again at ``offset``, over bytes this writer already wrote (a header
        reserved before its checksums were known). POSIX only: object stores cannot."""
        fd = self._require_open()
        view = byte_view(data)
        if offset < 0 or offset + len(view) > self._size:
            raise ValueError(f"overwrite of bytes {offset}-{offset + len(view)} outside the {self._size} written")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err

    def _write_behind(self, fd: int) -> None:
        """Hand the newest window to the disk; wait for the one two windows back and drop it
        from the page cache. The disk always has a window queued beyond the one it is writing
        while this thread fills the next, so the wait rarely blocks (waiting for the window just
        before cost 10-15% of a save's time on the development VM); dirty and in-flight pages
        stay within about three windows per file."""
        if not sync_range(fd, self._queued, self._size - self._queued, SYNC_WRITE):
            self._behind = False  # not supported here: the final fsync does all the work
            return
        self._queued = self._size
        settled = self._queued - WRITE_BEHIND_LAG * WRITE_BEHIND
        if settled - self._dropped >= WRITE_BEHIND:
            # A failure here raises (and aborts the write): waiting consumed the error, so
            # the final fsync would not see it.
            sync_range(fd, self._dropped, settled - self._dropped, SYNC_WAIT)
            drop_cached(fd, self._dropped, settled - self._dropped)
            self._dropped = settled

    def commit(self) -> None:
        """fsync the file, rename it over the final name, fsync the directory."""
        fd = self._require_open()
        dir_fd = self._dir_fd
        assert dir_fd is not None
        try:
            os.fsync(fd)
            if self._behind and self._size >= WRITE_BEHIND:
                drop_cached(fd, 0, 0)  # all clean now; a save is not read back soon
            self._fd = None
            os.close(fd)
            os.rename(self._tmp, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err
        self._close_dir()

    def commit_if_absent(self) -> bool:
        """Publish under the final name only if nothing has that name; False if something did."""
        return self.publish() is not None

    def publish(self, fallbacks: Sequence[str] = ()) -> int | None:
        """See ``Writer.publish``: the final name, else the first free fallback, never replacing.

        ``link()`` fails with EEXIST atomically, like O_EXCL, but the name appears with its
        full, fsynced content, so a concurrent reader never sees a half-written marker or lock.
        Filesystems without hard links fall back to O_EXCL + write (content briefly partial).
        Against ``commit`` this costs one more call (the temporary's unlink), no more fsyncs.
        """
        names = (self._name, *fallbacks)
        if any(not n or "/" in n or n in (".", "..") for n in names):
            raise ValueError(f"fallbacks must be plain names beside {self._shown}: {list(fallbacks)}")
        fd = self._require_open()
        dir_fd = self._dir_fd
        assert dir_fd is not None
        taken: int | None = None
        try:
            os.fsync(fd)
            for i, name in enumerate(names):
                if self._link_if_absent(fd, dir_fd, name, routing=bool(fallbacks)):
                    taken = i
                    break
            self._fd = None
            os.close(fd)
            os.unlink(self._tmp, dir_fd=dir_fd)
            os.fsync(dir_fd)
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err
        self._close_dir()
        return taken

    def commit_if(self, expected: bytes | None) -> bytes | None:
        """``commit``, only while the final name holds ``expected`` (None: nothing there); see
        ``Storage.compare_and_swap``. The file is made durable first (the slow part), then the
        name is checked and replaced at once. The file it replaces stays linked under a
        temporary name until it is read again after the rename: a writer that had it open and
        wrote in place meanwhile (DeepSpeed and Megatron write their pointers so) gets its
        file back under the name. Returns what the name held when checked, or that newer
        content; ``expected`` when this writer's content took the name."""
        fd = self._require_open()
        dir_fd = self._dir_fd
        assert dir_fd is not None
        limit = len(expected or b"") + 4096
        kept: str | None = temporary_name(self._name)  # the file under the name, pinned
        try:
            os.fsync(fd)
            try:
                os.link(self._name, kept, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                kept = None
            except OSError as err:
                if err.errno not in _NO_HARDLINKS:
                    raise
                kept = None  # cannot pin it here: compared by name only
            found = _peek(dir_fd, self._name if kept is None else kept, limit, self._shown)
            if kept is not None and _inode(dir_fd, self._name) != _inode(dir_fd, kept):
                found = _peek(dir_fd, self._name, limit, self._shown)  # replaced since it was pinned
            if found != expected:
                return found
            if found is None:  # nothing was there: take the name only if nothing took it meanwhile
                if not self._link_if_absent(fd, dir_fd, self._name):
                    return _peek(dir_fd, self._name, limit, self._shown)
                os.unlink(self._tmp, dir_fd=dir_fd)
            else:
                os.rename(self._tmp, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
            if kept is not None:
                after = _peek(dir_fd, kept, limit, self._shown)
                if after != expected:  # written in place meanwhile: the newer file goes back
                    os.rename(kept, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    kept = None
                    os.fsync(dir_fd)
                    return after
            return expected
        except OSError as err:
            raise os_error(err, self._shown) from err
        finally:
            if kept is not None:
                try:
                    os.unlink(kept, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
            self._discard()  # closes it, and removes the temporary unless it took the name

    def _link_if_absent(self, fd: int, dir_fd: int, name: str, *, routing: bool = False) -> bool:
        try:
            os.link(self._tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return True
        except FileExistsError:
            if routing:
                # Another attempt's file is routed around; a directory or link under a file's
                # name is nothing ckptctl made, so the write fails naming it, not guessing.
                mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name) from None
                if stat.S_ISLNK(mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
                if not stat.S_ISREG(mode):
                    raise FileExistsError(errno.EEXIST, "exists and is not a regular file", name) from None
            return False
        except OSError as err:
            if err.errno not in _NO_HARDLINKS:
                raise
            return self._copy_exclusive(fd, dir_fd, name)

    def _copy_exclusive(self, tmp_fd: int, dir_fd: int, name: str) -> bool:
        try:
            out = os.open(name, CREATE_FLAGS, 0o666, dir_fd=dir_fd)
        except FileExistsError:
            return False
        try:
            size = os.fstat(tmp_fd).st_size
            offset = 0
            while offset < size:
                offset += os.copy_file_range(tmp_fd, out, size - offset, offset, offset)
            os.fsync(out)
        finally:
            os.close(out)
        return True

    def abort(self) -> None:
        """Remove the temporary file. Safe to call twice and after a failed write."""
        self._discard()

    def _discard(self) -> None:
        fd, self._fd = self._fd, None
        dir_fd = self._dir_fd
        if dir_fd is None:
            return
        try:
            close_fd(fd)
            os.unlink(self._tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass  # commit had renamed or linked it already
        finally:
            self._close_dir()

    def _close_dir(self) -> None:
        dir_fd, self._dir_fd = self._dir_fd, None
        close_fd(dir_fd)

    def _require_open(self) -> int:
        if self._fd is None:
            raise ValueError(f"writer for {self._shown} is already committed or aborted")
        return self._fd
