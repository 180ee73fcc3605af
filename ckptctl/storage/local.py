"""The POSIX backend: a checkpoint root on a local or shared filesystem.

Safety rests on two rules:

* **No links below the root.** Every operation walks from the root one component at a time
  with ``openat(..., O_NOFOLLOW)``, so a symlink planted inside a checkpoint (to ``/etc``, to
  another job's data) is refused rather than followed, and a link swapped in between a check
  and a use is refused too: there is no separate check to race. The root itself may be a
  symlink: users point ``/ckpt`` at a big volume.
* **Nothing is visible until it is durable.** Writers fill a hidden temporary file in the final
  directory and ``commit`` = fsync the file, rename it over the final name, fsync the
  directory. A crash leaves at most a ``.NAME.tmp-PID-RANDOM`` file, never a short file under
  the real name. New directories are fsynced into their parents so a fresh step directory
  survives a power cut together with its files.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from typing import Iterator

from ckptctl.errors import CkptError, InvalidCheckpoint, NotFound, StorageError
from ckptctl.storage.base import (
    EntryKind,
    ObjectInfo,
    Reader,
    Storage,
    Writer,
    byte_view,
    check_key,
)

# Opening a directory component: never follow a link, never leak the fd into a child process.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK so that a FIFO planted under a checkpoint name cannot hang the reader in open();
# it has no effect on regular files, which are all we accept.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_LINK_REFUSED = "is a symlink; ckptctl does not follow links inside a checkpoint"
_LINK_HINT = "replace the link with the real file or directory, or point the root at the target"

# The key does not exist, or a component of its path is a file rather than a directory.
_MISSING = (FileNotFoundError, NotADirectoryError)

# Filesystems without hard links (some FUSE and SMB mounts) answer link() with these.
_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}


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
        return InvalidCheckpoint(f"{shown} {_LINK_REFUSED}", hint=_LINK_HINT)
    reason = err.strerror or str(err)
    return StorageError(f"{shown}: {reason}", hint="check the filesystem (mount, health) and retry")


@contextmanager
def _mapped(shown: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise os_error(err, shown) from err


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _makedirs_durable(path: str) -> None:
    """``mkdir -p path``, fsyncing the parent of every directory it creates."""
    missing: list[str] = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue  # a concurrent rank created it first
        _fsync_dir_path(os.path.dirname(directory))


def _fsync_dir_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if _HAVE_PREADV:
        # preadv fills the caller's buffer in place and drops the GIL while it waits.
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, min(len(view), 64 << 20), offset)  # platforms without preadv
    view[: len(data)] = data
    return len(data)


_HAVE_PREADV = hasattr(os, "preadv")


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
            with _mapped(self._shown):
                got = _pread_into(fd, view[done:], offset + done)
            if got == 0:
                with _mapped(self._shown):
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
        _close(fd)

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
        # Long names are cut so the temporary name stays within NAME_MAX (255).
        self._tmp = f".{name[:180]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        with _mapped(shown):
            self._fd: int | None = os.open(self._tmp, _CREATE_FLAGS, 0o666, dir_fd=dir_fd)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._require_open()
        view = byte_view(data)
        pos = 0
        try:
            while pos < len(view):
                # os.write may write less than asked (Linux caps one call near 2 GiB); slicing a
                # memoryview does not copy, so the caller's buffer goes to the kernel as is.
                pos += os.write(fd, view[pos:])
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err

    def commit(self) -> None:
        """fsync the file, rename it over the final name, fsync the directory."""
        fd = self._require_open()
        dir_fd = self._dir_fd
        assert dir_fd is not None
        try:
            os.fsync(fd)
            self._fd = None
            os.close(fd)
            os.rename(self._tmp, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err
        self._close_dir()

    def commit_if_absent(self) -> bool:
        """Publish under the final name only if nothing has that name; False if something did.

        ``link()`` fails with EEXIST atomically, like O_EXCL, but the name appears with its
        full, fsynced content, so a concurrent reader never sees a half-written marker or lock.
        Filesystems without hard links fall back to O_EXCL + write (content briefly partial).
        """
        fd = self._require_open()
        dir_fd = self._dir_fd
        assert dir_fd is not None
        try:
            os.fsync(fd)
            try:
                os.link(self._tmp, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                created = True
            except FileExistsError:
                created = False
            except OSError as err:
                if err.errno not in _NO_HARDLINKS:
                    raise
                created = self._copy_exclusive(fd, dir_fd)
            self._fd = None
            os.close(fd)
            os.unlink(self._tmp, dir_fd=dir_fd)
            os.fsync(dir_fd)
        except OSError as err:
            self._discard()
            raise os_error(err, self._shown) from err
        self._close_dir()
        return created

    def _copy_exclusive(self, tmp_fd: int, dir_fd: int) -> bool:
        try:
            out = os.open(self._name, _CREATE_FLAGS, 0o666, dir_fd=dir_fd)
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
            _close(fd)
            os.unlink(self._tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass  # commit had renamed or linked it already
        finally:
            self._close_dir()

    def _close_dir(self) -> None:
        dir_fd, self._dir_fd = self._dir_fd, None
        _close(dir_fd)

    def _require_open(self) -> int:
        if self._fd is None:
            raise ValueError(f"writer for {self._shown} is already committed or aborted")
        return self._fd


class LocalStorage(Storage):
    """Files below a directory. ``path`` need not exist yet; the first write creates it."""

    def __init__(self, path: str | os.PathLike[str], *, url: str | None = None) -> None:
        self._base = os.path.abspath(os.fspath(path))
        self._top_url = (url if url is not None else os.fspath(path)).rstrip("/") or "/"
        # Components between the user's root and this storage's root (set by ``sub``); they are
        # walked without following links like any key, so a sub() cannot escape either.
        self._prefix: tuple[str, ...] = ()
        self.url = self._top_url

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    # --- addressing -----------------------------------------------------------------------

    def sub(self, key: str) -> "LocalStorage":
        key = check_key(key)
        child = LocalStorage.__new__(LocalStorage)
        child._base = self._base
        child._top_url = self._top_url
        child._prefix = self._prefix + tuple(key.split("/"))
        child.url = self.url_of(key)
        return child

    def local_path(self, key: str = "") -> str:
        """The absolute filesystem path of ``key`` (below the root as given, not resolved)."""
        return os.path.join(self._base, *self._parts(key))

    def _parts(self, key: str) -> tuple[str, ...]:
        key = check_key(key, allow_empty=True)
        return self._prefix + (tuple(key.split("/")) if key else ())

    def _shown(self, parts: tuple[str, ...]) -> str:
        return "/".join((self._top_url.rstrip("/"), *parts)) if parts else self._top_url

    def _open_dir(self, parts: tuple[str, ...], *, create: bool) -> int:
        """An fd for the directory ``parts`` below the root, never following a link.

        Raises FileNotFoundError/NotADirectoryError when absent (and not ``create``), and
        InvalidCheckpoint naming the first component that is a symlink.
        """
        try:
            fd = os.open(self._base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            _makedirs_durable(self._base)
            fd = os.open(self._base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for depth, part in enumerate(parts):
            try:
                child = self._open_child_dir(fd, part, parts[: depth + 1], create=create)
            finally:
                os.close(fd)
            fd = child
        return fd

    def _open_child_dir(self, fd: int, part: str, parts: tuple[str, ...], *, create: bool) -> int:
        """Open ``part`` inside ``fd``; ``parts`` locates it for messages."""
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
                os.fsync(fd)  # the new directory entry must survive a crash
            except FileExistsError:
                pass  # another rank won the race; use its directory
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except NotADirectoryError:
            # O_NOFOLLOW|O_DIRECTORY on a symlink fails with ENOTDIR, as on a plain file.
            if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                raise InvalidCheckpoint(
                    f"{self._shown(parts)} {_LINK_REFUSED}", hint=_LINK_HINT
                ) from None
            raise

    def _open_parent(self, key: str, *, create: bool) -> tuple[int, str]:
        parts = self._parts(check_key(key))
        return self._open_dir(parts[:-1], create=create), parts[-1]

    # --- listing ---------------------------------------------------------------------------

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        parts = self._parts(prefix)
        shown = self._shown(parts)
        with _mapped(shown):
            try:
                fd = self._open_dir(parts, create=False)
            except _MISSING:
                return []
            try:
                found = []
                with os.scandir(fd) as it:
                    for entry in it:
                        try:
                            found.append(self._info(prefix, entry))
                        except _MISSING:
                            continue  # deleted while we listed (a concurrent prune)
            finally:
                os.close(fd)
        return sorted(found, key=lambda info: info.key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Files and links below ``prefix``, depth first, in the byte order of their keys
        (the order S3 lists in); never descends into a symlinked directory."""
        parts = self._parts(prefix)
        with _mapped(self._shown(parts)):
            try:
                fd = self._open_dir(parts, create=False)
            except _MISSING:
                return
        yield from self._walk(fd, prefix)

    def _walk(self, fd: int, prefix: str) -> Iterator[ObjectInfo]:
        """Yield below the directory ``fd`` (closed when done); ``prefix`` is its key."""
        try:
            with _mapped(self._shown(self._parts(prefix))):
                entries = _sorted_entries(fd)
            for entry in entries:
                key = f"{prefix}/{entry.name}" if prefix else entry.name
                if not entry.is_dir(follow_symlinks=False):
                    with _mapped(self._shown(self._parts(key))):
                        try:
                            info = self._info(prefix, entry)
                        except _MISSING:
                            continue  # deleted while we listed (a concurrent prune)
                    yield info
                    continue
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except _MISSING:
                    continue  # removed, or swapped for a link, since scandir saw it
                yield from self._walk(child, key)
        finally:
            os.close(fd)

    @staticmethod
    def _info(prefix: str, entry: os.DirEntry[str]) -> ObjectInfo:
        st = entry.stat(follow_symlinks=False)
        key = f"{prefix}/{entry.name}" if prefix else entry.name
        return ObjectInfo(key=key, size=_size(st), mtime=st.st_mtime, kind=_kind(st))

    def stat(self, key: str) -> ObjectInfo | None:
        key = check_key(key)
        with _mapped(self._shown(self._parts(key))):
            try:
                fd, name = self._open_parent(key, create=False)
            except _MISSING:
                return None
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except _MISSING:
                return None
            finally:
                os.close(fd)
        return ObjectInfo(key=key, size=_size(st), mtime=st.st_mtime, kind=_kind(st))

    # --- reading and writing ---------------------------------------------------------------

    def open_reader(self, key: str) -> LocalReader:
        shown = self._shown(self._parts(key))
        with _mapped(shown):
            fd, name = self._open_parent(key, create=False)
            try:
                file_fd = os.open(name, _READ_FLAGS, dir_fd=fd)
            finally:
                os.close(fd)
            try:
                mode = os.fstat(file_fd).st_mode
                if not stat.S_ISREG(mode):
                    what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                    raise InvalidCheckpoint(
                        f"{shown} is {what}, expected a file",
                        hint="the checkpoint layout was altered; treat it as untrusted",
                    )
                return LocalReader(file_fd, shown)
            except BaseException:
                os.close(file_fd)
                raise

    def open_writer(self, key: str) -> LocalWriter:
        shown = self._shown(self._parts(key))
        with _mapped(shown):
            fd, name = self._open_parent(key, create=True)
        try:
            return LocalWriter(fd, name, shown)
        except BaseException:
            os.close(fd)
            raise

    def write_atomic(self, key: str, data: bytes) -> None:
        with self.open_writer(key) as writer:
            writer.write(data)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        writer = self.open_writer(key)
        try:
            writer.write(data)
        except BaseException:
            writer.abort()
            raise
        return writer.commit_if_absent()

    # --- removing --------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Unlink one file or link (never a link's target); refuses directories."""
        shown = self._shown(self._parts(key))
        with _mapped(shown):
            try:
                fd, name = self._open_parent(key, create=False)
            except _MISSING:
                return False
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise StorageError(
                        f"{shown} is a directory; delete removes files only",
                        hint="delete the files inside it, then call remove_dir",
                    )
                os.unlink(name, dir_fd=fd)
                # Durable, so that a marker removed first stays removed after a crash.
                os.fsync(fd)
            except _MISSING:
                return False
            finally:
                os.close(fd)
        return True

    def remove_dir(self, prefix: str) -> None:
        """Remove empty directories below and including ``prefix``, bottom-up.

        Non-empty directories (and anything holding a file or link) are left alone without an
        error. Links are never followed or removed. The user's root itself (``prefix == ""`` on
        a storage that is not a ``sub``) is emptied of empty directories but kept.
        """
        parts = self._parts(prefix)
        shown = self._shown(parts)
        with _mapped(shown):
            try:
                parent = self._open_dir(parts[:-1], create=False) if parts else None
                if parent is None:
                    target = self._open_dir((), create=False)
                else:
                    try:
                        target = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
                    except BaseException:
                        os.close(parent)
                        raise
            except _MISSING:
                return  # absent, a file, or a link: nothing of ours to remove
            try:
                _remove_empty_below(target)
            finally:
                os.close(target)
            if parent is not None:
                try:
                    _rmdir_if_empty(parent, parts[-1])
                finally:
                    os.close(parent)


def _sorted_entries(fd: int) -> list[os.DirEntry[str]]:
    # A directory sorts as "name/" so that a depth-first walk yields keys in plain string
    # order ("a.txt" < "a/b" < "a0"), the order S3 lists keys in.
    with os.scandir(fd) as it:
        entries = list(it)
    return sorted(entries, key=lambda e: e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)


def _remove_empty_below(fd: int) -> None:
    removed = False
    for entry in _sorted_entries(fd):
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
        except _MISSING:
            continue
        try:
            _remove_empty_below(child)
        finally:
            os.close(child)
        removed |= _rmdir_if_empty(fd, entry.name, fsync=False)
    if removed:
        os.fsync(fd)


def _rmdir_if_empty(dir_fd: int, name: str, *, fsync: bool = True) -> bool:
    try:
        # rmdir() refuses links (ENOTDIR) and non-empty directories; it never follows.
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR, errno.EBUSY):
            return False
        raise
    if fsync:
        os.fsync(dir_fd)
    return True


def _kind(st: os.stat_result) -> EntryKind:
    if stat.S_ISLNK(st.st_mode):
        return "link"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    # Sockets, FIFOs and devices are reported as files so that they are seen, not hidden;
    # open_reader refuses them.
    return "file"


def _size(st: os.stat_result) -> int:
    return 0 if stat.S_ISDIR(st.st_mode) else st.st_size
