"""Filesystem primitives of the POSIX backend: opening without following links, durable
directory creation (each new directory fsynced into its parent), removing empty directories
bottom-up, and what an ``lstat`` says about an entry."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from typing import Callable

from ckptctl.storage.base import EntryKind, ObjectInfo
from ckptctl.storage.local_errors import MISSING

# Opening a directory component: never follow a link, never leak the fd into a child process.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK so that a FIFO planted under a checkpoint name cannot hang the reader in open();
# it has no effect on regular files, which are all we accept.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# sync_file_range(2) flags (linux/fs.h); Python's os module does not wrap the call.
SYNC_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writeback of the range's dirty pages, do not wait
SYNC_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on disk when it returns
# Answers meaning "this file or platform cannot", not "the data is in danger".
UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP}


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn  # a ctypes.CDLL call releases the GIL while the kernel works


_SYNC_FILE_RANGE = _load_sync_file_range()


def sync_range(fd: int, offset: int, length: int, flags: int) -> bool:
    """``sync_file_range(fd, offset, length, flags)``; False when the platform or filesystem
    does not support it. Any other failure raises ``OSError``: with a wait flag the kernel
    consumes the file's writeback error, so a later fsync would no longer report it."""
    if _SYNC_FILE_RANGE is None:
        return False
    if _SYNC_FILE_RANGE(fd, offset, length, flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code))


def drop_cached(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to drop the file's clean cached pages in the range (0 = to the end); only
    pages already on disk go. Advice, never data: False when it cannot be given."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError as err:
        if err.errno in UNSUPPORTED:
            return False
        raise
    return True


def close_fd(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def makedirs_durable(path: str) -> None:
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



def sorted_entries(fd: int) -> list[os.DirEntry[str]]:
    # A directory sorts as "name/" so that a depth-first walk yields keys in plain string
    # order ("a.txt" < "a/b" < "a0"), the order S3 lists keys in.
    with os.scandir(fd) as it:
        entries = list(it)
    return sorted(entries, key=lambda e: e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)


def remove_empty_below(fd: int) -> None:
    removed = False
    for entry in sorted_entries(fd):
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
        except MISSING:
            continue
        try:
            remove_empty_below(child)
        finally:
            os.close(child)
        removed |= rmdir_if_empty(fd, entry.name, fsync=False)
    if removed:
        os.fsync(fd)


def rmdir_if_empty(dir_fd: int, name: str, *, fsync: bool = True) -> bool:
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




def stat_info(key: str, st: os.stat_result) -> ObjectInfo:
    """The entry ``key`` as an ``lstat`` (never following a link) describes it."""
    return ObjectInfo(key=key, size=_size(st), mtime=st.st_mtime, kind=_kind(st))


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
