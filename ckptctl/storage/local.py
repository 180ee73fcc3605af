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

This module holds ``LocalStorage``: addressing, the no-follow walk from the root, listing,
stat and removal. ``local_io`` holds the file ``LocalReader`` and ``LocalWriter``,
``local_fs`` the filesystem primitives (open flags, durable mkdir, empty-directory removal)
and ``local_errors`` the translation of ``OSError``.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Iterator

from ckptctl.errors import InvalidCheckpoint, NotFound, StorageError
from ckptctl.storage.base import ObjectInfo, Storage, check_key
from ckptctl.storage.local_errors import LINK_HINT, LINK_REFUSED, MISSING, mapped, os_error
from ckptctl.storage.local_fs import (
    DIR_FLAGS,
    READ_FLAGS,
    makedirs_durable,
    remove_empty_below,
    rmdir_if_empty,
    sorted_entries,
    stat_info,
)
from ckptctl.storage.local_io import LocalReader, LocalWriter

__all__ = ["LocalReader", "LocalStorage", "LocalWriter", "os_error"]


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
        child = type(self).__new__(type(self))  # a subclass (a test's faulty disk) stays one
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
            makedirs_durable(self._base)
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
            return os.open(part, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
                os.fsync(fd)  # the new directory entry must survive a crash
            except FileExistsError:
                pass  # another rank won the race; use its directory
            return os.open(part, DIR_FLAGS, dir_fd=fd)
        except NotADirectoryError:
            # O_NOFOLLOW|O_DIRECTORY on a symlink fails with ENOTDIR, as on a plain file.
            if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                raise InvalidCheckpoint(
                    f"{self._shown(parts)} {LINK_REFUSED}", hint=LINK_HINT
                ) from None
            raise

    def _open_parent(self, key: str, *, create: bool) -> tuple[int, str]:
        parts = self._parts(check_key(key))
        return self._open_dir(parts[:-1], create=create), parts[-1]

    # --- listing ---------------------------------------------------------------------------

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        parts = self._parts(prefix)
        shown = self._shown(parts)
        with mapped(shown):
            try:
                fd = self._open_dir(parts, create=False)
            except MISSING:
                return []
            try:
                found = []
                with os.scandir(fd) as it:
                    for entry in it:
                        try:
                            found.append(self._info(prefix, entry))
                        except MISSING:
                            continue  # deleted while we listed (a concurrent prune)
            finally:
                os.close(fd)
        return sorted(found, key=lambda info: info.key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Files and links below ``prefix``, depth first, in the byte order of their keys
        (the order S3 lists in); never descends into a symlinked directory."""
        parts = self._parts(prefix)
        with mapped(self._shown(parts)):
            try:
                fd = self._open_dir(parts, create=False)
            except MISSING:
                return
        yield from self._walk(fd, prefix)

    def _walk(self, fd: int, prefix: str) -> Iterator[ObjectInfo]:
        """Yield below the directory ``fd`` (closed when done); ``prefix`` is its key."""
        try:
            with mapped(self._shown(self._parts(prefix))):
                entries = sorted_entries(fd)
            for entry in entries:
                key = f"{prefix}/{entry.name}" if prefix else entry.name
                if not entry.is_dir(follow_symlinks=False):
                    with mapped(self._shown(self._parts(key))):
                        try:
                            info = self._info(prefix, entry)
                        except MISSING:
                            continue  # deleted while we listed (a concurrent prune)
                    yield info
                    continue
                try:
                    child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                except MISSING:
                    continue  # removed, or swapped for a link, since scandir saw it
                yield from self._walk(child, key)
        finally:
            os.close(fd)

    @staticmethod
    def _info(prefix: str, entry: os.DirEntry[str]) -> ObjectInfo:
        st = entry.stat(follow_symlinks=False)
        key = f"{prefix}/{entry.name}" if prefix else entry.name
        return stat_info(key, st)

    def stat(self, key: str) -> ObjectInfo | None:
        key = check_key(key)
        with mapped(self._shown(self._parts(key))):
            try:
                fd, name = self._open_parent(key, create=False)
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                finally:
                    os.close(fd)
            except MISSING:
                return None
            except OSError as err:
                # A name longer than the filesystem allows (a hostile sidecar naming a file):
                # nothing can be there, which is an answer, not a storage failure (exit 3).
                if err.errno == errno.ENAMETOOLONG:
                    return None
                raise
        return stat_info(key, st)

    # --- reading and writing ---------------------------------------------------------------

    def open_reader(self, key: str) -> LocalReader:
        shown = self._shown(self._parts(key))
        with mapped(shown):
            try:
                fd, name = self._open_parent(key, create=False)
            except NotADirectoryError:  # a parent is a file: no such key, as stat() says
                raise NotFound(f"{shown}: no such file (a directory on its path is a file)",
                               hint="check the path") from None
        return self._open_file(fd, name, shown)

    def open_root_reader(self) -> LocalReader:
        shown = self._shown(self._prefix)
        with mapped(shown):
            if not self._prefix:  # the user named the file itself (``verify epoch=3-step=9.ckpt``)
                head, name = os.path.split(self._base)
                fd = os.open(head or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            else:
                fd, name = self._open_dir(self._prefix[:-1], create=False), self._prefix[-1]
        return self._open_file(fd, name, shown)

    def _open_file(self, fd: int, name: str, shown: str) -> LocalReader:
        """Open the regular file ``name`` in the directory ``fd`` (closed here) for reading."""
        with mapped(shown):
            try:
                file_fd = os.open(name, READ_FLAGS, dir_fd=fd)
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
        with mapped(shown):
            fd, name = self._open_parent(key, create=True)
        try:
            return LocalWriter(fd, name, shown)
        except BaseException:
            os.close(fd)
            raise

    def write_atomic(self, key: str, data: bytes) -> None:
        with self.open_writer(key) as writer:
            writer.write(data)

    def compare_and_swap(self, key: str, expected: bytes | None, data: bytes) -> bytes | None:
        return self._filled(key, data).commit_if(expected)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        return self._filled(key, data).commit_if_absent()

    def _filled(self, key: str, data: bytes) -> LocalWriter:
        """A writer for ``key`` holding ``data``, not committed yet (nothing left if writing fails)."""
        writer = self.open_writer(key)
        try:
            writer.write(data)
        except BaseException:
            writer.abort()
            raise
        return writer

    # --- removing --------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Unlink one file or link (never a link's target); refuses directories."""
        shown = self._shown(self._parts(key))
        with mapped(shown):
            try:
                fd, name = self._open_parent(key, create=False)
            except MISSING:
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
            except MISSING:
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
        with mapped(shown):
            try:
                parent = self._open_dir(parts[:-1], create=False) if parts else None
                if parent is None:
                    target = self._open_dir((), create=False)
                else:
                    try:
                        target = os.open(parts[-1], DIR_FLAGS, dir_fd=parent)
                    except BaseException:
                        os.close(parent)
                        raise
            except MISSING:
                return  # absent, a file, or a link: nothing of ours to remove
            try:
                remove_empty_below(target)
            finally:
                os.close(target)
            if parent is not None:
                try:
                    rmdir_if_empty(parent, parts[-1])
                finally:
                    os.close(parent)
