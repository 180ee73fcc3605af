"""A lock under a checkpoint root, so that two prunes never run at once.

The lock is one small JSON file, ``ROOT/.ckptctl-lock``, recording who holds it (host, pid,
the pid's start time, the command) and when it was taken and last refreshed. It is created with
``Storage.write_if_absent`` (a hard link or O_EXCL locally, ``If-None-Match: *`` on S3), so
exactly one of two concurrent callers creates it, on a shared filesystem as on object storage.

A lock is *stale*, and may be broken, when

* its holder ran on this host and that process is gone (no such pid, or the pid now belongs to
  a process started at another time: pids are reused), or
* its holder is this very process, which holds it no more (its release could not delete the
  file: the store refused), or
* it has not been refreshed for ``stale_after_s`` (default 6 h). A holder that works for long
  (verifying terabytes) calls :meth:`RootLock.refresh` as it goes, so only a hung or vanished
  holder ages out; this is the only rule that can apply to a holder on another host.

Breaking is serialised by a second, short-lived guard file (``.ckptctl-lock.break``, also
``write_if_absent``): only a breaker deletes a lock file, only while holding the guard, and only
after re-reading the lock and finding the same stale holder it judged. Without the guard, two
runs that both saw the same stale lock could each delete it, the second deleting the lock the
first had just taken, and both would go on to delete checkpoints. Normal acquisition never
deletes anything.

On a filesystem the lock is ``flock``ed while held, and takeable on a full disk (the usual
reason to prune): with no block for its JSON it is created empty (``O_CREAT|O_EXCL``, an inode
only). Others read an empty lock as "ask flock": unlocked and older than a few seconds means
its holder is gone. A refresh then only touches the mtime.

Limits: hosts are told apart by hostname and processes by pid, so two containers sharing a
hostname but not a pid namespace must rely on the timeout. A lock holder whose lock was broken
(it looked stale) notices at its next ``refresh`` and stops.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import asdict
from typing import Callable

from ckptctl.durations import format_duration
from ckptctl.errors import InvalidCheckpoint, LockHeld, NotFound, StorageError
from ckptctl.ops.lock_info import LOCK_KEY, MAX_LOCK_BYTES, LockInfo, _proc_start, stale_reason  # noqa: F401 (_proc_start: tests)
from ckptctl.storage.base import Storage
from ckptctl.storage.local_io import temporary_name

GUARD_KEY = ".ckptctl-lock.break"
DEFAULT_STALE_AFTER_S = 6 * 3600.0
# Breaking a lock takes milliseconds; a guard older than this was left by a breaker that died.
GUARD_STALE_AFTER_S = 300.0
# Refreshing rewrites the lock file; once a minute is plenty against a 6-hour timeout.
REFRESH_EVERY_S = 60.0
# An empty lock file younger than this may be one whose creator has not reached flock() yet.
EMPTY_LOCK_GRACE_S = 10.0
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# The tokens of the locks this process holds now. A lock file naming this very process with
# a token not here was left by a release whose delete the store refused: nothing holds it,
# and without this a long-lived process (the Checkpointer's retention) would wait out
# ``stale_after_s`` behind itself.
_HELD_HERE: set[str] = set()

log = logging.getLogger("ckptctl")


class RootLock:
    """``with RootLock(root, command="prune"):`` holds ``ROOT/.ckptctl-lock`` for the block.

    Raises ``LockHeld`` (exit 3) naming the holder when another live run holds it. ``notes``
    collects what a person should be told (a stale lock that was broken); each is also logged.
    """

    def __init__(
        self,
        root: Storage,
        *,
        command: str | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.command = command if command is not None else " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
        self.stale_after_s = stale_after_s
        self.host = socket.gethostname()
        self.notes: list[str] = []
        self._clock = clock
        self._info: LockInfo | None = None
        self._last_refresh = 0.0
        self._local = root.local_path()  # a directory on a filesystem: O_EXCL + flock
        self._fd: int | None = None  # the held lock file, flocked, while the lock is held
        self._made: dict[str, tuple[int, int]] = {}  # key -> (dev, inode) of files we created

    @property
    def held(self) -> bool:
        return self._info is not None

    def _new_info(self) -> LockInfo:
        now = self._clock()
        return LockInfo(self.host, os.getpid(), _proc_start(os.getpid()), now, now, self.command, secrets.token_hex(8))

    def _read(self, key: str = LOCK_KEY) -> tuple[LockInfo | None, float] | None:
        """(holder or None if unreadable, file mtime), or None when there is no lock file."""
        info = self.root.stat(key)
        if info is None:
            return None
        if info.size > MAX_LOCK_BYTES:
            return None, info.mtime  # not a lock we can read: judged like a garbled one
        try:
            raw = self.root.read(key, max_size=MAX_LOCK_BYTES)
        except NotFound:
            return None  # released between stat and read
        except InvalidCheckpoint:  # not a regular file: as unreadable as garbled bytes
            return None, info.mtime
        return LockInfo.from_json(raw), info.mtime

    def acquire(self) -> "RootLock":
        if self._info is not None:
            raise RuntimeError("RootLock is not re-entrant")
        mine = self._new_info()
        if self._create(LOCK_KEY, mine):
            return self._took(mine)
        current = self._read()
        if current is None:  # released between our attempt and the read: try once more
            if self._create(LOCK_KEY, mine):
                return self._took(mine)
            current = self._read()
            if current is None:
                raise self._held(None, None)
        holder, mtime = current
        if holder is not None and holder.token == mine.token:  # see _holds_token
            return self._took(mine)
        reason = self._stale(holder, mtime)
        if reason is None:
            raise self._held(holder, mtime)
        return self._break(holder, mtime, reason, mine)

    def _stale(self, holder: LockInfo | None, mtime: float) -> str | None:
        now = self._clock()
        if holder is not None and holder.token not in _HELD_HERE and self._this_process(holder):
            return "this process left it when its release failed, and holds it no more"
        if holder is None:
            # Unreadable: left empty by a holder on a full disk (flock tells whether it lives),
            # or foreign or damaged (only its age can tell).
            if now - mtime > EMPTY_LOCK_GRACE_S and self._flock_free(LOCK_KEY):
                return "unreadable lock file, and no process holds it (flock)"
            idle = now - mtime
            return f"unreadable lock file untouched for {format_duration(idle)}" if idle > self.stale_after_s else None
        return stale_reason(holder, now=now, stale_after_s=self.stale_after_s, host=self.host)

    def _break(self, holder: LockInfo | None, mtime: float, reason: str, mine: LockInfo) -> "RootLock":
        guard = self._new_info()
        if not self._create(GUARD_KEY, guard) and not self._holds_token(GUARD_KEY, guard.token):
            seen = self._read(GUARD_KEY)
            if seen is None or self._clock() - seen[1] <= GUARD_STALE_AFTER_S:
                raise self._held(holder, mtime, breaking=seen is not None)
            # A breaker died holding the guard; nobody could ever break the lock while it exists.
            self.root.delete(GUARD_KEY)
            self._note(f"removed an abandoned {GUARD_KEY} left by a run that died while breaking a lock")
            if not self._create(GUARD_KEY, guard):
                raise self._held(holder, mtime, breaking=True)
        try:
            again = self._read()
            if again is None:
                # Released (or broken by someone) since we looked: a plain attempt decides.
                if self._create(LOCK_KEY, mine):
                    return self._took(mine)
                again = self._read()
                raise self._held(again[0] if again else None, again[1] if again else None)
            if (again[0].token if again[0] else again[1]) != (holder.token if holder else mtime):
                raise self._held(again[0], again[1])  # someone else holds a new lock
            self.root.delete(LOCK_KEY)
            who = holder.describe(self._clock()) if holder else "an unknown holder"
            self._note(f"broke a stale lock held by {who}: {reason}")
            if not self._create(LOCK_KEY, mine):
                # A plain acquire slipped in between our delete and our write: it holds it.
                again = self._read()
                raise self._held(again[0] if again else None, again[1] if again else None)
            return self._took(mine)
        finally:
            self._delete_if_ours(GUARD_KEY, guard.token)

    def _holds_token(self, key: str, token: str) -> bool:
        """Whether ``key`` holds ``token``: a create that "failed" because its own conditional
        write had landed and only its answer was lost (botocore's retry met it: 412)."""
        found = self._read(key)
        return found is not None and found[0] is not None and found[0].token == token

    def _this_process(self, holder: LockInfo) -> bool:
        pid = os.getpid()
        return holder.host == self.host and holder.pid == pid and holder.pid_start == _proc_start(pid)

    def _took(self, mine: LockInfo) -> "RootLock":
        _HELD_HERE.add(mine.token)
        self._info = mine
        self._last_refresh = mine.refreshed
        return self

    def _held(self, holder: LockInfo | None, mtime: float | None, *, breaking: bool = False) -> LockHeld:
        now = self._clock()
        where = self.root.url_of(LOCK_KEY)
        if holder is not None:
            who = holder.describe(now)
        elif mtime is not None:
            who = f"an unreadable lock file, last written {format_duration(max(0.0, now - mtime))} ago"
        else:
            who = "another run"
        extra = "; another run is breaking it right now" if breaking else ""
        return LockHeld(
            f"{where} is held by {who}{extra}",
            hint=(
                "another prune is running: wait for it. A lock is broken automatically when its "
                f"process is gone on the same host or after {format_duration(self.stale_after_s)} "
                f"without a sign of life; if you are sure nothing runs, delete {where}"
            ),
        )

    def refresh(self) -> None:
        """Show that the holder is alive (at most once a minute), and stop if the lock was
        taken over: raises ``LockHeld`` when the file no longer holds this run's token."""
        if self._info is None:
            raise RuntimeError("refresh() without holding the lock")
        now = self._clock()
        if now - self._last_refresh < REFRESH_EVERY_S:
            return
        current = self._read()
        token_ok = current is not None and current[0] is not None and current[0].token == self._info.token
        if self._fd is not None:  # the file we created and flock; empty when the disk is full
            ours = self._is_ours(LOCK_KEY) and (token_ok or (current is not None and current[0] is None))
        else:
            ours = token_ok
        if not ours:
            holder = current[0] if current else None
            _HELD_HERE.discard(self._info.token)
            self._info = None
            raise LockHeld(
                f"{self.root.url_of(LOCK_KEY)} was taken over"
                + (f" by {holder.describe(now)}" if holder else "")
                + " while this run held it; stopping",
                hint="this run looked stale to another one (hung for longer than the lock timeout?)",
            )
        self._info = LockInfo(**{**asdict(self._info), "refreshed": now})
        if self._fd is not None:
            self._rewrite_in_place(self._fd, self._info.to_json())
        else:
            self.root.write_atomic(LOCK_KEY, self._info.to_json())
        self._last_refresh = now

    def release(self) -> None:
        info, self._info = self._info, None
        if info is not None:
            _HELD_HERE.discard(info.token)  # held no more, even if the delete below fails
        try:
            if info is not None and not self._delete_if_ours(LOCK_KEY, info.token):
                log.warning("%s was no longer ours when releasing it; left it alone", self.root.url_of(LOCK_KEY))
        finally:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)  # drops the flock

    def _delete_if_ours(self, key: str, token: str) -> bool:
        current = self._read(key)
        if key in self._made and current is not None and current[0] is None:
            # Created here and left empty by a full disk: the same inode is ours.
            if not self._is_ours(key):
                return False
            del self._made[key]
            self.root.delete(key)
            return True
        if current is None or current[0] is None or current[0].token != token:
            return False
        self.root.delete(key)
        return True

    # --- creating without free blocks (filesystems) -------------------------------------------

    def _path(self, key: str) -> str | None:
        return None if self._local is None else os.path.join(self._local, key)

    def _create(self, key: str, info: LockInfo) -> bool:
        """Create ``key`` holding ``info`` unless it exists (then False)."""
        path = self._path(key)
        if path is None:
            return self.root.write_if_absent(key, info.to_json())
        data = info.to_json()
        try:
            fd = self._link_written(path, data)  # readers never see it without its JSON
            written = fd is not None
            if fd is None:  # no block free: an empty file (an inode only), the JSON best-effort
                fd = self._open_new(path)
        except FileExistsError:
            return False
        except OSError as e:
            raise StorageError(f"cannot create {self.root.url_of(key)}: {e.strerror}",
                               hint="check the permissions of the checkpoint root") from None
        try:
            if key == LOCK_KEY:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    pass  # a breaker probing it this instant, or no flock here: the create decided
            st = os.fstat(fd)
            self._made[key] = (st.st_dev, st.st_ino)
            if not written:
                self._rewrite_in_place(fd, data)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            self._made.pop(key, None)
            raise
        if key == LOCK_KEY:
            self._fd = fd
        else:
            os.close(fd)
        return True

    def _open_new(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:  # a root not created yet (a first save's retention)
            os.makedirs(self._local or ".", exist_ok=True)
            return os.open(path, flags, 0o644)

    def _link_written(self, path: str, data: bytes) -> int | None:
        """``data`` in a temporary file hard-linked to ``path`` (FileExistsError if taken): its
        descriptor, or None when no block is free."""
        # Named as every temporary ckptctl writes, so that prune reclaims one a SIGKILL left.
        tmp = os.path.join(os.path.dirname(path), temporary_name(os.path.basename(path)))
        fd = self._open_new(tmp)
        try:
            try:
                full = os.write(fd, data) != len(data)
            except OSError as e:
                if e.errno not in _NO_SPACE:
                    raise
                full = True
            if not full:
                os.link(tmp, path)
                return fd
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        os.close(fd)
        return None

    def _rewrite_in_place(self, fd: int, data: bytes) -> None:
        """The lock's JSON over the file's content; on a full disk, empty and its mtime touched."""
        try:
            os.ftruncate(fd, 0)
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            if e.errno not in _NO_SPACE:
                raise StorageError(f"cannot write {self.root.url_of(LOCK_KEY)}: {e.strerror}",
                                   hint="check the permissions and health of the checkpoint root") from None
            try:
                os.ftruncate(fd, 0)  # an empty file reads as "ask flock", half a JSON as garbage
                os.utime(fd)
            except OSError:
                pass  # nothing more can be done without space; flock still holds the lock
            note = f"disk full: {self.root.url_of(LOCK_KEY)} was left empty; the lock is held by flock"
            if note not in self.notes:
                self._note(note)

    def _is_ours(self, key: str) -> bool:
        path = self._path(key)
        if path is None or key not in self._made:
            return False
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._made[key]

    def _flock_free(self, key: str) -> bool:
        """Whether nobody holds a flock on the file ``key`` (False when it cannot be told)."""
        path = self._path(key)
        if path is None:
            return False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except OSError:
            return False  # held (EWOULDBLOCK), or no flock here: only age can tell
        finally:
            os.close(fd)  # releases our probe's lock

    def _note(self, text: str) -> None:
        self.notes.append(text)
        log.warning("%s", text)

    def __enter__(self) -> "RootLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
