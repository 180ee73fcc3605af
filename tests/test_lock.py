"""The lock under a root: one holder at a time, stale locks broken safely (real processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from ckptctl.errors import EXIT_OPERATIONAL, LockHeld
from ckptctl.ops.lock import GUARD_KEY, LOCK_KEY, LockInfo, RootLock, _proc_start
from ckptctl.storage import open_storage
from helpers import dead_pid

HOST = socket.gethostname()


def write_lock(root, **fields) -> None:
    now = time.time()
    doc = {"format": "ckptctl-lock", "version": 1, "host": HOST, "pid": os.getpid(), "pid_start": _proc_start(os.getpid()),
           "started": now, "refreshed": now, "command": "other prune", "token": "t0ken"}
    doc.update(fields)
    (root / LOCK_KEY).write_text(json.dumps(doc))


def test_acquire_records_holder_and_release_removes_it(tmp_path):
    with RootLock(open_storage(str(tmp_path)), command="ckptctl prune /x") as lock:
        info = LockInfo.from_json((tmp_path / LOCK_KEY).read_bytes())
        assert info is not None and info.pid == os.getpid() and info.host == HOST
        assert info.command == "ckptctl prune /x" and abs(info.started - time.time()) < 60
        assert lock.held
    assert not (tmp_path / LOCK_KEY).exists()


def test_live_holder_is_lock_held_naming_it(tmp_path):
    storage = open_storage(str(tmp_path))
    with RootLock(storage, command="cron prune"):
        with pytest.raises(LockHeld) as e:
            RootLock(storage).acquire()
    text = str(e.value)
    assert f"pid {os.getpid()}" in text and HOST in text and "cron prune" in text and "ago" in text
    assert e.value.exit_code == EXIT_OPERATIONAL


def test_holder_gone_on_this_host_is_broken_with_a_note(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=None)
    with caplog.at_level("WARNING", logger="ckptctl"):
        with RootLock(open_storage(str(tmp_path))) as lock:
            assert LockInfo.from_json((tmp_path / LOCK_KEY).read_bytes()).pid == os.getpid()
    assert f"broke a stale lock held by pid {pid}" in lock.notes[0] and f"process {pid} is gone" in lock.notes[0]
    assert "broke a stale lock" in caplog.text
    assert not (tmp_path / GUARD_KEY).exists()


def test_reused_pid_is_recognised_by_its_start_time(tmp_path):
    write_lock(tmp_path, pid=os.getpid(), pid_start="1")  # our pid, but a process started long ago
    with RootLock(open_storage(str(tmp_path))) as lock:
        assert "is gone" in lock.notes[0]


def test_other_host_is_held_until_the_timeout(tmp_path):
    storage = open_storage(str(tmp_path))
    write_lock(tmp_path, host="node-7", pid=1, refreshed=time.time() - 3600)
    with pytest.raises(LockHeld, match="node-7"):
        RootLock(storage).acquire()
    write_lock(tmp_path, host="node-7", pid=1, refreshed=time.time() - 7 * 3600)
    with RootLock(storage) as lock:
        assert "no sign of life for 7h" in lock.notes[0]


def test_timeout_is_configurable(tmp_path):
    write_lock(tmp_path, host="node-7", pid=1, refreshed=time.time() - 120)
    with RootLock(open_storage(str(tmp_path)), stale_after_s=60) as lock:
        assert lock.notes


def test_unreadable_lock_file_is_judged_by_its_age(tmp_path):
    storage = open_storage(str(tmp_path))
    (tmp_path / LOCK_KEY).write_text("garbage")
    with pytest.raises(LockHeld, match="unreadable lock file"):
        RootLock(storage).acquire()
    old = time.time() - 7 * 3600
    os.utime(tmp_path / LOCK_KEY, (old, old))
    with RootLock(storage) as lock:
        assert "unreadable lock file" in lock.notes[0]


def test_a_breaker_in_progress_blocks_others_and_an_abandoned_guard_is_cleared(tmp_path):
    storage = open_storage(str(tmp_path))
    write_lock(tmp_path, pid=dead_pid(), pid_start=None)
    (tmp_path / GUARD_KEY).write_text("{}")
    with pytest.raises(LockHeld, match="breaking it right now"):
        RootLock(storage).acquire()
    old = time.time() - 3600
    os.utime(tmp_path / GUARD_KEY, (old, old))
    with RootLock(storage) as lock:
        assert any("abandoned" in n for n in lock.notes) and any("broke a stale lock" in n for n in lock.notes)
    assert not (tmp_path / GUARD_KEY).exists()


def test_refresh_notices_a_takeover_and_release_leaves_the_new_lock(tmp_path):
    t = [time.time()]
    lock = RootLock(open_storage(str(tmp_path)), clock=lambda: t[0]).acquire()
    t[0] += 120
    lock.refresh()  # still ours: refreshed in place
    assert LockInfo.from_json((tmp_path / LOCK_KEY).read_bytes()).refreshed == t[0]
    write_lock(tmp_path, host="node-9", pid=42, token="theirs")
    t[0] += 120
    with pytest.raises(LockHeld, match="taken over by pid 42 on node-9"):
        lock.refresh()
    lock.release()
    assert LockInfo.from_json((tmp_path / LOCK_KEY).read_bytes()).token == "theirs"


CONTENDER = textwrap.dedent("""
    import sys, time
    from ckptctl.errors import LockHeld
    from ckptctl.ops.lock import RootLock
    from ckptctl.storage import open_storage
    root, start = sys.argv[1], float(sys.argv[2])
    while time.time() < start:
        pass
    try:
        with RootLock(open_storage(root), command="contender"):
            print("won", flush=True)
            time.sleep(3)
    except LockHeld:
        print("held", flush=True)
""")


@pytest.mark.parametrize("stale_first", [False, True], ids=["free", "stale-lock-to-break"])
def test_many_processes_at_once_exactly_one_wins(tmp_path, stale_first):
    root = tmp_path / "root"
    root.mkdir()
    if stale_first:  # every contender sees the same stale lock and tries to break it
        write_lock(root, pid=dead_pid(), pid_start=None)
    script = tmp_path / "contender.py"
    script.write_text(CONTENDER)
    start = time.time() + 3  # past every interpreter's start-up, so they really race
    procs = [subprocess.Popen([sys.executable, str(script), str(root), str(start)], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["held"] * 5 + ["won"]
    assert not (root / LOCK_KEY).exists() and not (root / GUARD_KEY).exists()
