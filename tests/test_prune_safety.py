"""prune on a full disk, --dry-run writing nothing, and retention by commit time.

Checkpoints with chosen commit times are saved by a real process whose clock is set to that
time (``time.time`` offset in the child only, as on a host with a wrong clock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future

import pytest
from helpers import ckpt_dir, cli, make_checkpoints, tmpfs

from ckptctl.ops.retention.policies import Candidate, KeepCalendar, from_options, implausible_times
from ckptctl.storage import open_storage

DAY = 86400.0

SAVE_AT = textwrap.dedent("""
    import json, sys, time
    import torch
    from ckptctl import Checkpointer
    real = time.time
    root, plan = sys.argv[1], json.loads(sys.argv[2])
    with Checkpointer(root) as ckpt:
        for step, when in plan:
            offset = when - real()
            time.time = lambda offset=offset: real() + offset  # this host's clock is wrong
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
            time.time = real
""")


def save_at(root: str, plan: list[tuple[int, float]]) -> None:
    """Save each (step, commit time) in a child process whose clock reads that time."""
    subprocess.run([sys.executable, "-c", SAVE_AT, root, json.dumps(plan)], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def files_under(root: str) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.relpath(os.path.join(dirpath, n), root)] = (st.st_size, st.st_mtime_ns)
    return out


# --- retention by commit time: pure --------------------------------------------------------


def test_one_checkpoint_dated_ten_years_ahead_does_not_age_out_the_rest():
    now = 1_800_000_000.0
    cands = [Candidate(s, now - 600 + s) for s in (1, 2, 3, 4)] + [Candidate(5, now + 10 * 365 * DAY)]
    decided = from_options(None, None, 7 * DAY).decide(cands, anchor_step=5, now=now)
    assert all(d.keep for d in decided.values()), decided
    assert decided[5].implausible and "future" in decided[5].implausible
    assert all("within 7d" in decided[s].reasons[0] for s in (1, 2, 3, 4))
    # Without the clock check (now unknown) the window would be measured from 10 years ahead.
    assert implausible_times(cands, None) == {}


def test_a_time_before_the_first_checkpoint_is_not_trusted():
    cands = [Candidate(1, 5000.0), Candidate(2, 6000.0), Candidate(3, 10.0), Candidate(4, 7000.0)]
    assert implausible_times(cands, 7000.0) == {3: "commit time before the first checkpoint (step 1)"}
    decided = from_options(None, None, 1500.0).decide(cands, anchor_step=4, now=7000.0)
    assert [s for s, d in decided.items() if d.keep] == [2, 3, 4]  # 3 kept as implausible, 1 aged out
    assert not decided[1].keep


@pytest.mark.parametrize("unit,n,expected", [
    ("hourly", 2, {5: "keep-hourly 2 (1970-01-02 01:00Z)", 4: "keep-hourly 2 (1970-01-02 00:00Z)"}),
    ("daily", 2, {5: "keep-daily 2 (1970-01-02)", 3: "keep-daily 2 (1970-01-01)"}),
    ("weekly", 1, {5: "keep-weekly 1 (1970-W01)"}),
    ("monthly", 3, {5: "keep-monthly 3 (1970-01)"}),
])
def test_calendar_keeps_the_newest_of_each_period(unit, n, expected):
    times = {1: 3600.0, 2: 7200.0, 3: 7300.0, 4: DAY + 60, 5: DAY + 3700}
    cands = [Candidate(s, t) for s, t in reversed(list(times.items()))]  # order must not matter
    assert KeepCalendar(unit, n).reasons(cands) == dict(sorted(expected.items()))


def test_calendar_options_combine_with_the_others_and_need_a_positive_count():
    policy = from_options(2, None, None, (), keep_daily=7, keep_monthly=12)
    assert policy.describe() == "keep-last 2, keep-daily 7, keep-monthly 12"
    from ckptctl.errors import UsageError
    with pytest.raises(UsageError, match="--keep-weekly must be at least 1"):
        from_options(None, None, None, keep_weekly=0)


# --- retention by commit time: through prune -------------------------------------------------


def test_prune_keep_within_with_a_host_clock_ten_years_ahead(tmp_path):
    root = str(tmp_path / "root")
    now = time.time()
    save_at(root, [(1, now - 30 * DAY), (2, now - 300), (3, now - 200), (4, now + 10 * 365 * DAY), (5, now - 60)])
    r = cli("prune", root, "--keep-within", "7d", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    actions = {i["step"]: (i["action"], i["reason"]) for i in doc["plan"]["items"]}
    assert [s for s, (a, _) in actions.items() if a == "delete"] == [1]  # only the month-old one
    assert "implausible commit time in the future" in actions[4][1]
    assert any("implausible" in n and "step-0000000004" in n for n in doc["plan"]["notes"])
    assert sorted(os.listdir(root)) == [".ckptctl-verified.json"] + [f"step-000000000{s}" for s in (2, 3, 4, 5)]


def test_prune_prints_the_calendar_reason_of_each_kept_checkpoint(tmp_path):
    root = str(tmp_path / "root")
    day0 = (time.time() // DAY - 10) * DAY  # midnight UTC, ten days ago
    save_at(root, [(1, day0 + 3600), (2, day0 + 7200), (3, day0 + DAY + 60), (4, day0 + 2 * DAY + 60),
                   (5, day0 + 2 * DAY + 120)])
    r = cli("prune", root, "--keep-daily", "2", "--keep-last", "1", "--dry-run")
    assert r.exit_code == 0, r.stderr
    rows = {w[0]: line for line in r.stdout.splitlines() if len(w := line.split()) > 1 and w[1] in ("keep", "delete")}
    day = lambda k: time.strftime("%Y-%m-%d", time.gmtime(day0 + k * DAY))  # noqa: E731
    assert "delete" in rows["1"] and "delete" in rows["2"] and "delete" in rows["4"]
    assert f"keep-daily 2 ({day(1)})" in rows["3"]
    assert f"keep-daily 2 ({day(2)})" in rows["5"] and "keep-last 1" in rows["5"]


# --- prune --dry-run writes nothing ----------------------------------------------------------


def test_dry_run_writes_nothing_in_a_local_root(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    before = files_under(root)
    r = cli("prune", root, "--keep-last", "1", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert "2 to delete" in r.stdout
    assert files_under(root) == before
    # A real run does record its verification (so the test above can fail).
    assert cli("prune", root, "--keep-last", "1", "--yes").exit_code == 0
    assert os.path.exists(os.path.join(root, ".ckptctl-verified.json"))


def test_dry_run_writes_nothing_on_s3(s3_url):
    import boto3

    make_checkpoints(s3_url, [1, 2, 3])
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3")

    def objects() -> dict[str, tuple[str, int]]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: (o["ETag"], o["Size"]) for p in pages for o in p.get("Contents", [])}

    before = objects()
    r = cli("prune", s3_url, "--keep-last", "1", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert objects() == before
    assert not any(k.endswith(".ckptctl-verified.json") for k in before)


# --- prune on a full disk --------------------------------------------------------------------


def _fill(mountpoint: str) -> None:
    """Write until the filesystem has no free block left."""
    with open(os.path.join(mountpoint, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass
    with pytest.raises(OSError):
        with open(os.path.join(mountpoint, "probe"), "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
            os.fsync(f.fileno())


def test_prune_works_on_a_full_disk(tmp_path):
    with tmpfs("8m") as mountpoint:
        root = os.path.join(mountpoint, "ckpt")
        make_checkpoints(root, [1, 2, 3], size=100_000)  # 1.2 MB each
        _fill(mountpoint)
        r = cli("prune", root, "--keep-last", "1", "--yes")
        assert r.exit_code == 0, r.stderr
        assert "disk full" in r.stderr  # the lock file was left empty, and that is said
        # Deleting freed space, so the verification record may have been written after all.
        assert sorted(n for n in os.listdir(root) if n != ".ckptctl-verified.json") == ["step-0000000003"]
        assert cli("verify", ckpt_dir(root, 3)).exit_code == 0


def test_library_retention_works_on_a_full_disk(tmp_path):
    from ckptctl.ops.retention.background import BackgroundRetention

    with tmpfs("8m") as mountpoint:
        root = os.path.join(mountpoint, "ckpt")
        paths = make_checkpoints(root, [1, 2, 3], size=100_000)
        _fill(mountpoint)
        retention = BackgroundRetention(open_storage(root), keep_last=1, keep_every=None)
        saved: Future = Future()
        saved.set_result(paths[-1])
        retention.after(3, saved)
        retention.close()
        assert sorted(n for n in os.listdir(root) if n != ".ckptctl-verified.json") == ["step-0000000003"]


def test_an_empty_lock_left_by_a_full_disk_is_held_while_its_process_lives(tmp_path):
    """A lock file left empty (no block to write its JSON) still excludes others: flock says
    its holder lives; once that process is gone, the next run takes the lock."""
    from ckptctl.errors import LockHeld
    from ckptctl.ops.lock import LOCK_KEY, RootLock

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({os.path.join(str(tmp_path), LOCK_KEY)!r}, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.utime(fd, (time.time() - 60, time.time() - 60))
        print("held", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match="unreadable lock file"):
            RootLock(open_storage(str(tmp_path))).acquire()
    finally:
        holder.communicate("", timeout=30)
    with RootLock(open_storage(str(tmp_path))) as lock:
        assert any("no process holds it (flock)" in n for n in lock.notes)
    assert not os.path.exists(os.path.join(str(tmp_path), LOCK_KEY))
