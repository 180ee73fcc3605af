"""``ckptctl prune`` and the ops behind it, on real files and real processes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.layouts.native_read import read_state
from ckptctl.format.layout import MANIFEST, MARKER, step_dir
from ckptctl.ops.lock import LOCK_KEY, RootLock
from ckptctl.ops.retention.prune import plan as make_plan
from ckptctl.ops.retention.prune import prune
from ckptctl.ops.retention.policies import from_options
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.storage import open_storage
from ckptctl.storage.base import Writer
from ckptctl.storage.local import LocalStorage
from helpers import ckpt_dir, cli, cli_subprocess, make_checkpoints

HOURS = 3600.0


# --- building blocks ------------------------------------------------------------------------


def corrupt(path: str) -> None:
    """Flip one data byte of the shard: same size, marker and manifest intact."""
    shard = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(-5, 2)
        b = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def make_partial(root: str, step: int, *, age_s: float = 0.0) -> str:
    """A directory without a marker, as a save in progress (or a dead one) leaves it."""
    path = ckpt_dir(root, step)
    os.makedirs(path)
    with open(os.path.join(path, "rank-00000-of-00001.safetensors"), "wb") as f:
        f.write(b"\0" * 100)
    with open(os.path.join(path, ".manifest.json.tmp-1-abcd"), "wb") as f:
        f.write(b"{")
    if age_s:
        old = time.time() - age_s
        for name in os.listdir(path):
            os.utime(os.path.join(path, name), (old, old))
        os.utime(path, (old, old))
    return path


def actions(root: str, **opts) -> dict[str, str]:
    policy = from_options(opts.pop("keep_last", None), opts.pop("keep_every", None), opts.pop("keep_within", None), opts.pop("keep", ()))
    p = make_plan(open_storage(root), policy, **opts)
    return {i.name: i.action for i in p.items}


def names(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def tree(path: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = fh.read()
    return out


def S(*steps: int) -> list[str]:
    return [step_dir(s) for s in steps]


# --- the scenario table ---------------------------------------------------------------------


def _ten_newest_corrupt(root, tmp):
    make_checkpoints(root, range(1, 11))
    corrupt(ckpt_dir(root, 10))


def _newest_partial_fresh(root, tmp):
    make_checkpoints(root, range(1, 6))
    make_partial(root, 6)


def _newest_partial_old(root, tmp):
    make_checkpoints(root, range(1, 6))
    make_partial(root, 6, age_s=7 * HOURS)


def _unpadded_names(root, tmp):
    make_checkpoints(root, [8, 9, 10])
    for s in (8, 9, 10):
        os.rename(ckpt_dir(root, s), os.path.join(root, f"step-{s}"))


def _symlink_outside(root, tmp):
    make_checkpoints(root, [1, 2, 3])
    outside = str(tmp / "outside")
    make_checkpoints(outside, [40])
    os.symlink(ckpt_dir(outside, 40), ckpt_dir(root, 40))


def _duplicate_step(root, tmp):
    make_checkpoints(root, [1, 2, 3])
    shutil.copytree(ckpt_dir(root, 2), os.path.join(root, "step-2"))


SCENARIOS = {
    # name: (setup, options, expected action by directory, directories left after --yes, exit)
    "ten checkpoints, newest corrupt": (
        _ten_newest_corrupt, {"keep_last": 3},
        {**{d: "delete" for d in S(1, 2, 3, 4, 5, 6)}, **{d: "keep" for d in S(7, 8, 9)}, step_dir(10): "skip"},
        S(7, 8, 9, 10), 1,  # exit 1: the broken newest is reported, left in place
    ),
    "newest partial and fresh": (
        _newest_partial_fresh, {"keep_last": 2},
        {**{d: "delete" for d in S(1, 2, 3)}, **{d: "keep" for d in S(4, 5)}, step_dir(6): "skip"},
        S(4, 5, 6), 0,
    ),
    "newest partial and old": (
        _newest_partial_old, {"keep_last": 2},
        {**{d: "delete" for d in S(1, 2, 3)}, **{d: "keep" for d in S(4, 5)}, step_dir(6): "delete"},
        S(4, 5), 0,
    ),
    "step-10 beside step-9": (
        _unpadded_names, {"keep_last": 1},
        {"step-8": "delete", "step-9": "delete", "step-10": "keep"},
        ["step-10"], 0,
    ),
    "symlink to a directory outside the root": (
        _symlink_outside, {"keep_last": 2},
        {step_dir(1): "delete", step_dir(2): "keep", step_dir(3): "keep", step_dir(40): "delete"},
        S(2, 3), 0,
    ),
    "two directories for one step": (
        _duplicate_step, {"keep_last": 1},
        {step_dir(1): "delete", step_dir(2): "skip", "step-2": "skip", step_dir(3): "keep"},
        sorted(S(2, 3) + ["step-2"]), 0,
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_plan_and_result(name, tmp_path):
    setup, opts, expected, left, code = SCENARIOS[name]
    root = str(tmp_path / "root")
    setup(root, tmp_path)
    assert actions(root, **opts) == expected

    before_outside = tree(str(tmp_path / "outside")) if (tmp_path / "outside").exists() else None
    args = [f"--keep-last={opts['keep_last']}"]
    dry = cli("prune", root, *args, "--dry-run", "--json")
    assert dry.exit_code == code, dry.stderr
    assert {i["name"]: i["action"] for i in dry.json()["plan"]["items"]} == expected
    assert names(root) == sorted(expected)  # a dry run deletes nothing

    r = cli("prune", root, *args, "--yes", "--json")
    assert r.exit_code == code, r.stderr
    doc = r.json()
    assert sorted(doc["outcome"]["deleted"]) == sorted(d for d, a in expected.items() if a == "delete")
    assert names(root) == left
    if before_outside is not None:  # the link's target is untouched, and the link is gone
        assert tree(str(tmp_path / "outside")) == before_outside
        assert not os.path.lexists(ckpt_dir(root, 40))


def test_newest_corrupt_with_delete_broken(tmp_path):
    root = str(tmp_path)
    _ten_newest_corrupt(root, tmp_path)
    r = cli("prune", root, "--keep-last", "3", "--delete-broken", "--yes")
    assert r.exit_code == 0, r.stderr
    assert names(root) == S(7, 8, 9)


def test_all_corrupt_refuses_and_deletes_nothing(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    for s in (1, 2, 3):
        corrupt(ckpt_dir(root, s))
    make_partial(root, 4, age_s=7 * HOURS)  # abandoned: would be deleted if anything verified
    os.symlink(str(tmp_path), ckpt_dir(root, 9))
    before = names(root)
    for extra in ((), ("--delete-broken",)):
        r = cli("prune", root, "--keep-last", "1", "--yes", *extra)
        assert r.exit_code == 1
        assert "none of 3 committed checkpoint(s) passes full verification" in r.stderr
        assert "step-0000000003" in r.stdout and "fails full verification" in r.stdout
        assert names(root) == before
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 1 and r.json()["plan"]["refused"] and r.json()["outcome"] is None


def test_empty_root_refuses(tmp_path):
    make_partial(str(tmp_path), 1)
    r = cli("prune", str(tmp_path), "--keep-last", "1", "--yes")
    assert r.exit_code == 1 and "no committed checkpoint" in r.stderr
    assert names(str(tmp_path)) == S(1)


def test_older_checkpoints_are_not_read_and_policies_combine(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, range(1000, 11000, 1000))
    p = make_plan(open_storage(root), from_options(2, 4000, None, [1000]))
    by = {i.step: i for i in p.items}
    assert p.anchor is not None and p.anchor.step == 10000
    assert [s for s, i in by.items() if i.action == "keep"] == [1000, 4000, 8000, 9000, 10000]
    assert by[1000].reason == "pinned" and "keep-every 4000" in by[8000].reason
    assert by[10000].reason.startswith("anchor")
    assert all(i.verification is None for s, i in by.items() if s != 10000)  # only the anchor was read


def test_missing_pin_is_noted(tmp_path):
    make_checkpoints(str(tmp_path), [1, 2])
    r = cli("prune", str(tmp_path), "--keep", "7", "--keep-last", "1", "--dry-run")
    assert r.exit_code == 0 and "--keep 7: no committed checkpoint has that step" in r.stderr


def test_plan_does_not_depend_on_listing_order(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [3, 1, 20, 7, 5])
    corrupt(ckpt_dir(root, 20))
    make_partial(root, 30)
    make_partial(root, 2, age_s=10 * HOURS)

    class Shuffled(LocalStorage):
        def children(self, prefix: str = ""):
            items = super().children(prefix)
            rng.shuffle(items)
            return items

    policy = from_options(2, None, None, ())
    now = time.time()
    want = [(i.name, i.action, i.reason) for i in make_plan(open_storage(root), policy, now=now).items]
    for seed in range(5):
        rng = random.Random(seed)
        got = [(i.name, i.action, i.reason) for i in make_plan(Shuffled(root), policy, now=now).items]
        assert got == want


# --- interruption -------------------------------------------------------------------------


def test_marker_removed_first_means_an_interrupted_delete_looks_partial(tmp_path):
    """The exact state a prune killed right after its first unlink leaves behind."""
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    os.unlink(os.path.join(ckpt_dir(root, 2), MARKER))
    rows = {r["step"]: r["status"] for r in cli("ls", root, "--json").json()["checkpoints"]}
    assert rows == {1: "committed", 2: "partial"}
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 1)
    # and a later prune treats it as partial: left alone while its directory is fresh
    assert actions(root, keep_last=1)[step_dir(2)] == "skip"
    # manifest gone too (killed after the second unlink): still partial, never committed
    os.unlink(os.path.join(ckpt_dir(root, 2), MANIFEST))
    assert read_state(open_storage(ckpt_dir(root, 2))).status == "partial"


class _RecordingDisk(LocalStorage):
    """A disk that remembers, in order, every file deleted through it (one list shared with
    the storages ``sub`` derives from it)."""

    deleted: list[str]

    def sub(self, key: str) -> "_RecordingDisk":
        child = super().sub(key)
        child.deleted = self.deleted
        return child

    def delete(self, key: str) -> bool:
        self.deleted.append(self.url_of(key))
        return super().delete(key)


def test_deletion_order_marker_manifest_then_shards(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    disk = _RecordingDisk(root)
    disk.deleted = []
    _, outcome = prune(disk, from_options(1, None, None, ()))
    assert outcome is not None and names(root) == S(2)
    mine = [os.path.relpath(u, ckpt_dir(root, 1)) for u in disk.deleted if u.startswith(ckpt_dir(root, 1))]
    assert mine[:2] == [MARKER, MANIFEST] and mine[2].endswith(".safetensors")


def _committed_but_broken(root: str) -> list[str]:
    bad = []
    for e in list_checkpoints(open_storage(root)):
        ckpt = open_storage(os.path.join(root, e.name))
        status = read_state(ckpt).status
        if status == "corrupt" or (status == "committed" and not verify_checkpoint(ckpt, "checksums").ok):
            bad.append(e.name)
    return bad


def test_real_prune_killed_at_random_points_never_leaves_a_committed_broken_checkpoint(tmp_path):
    template = str(tmp_path / "template")
    make_checkpoints(template, range(1, 41), size=20_000)
    rng = random.Random(4)
    for attempt in range(3):
        root = str(tmp_path / f"root{attempt}")
        shutil.copytree(template, root)
        markers = [os.path.join(ckpt_dir(root, s), MARKER) for s in range(1, 40)]
        stop_below = rng.randint(1, 38)  # kill once fewer than this many old markers remain
        proc = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "prune", root, "--keep-last", "1", "--yes"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if sum(os.path.exists(m) for m in markers) < stop_below:
                time.sleep(rng.random() * 0.004)  # land anywhere inside one checkpoint's deletion
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait()
        # A kill that landed after the run released its lock (its last deletion done) left none.
        lock_left = os.path.exists(os.path.join(root, LOCK_KEY))
        assert _committed_but_broken(root) == []
        assert cli("latest", root).stdout.strip() == ckpt_dir(root, 40)
        # A re-run breaks the dead run's lock and finishes; a half-deleted (partial, fresh)
        # directory is left for --partial-after, everything committed but the anchor goes.
        r = cli_subprocess("prune", root, "--keep-last", "1", "--yes")
        assert r.exit_code == 0, r.stderr
        assert ("broke a stale lock" in r.stderr) == lock_left, (proc.returncode, r.stderr)
        rows = cli("ls", root, "--json").json()["checkpoints"]
        assert [x["step"] for x in rows if x["status"] == "committed"] == [40]
        assert all(x["status"] in ("committed", "partial") for x in rows)
        assert _committed_but_broken(root) == []


# --- concurrency --------------------------------------------------------------------------


def test_prune_while_another_holds_the_lock_is_exit_3_naming_the_holder(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    with RootLock(open_storage(root), command="ckptctl prune (test)"):
        r = cli_subprocess("prune", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 3
    assert f"pid {os.getpid()}" in r.stderr and os.uname().nodename in r.stderr and "locked" in r.stderr
    assert names(root) == S(1, 2, 3)
    assert cli("prune", root, "--keep-last", "1", "--yes").exit_code == 0  # released: works again


def test_two_real_prunes_at_once(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, range(1, 31), size=50_000)
    cmd = [sys.executable, "-m", "ckptctl.cli", "prune", root, "--keep-last", "2", "--yes", "--reverify"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(120), p.stderr.read()) for p in procs]
    codes = sorted(c for c, _ in results)
    # Either they overlapped (one is refused with the holder named) or one ran after the other.
    assert codes in ([0, 0], [0, 3]), results
    for c, text in results:
        if c == 3:
            assert "is held by pid" in text
    assert names(root) == S(29, 30)


WRITER = textwrap.dedent("""
    import sys, time, torch
    from ckptctl import Checkpointer
    from ckptctl.ops.verify.engine import verify_checkpoint
    from ckptctl.storage import open_storage
    root, n = sys.argv[1], int(sys.argv[2])
    with Checkpointer(root) as ckpt:
        for step in range(1, n + 1):
            state = {"model": {f"w{i}": torch.full((250_000,), float(step)) for i in range(4)}}
            url = ckpt.save(step, state).wait()
            rep = verify_checkpoint(open_storage(url), "checksums")
            print("ok" if rep.ok else "BAD", step, flush=True)
            time.sleep(0.02)
""")


def test_prune_while_training_saves_into_the_same_root(tmp_path):
    root = str(tmp_path / "root")
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    n = 25
    writer = subprocess.Popen([sys.executable, str(script), root, str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deleted: set[str] = set()
    runs = 0
    while writer.poll() is None:
        r = cli("prune", root, "--keep-last", "1", "--yes", "--json", "--partial-after", "1h")
        runs += 1
        if r.exit_code in (1, 2):  # nothing committed yet (1), or not even the root (2)
            assert "no committed checkpoint" in r.stderr or "no such file or directory" in r.stderr, r.stderr
            continue
        assert r.exit_code == 0, r.stderr
        deleted.update(r.json()["outcome"]["deleted"])
    out, errs = writer.communicate()
    assert writer.returncode == 0, errs
    assert out.split("\n")[:-1] == [f"ok {s}" for s in range(1, n + 1)]  # every save committed and verified
    assert runs >= 3
    assert step_dir(n) not in deleted
    # Everything the writer committed is either still there, committed, or was pruned whole.
    for s in range(1, n + 1):
        d = step_dir(s)
        assert d in deleted or read_state(open_storage(ckpt_dir(root, s))).status == "committed", d
    assert cli("prune", root, "--keep-last", "1", "--yes").exit_code == 0
    assert names(root) == S(n)


# --- the command line ---------------------------------------------------------------------


def test_no_policy_is_a_usage_error(tmp_path):
    make_checkpoints(str(tmp_path), [1])
    r = cli("prune", str(tmp_path), "--yes")
    assert r.exit_code == 2 and "no retention policy given" in r.stderr


def test_without_a_terminal_yes_or_dry_run_is_required(tmp_path):
    make_checkpoints(str(tmp_path), [1, 2])
    r = cli("prune", str(tmp_path), "--keep-last", "1")
    assert r.exit_code == 2 and "--yes" in r.stderr and "--dry-run" in r.stderr
    assert names(str(tmp_path)) == S(1, 2)


@pytest.mark.parametrize("args, text", [
    (["--keep-last", "0"], "--keep-last must be at least 1"),
    (["--keep-within", "soon"], "--keep-within: invalid duration"),
    (["--keep-last", "1", "--partial-after", "-1h"], "--partial-after: invalid duration"),
    (["--keep-every", "x"], "Invalid value for '--keep-every'"),
])
def test_bad_options_are_usage_errors(tmp_path, args, text):
    r = cli("prune", str(tmp_path), *args, "--yes")
    assert r.exit_code == 2 and text in r.stderr


def _prune_on_a_terminal(root: str, answer: str) -> subprocess.CompletedProcess:
    """``ckptctl prune ROOT --keep-last 1`` in a real process whose stdin is a terminal (a
    pseudo-terminal), answering the prompt with ``answer``."""
    import pty

    primary, secondary = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "prune", root, "--keep-last", "1"],
                             stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.close(secondary)
        os.write(primary, answer.encode())  # the terminal buffers it until the prompt reads
        out, err = p.communicate(timeout=120)
    finally:
        os.close(primary)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_on_a_terminal_it_asks(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    r = _prune_on_a_terminal(root, "n\n")
    assert r.returncode == 1 and "Delete 1 entry?" in r.stderr and "nothing was deleted" in r.stderr
    assert names(root) == S(1, 2)
    r = _prune_on_a_terminal(root, "y\n")
    assert r.returncode == 0 and "deleted  step-0000000001" in r.stdout, r.stderr
    assert names(root) == S(2)


def test_human_output_shows_plan_before_acting(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    r = cli("prune", root, "--keep-last", "2", "--keep-within", "1h", "--yes")
    assert r.exit_code == 0
    plan_at = r.stdout.index("anchor:")
    assert plan_at < r.stdout.index("deleted 0")
    assert "within 1h of newest" in r.stdout


def test_keep_within_deletes_old_by_manifest_time(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    p = make_plan(open_storage(root), from_options(None, None, 0.0, ()))
    assert [i.action for i in p.items] == ["delete", "delete", "keep"]


def test_library_retention_keeps_exactly_the_newest(tmp_path):
    root = str(tmp_path)
    with Checkpointer(root, keep_last=2) as ckpt:
        for s in range(1, 7):
            ckpt.save(s * 10, {"x": torch.full((1000,), float(s))})
    assert names(root) == S(50, 60)
    with Checkpointer(root, keep_last=1, keep_every=70) as ckpt:
        for s in (70, 80, 90):
            ckpt.save(s, {"x": torch.ones(10)}).wait()
    assert names(root) == S(70, 90)


def test_library_retention_never_fails_a_save(tmp_path, caplog):
    root = str(tmp_path)
    with RootLock(open_storage(root), command="cron prune"):
        with caplog.at_level("WARNING", logger="ckptctl"):
            with Checkpointer(root, keep_last=1) as ckpt:
                for s in (1, 2, 3):
                    ckpt.save(s, {"x": torch.ones(10)}).wait()
    assert names(root) == S(1, 2, 3)
    assert "retention after step 3 did not run" in caplog.text and "is held by pid" in caplog.text


class _FlippingWriter(Writer):
    """Passes every write through, with one byte of the first payload write flipped."""

    def __init__(self, inner: Writer) -> None:
        self.inner, self.writes = inner, 0

    def write(self, data) -> None:
        self.writes += 1
        if self.writes == 2 and len(data):  # the first write is the header; this is payload
            raw = bytearray(memoryview(data).cast("B"))
            raw[len(raw) // 2] ^= 0x55
            data = raw
        self.inner.write(data)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class _BitRotDisk(LocalStorage):
    """A disk that silently corrupts the shards of one step: the save succeeds (checksums are
    computed from memory), and only reading the bytes back shows it."""

    bad_dir = step_dir(3)

    def open_writer(self, key: str) -> Writer:
        writer = super().open_writer(key)
        if self.bad_dir in self.url_of(key).split("/") and key.endswith(".safetensors"):
            return _FlippingWriter(writer)
        return writer


def test_library_retention_does_not_delete_when_the_new_checkpoint_fails(tmp_path, caplog):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    with caplog.at_level("WARNING", logger="ckptctl"):
        with Checkpointer(root, storage=_BitRotDisk(root), keep_last=1) as ckpt:
            ckpt.save(3, {"x": torch.ones(100_000)}).wait()
    assert not verify_checkpoint(open_storage(ckpt_dir(root, 3)), "checksums").ok  # the fault landed
    # The new one failed verification: the anchor is step 2; step 3 is reported, not deleted.
    assert names(root) == S(2, 3)
    assert "is broken and was left in place" in caplog.text


def test_json_plan_is_complete(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    doc = cli("prune", root, "--keep-last", "1", "--dry-run", "--json").json()
    assert doc["dry_run"] is True and doc["outcome"] is None
    plan = doc["plan"]
    assert plan["anchor"]["step"] == 2 and plan["policy"] == "keep-last 1"
    anchor = plan["items"][-1]
    assert anchor["verification"]["ok"] and anchor["verification"]["level"] == "load"
    json.dumps(doc)


def test_missing_root_is_an_error_and_is_not_created(tmp_path):
    r = cli("prune", str(tmp_path / "typo"), "--keep-last", "1", "--yes")
    assert r.exit_code == 2 and f"no such file or directory: {tmp_path / 'typo'}" in r.stderr
    assert not (tmp_path / "typo").exists()


def test_prune_on_s3(s3_url):
    make_checkpoints(s3_url, [1, 2, 3, 4])
    r = cli("prune", s3_url, "--keep-last", "2", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["outcome"]["deleted"] == S(1, 2)
    rows = cli("ls", s3_url, "--json").json()["checkpoints"]
    assert [x["step"] for x in rows] == [3, 4]
    again = cli("prune", s3_url, "--keep-last", "2", "--dry-run", "--json").json()
    assert again["plan"]["items"][-1]["verification"]["cached"] is True
