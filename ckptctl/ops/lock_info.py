"""What a root lock records about its holder, and when that holder is taken to be gone.

See ``ops.lock`` for how the lock is taken, refreshed and broken.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from ckptctl.durations import format_duration
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import parse

LOCK_KEY = ".ckptctl-lock"
MAX_LOCK_BYTES = 64 << 10
_MAX_PID = (1 << 31) - 1


@dataclass(frozen=True)
class LockInfo:
    """What a lock file records about its holder."""

    host: str
    pid: int
    pid_start: str | None  # the process's start time as the kernel counts it; detects pid reuse
    started: float  # epoch seconds when the lock was taken
    refreshed: float  # epoch seconds of the holder's last sign of life
    command: str
    token: str  # random; tells this holder's lock from a later one by the same pid

    def to_json(self) -> bytes:
        return json.dumps({"format": "ckptctl-lock", "version": 1, **asdict(self)}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "LockInfo | None":
        """The holder, or None when the file is not a lock we can read (garbled, foreign, out
        of range). Keys this version does not know are ignored."""
        try:
            doc = parse.load_json(raw, LOCK_KEY, "lock file", max_bytes=MAX_LOCK_BYTES, max_depth=8)
            lock = parse.Obj(doc, LOCK_KEY, "lock file")
            if doc.get("format") != "ckptctl-lock":
                return None
            parse.check_version(doc, LOCK_KEY, "lock file", supported=1)
            return cls(
                host=lock.str("host", max_len=1024),
                # os.kill takes a C int: a pid outside it is garbage, not a process.
                pid=lock.int("pid", lo=0, hi=_MAX_PID),
                pid_start=lock.str("pid_start", max_len=64, default=None),
                started=lock.float("started", lo=0.0, hi=parse.MAX_TIME),
                refreshed=lock.float("refreshed", lo=0.0, hi=parse.MAX_TIME),
                command=lock.str("command", max_len=1 << 14),
                token=lock.str("token", max_len=256),
            )
        except InvalidCheckpoint:
            return None

    def describe(self, now: float) -> str:
        return (
            f"pid {self.pid} on {self.host} ({self.command!r}), "
            f"taken {format_duration(max(0.0, now - self.started))} ago"
        )


def _proc_start(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ")".
    fields = text.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _process_gone(pid: int, pid_start: str | None) -> bool:
    """Whether ``pid`` no longer names the process that took the lock (same host only)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, owned by another user
    if pid_start is not None:
        now_start = _proc_start(pid)
        if now_start is not None and now_start != pid_start:
            return True  # the pid was reused by a newer process
    return False


def stale_reason(info: LockInfo, *, now: float, stale_after_s: float, host: str) -> str | None:
    """Why the lock ``info`` may be broken, or None while its holder may still be working."""
    if info.host == host and _process_gone(info.pid, info.pid_start):
        return f"process {info.pid} is gone on this host"
    idle = now - info.refreshed
    if idle > stale_after_s:
        return f"no sign of life for {format_duration(idle)} (timeout {format_duration(stale_after_s)})"
    return None
