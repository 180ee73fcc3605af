"""A re-sharding restore's staging copy (``DST/.restore-staging-*``): each run stages in a
directory of its own and removes it however it ends, short of a kill; what a killed run left
is deleted by ``prune`` once nothing in it was modified for ``--partial-after``, never before,
listed in the plan (a dry run deletes nothing), and only while it is as planned.

The staging copies here are the real thing: copies of a committed checkpoint made by the copy
engine under the names a restore gives them (this version's, with a run id, and an older
version's, without one), or left by a restore process SIGKILLed while held by a proxy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.ops.retention.policies import from_options
from ckptctl.ops.retention.prune import execute
from ckptctl.ops.retention.prune import plan as make_plan
from ckptctl.ops.transfer.copy import copy_checkpoint
from ckptctl.storage import open_storage
from helpers import cli
from s3_fault_proxy import FaultProxy
from test_copy_faults_review import _holding

HOUR = 3600.0
PREFIX = ".restore-staging-"  # the names are spelt out: the tests read what is on disk
RUN_NAMED = f"{PREFIX}{step_dir(200)}.0123456789abcdef"  # this version's: per run
OLD_NAMED = f"{PREFIX}{step_dir(100)}"  # an older version's: per step


def _save(root: str, steps=(100, 200)) -> None:
    with Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, {"model": {f"w{i}": torch.full((1000,), float(s + i)) for i in range(4)}}).wait()


def _staged(root: str) -> list[str]:
    return sorted(c.key for c in open_storage(root).children() if c.key.startswith(PREFIX))


def _root_with_staging_copies(root: str) -> None:
    """Steps 100 and 200 committed; what killed restores left: a whole staging copy of step 200
    (killed while re-sharding from it) and one of step 100 without its marker (killed copying)."""
    _save(root)
    st = open_storage(root)
    copy_checkpoint(st.sub(step_dir(200)), st.sub(RUN_NAMED))
    copy_checkpoint(st.sub(step_dir(100)), st.sub(OLD_NAMED))
    st.sub(OLD_NAMED).delete(MARKER)


def _age(path: str, seconds: float) -> None:
    """Everything under ``path`` (itself included) last modified ``seconds`` ago."""
    when = time.time() - seconds
    for top, dirs, files in os.walk(path):
        for name in files + dirs:
            os.utime(os.path.join(top, name), (when, when))
    os.utime(path, (when, when))


def test_prune_deletes_a_killed_restores_staging_copy_once_idle_and_never_before(tmp_path):
    root = str(tmp_path / "root")
    _root_with_staging_copies(root)
    st, policy = open_storage(root), from_options(2, None, None, ())

    now = make_plan(st, policy, partial_after_s=6 * HOUR)
    staged = {i.name: i for i in now.items if i.name.startswith(PREFIX)}
    assert sorted(staged) == [OLD_NAMED, RUN_NAMED], [i.name for i in now.items]
    assert all(i.kind == "staging" and i.action == "skip" and "left alone until idle for 6h" in i.reason
               for i in staged.values()), [i.reason for i in staged.values()]
    assert staged[RUN_NAMED].step == 200 and staged[RUN_NAMED].size > 0

    later = make_plan(st, policy, partial_after_s=6 * HOUR, now=time.time() + 7 * HOUR)
    due = [i for i in later.items if i.name.startswith(PREFIX)]
    assert [(i.name, i.action) for i in due] == [(OLD_NAMED, "delete"), (RUN_NAMED, "delete")]
    assert all("nothing modified for 7h" in i.reason for i in due), [i.reason for i in due]
    outcome = execute(later)
    assert sorted(o.name for o in outcome.deleted) == [OLD_NAMED, RUN_NAMED]
    assert _staged(root) == []
    for s in (100, 200):  # the checkpoints themselves are kept by the policy
        assert cli("verify", os.path.join(root, step_dir(s))).exit_code == 0


def test_prune_dry_run_lists_staging_copies_and_deletes_nothing(tmp_path):
    root = str(tmp_path / "root")
    _root_with_staging_copies(root)
    _age(os.path.join(root, RUN_NAMED), 2 * HOUR)
    _age(os.path.join(root, OLD_NAMED), 2 * HOUR)

    dry = cli("prune", root, "--keep-last", "2", "--partial-after", "1h", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    items = {i["name"]: i for i in dry.json()["plan"]["items"]}
    assert items[RUN_NAMED]["status"] == "staging" and items[RUN_NAMED]["action"] == "delete"
    assert items[RUN_NAMED]["bytes"] > 0 and items[OLD_NAMED]["action"] == "delete"
    text = cli("prune", root, "--keep-last", "2", "--partial-after", "1h", "--dry-run")
    assert RUN_NAMED in text.stdout and "abandoned: a restore's staging copy" in text.stdout, text.stdout
    assert "2 to delete" in text.stdout, text.stdout
    assert _staged(root) == [OLD_NAMED, RUN_NAMED]  # a dry run deletes nothing

    kept = cli("prune", root, "--keep-last", "2", "--partial-after", "3h", "--yes", "--json")
    assert kept.exit_code == 0 and kept.json()["outcome"]["deleted"] == [], kept.stdout + kept.stderr
    assert _staged(root) == [OLD_NAMED, RUN_NAMED]  # idle 2 h, not 3: left alone

    r = cli("prune", root, "--keep-last", "2", "--partial-after", "1h", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    assert sorted(r.json()["outcome"]["deleted"]) == [OLD_NAMED, RUN_NAMED]
    assert _staged(root) == []


def test_prune_leaves_a_staging_copy_that_changed_after_the_plan(tmp_path):
    """The plan saw it idle; a restore wrote into it before the deletion: left whole."""
    root = str(tmp_path / "root")
    _root_with_staging_copies(root)
    st = open_storage(root)
    later = make_plan(st, from_options(2, None, None, ()), partial_after_s=HOUR, now=time.time() + 2 * HOUR)
    assert [i.action for i in later.items if i.name == RUN_NAMED] == ["delete"]
    st.sub(RUN_NAMED).write_atomic("rank-00001-of-00002.safetensors", b"written after the plan")
    before = sorted(i.key for i in st.sub(RUN_NAMED).list())
    outcome = execute(later)
    assert [o.name for o in outcome.skipped] == [RUN_NAMED], outcome.to_dict()
    assert sorted(i.key for i in st.sub(RUN_NAMED).list()) == before
    assert _staged(root) == [RUN_NAMED]  # the other one, unchanged, went


def test_prune_never_follows_a_link_named_like_a_staging_copy(tmp_path):
    root, outside = str(tmp_path / "root"), tmp_path / "outside"
    _save(root, steps=(100,))
    outside.mkdir()
    (outside / MARKER).write_text("not ckptctl's to delete")
    os.symlink(outside, os.path.join(root, RUN_NAMED))
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert (outside / MARKER).read_text() == "not ckptctl's to delete"
    assert os.path.islink(os.path.join(root, RUN_NAMED))


# --- on S3 --------------------------------------------------------------------------------------


def test_a_killed_resharding_restore_on_s3_leaves_a_staging_copy_prune_reclaims(s3_url, s3_server, tmp_path):
    """A restore SIGKILLed once its staging copy holds every file but the marker: the copy
    stays, hidden. Prune lists it, leaves it alone while it may be a live restore's, and
    deletes it (and only it) once idle for --partial-after."""
    src, dst = str(tmp_path / "src"), f"{s3_url}/dst"
    _save(src)
    first = cli("restore", src, dst, "--step", "100", "--world-size", "2")
    assert first.exit_code == 0, first.stderr
    assert _staged(dst) == []  # a restore that ends removes its own
    held, reached = _holding(s3_server, lambda method, path: method == "PUT" and f"/dst/{PREFIX}" in path
                             and path.split("?")[0].endswith("/" + MARKER))
    try:
        killed = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "restore", src, dst, "--world-size", "2"],
                                  env={**os.environ, "AWS_ENDPOINT_URL": held.url},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert reached.wait(240), killed.communicate(timeout=60)  # a bound against hanging, not a timing assertion
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
    finally:
        held.release.set()
        held.stop()
    left = _staged(dst)
    assert len(left) == 1 and left[0].startswith(f"{PREFIX}{step_dir(200)}"), left

    young = cli("prune", dst, "--keep-last", "1", "--partial-after", "1h", "--dry-run", "--json")
    assert young.exit_code == 0, young.stderr
    items = {i["name"]: i for i in young.json()["plan"]["items"]}
    assert items[left[0]]["status"] == "staging" and items[left[0]]["action"] == "skip", items
    dry = cli("prune", dst, "--keep-last", "1", "--partial-after", "0s", "--dry-run", "--json")
    assert {i["name"]: i["action"] for i in dry.json()["plan"]["items"]}[left[0]] == "delete"
    assert _staged(dst) == left

    r = cli("prune", dst, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["outcome"]["deleted"] == left
    assert _staged(dst) == []
    assert cli("verify", f"{dst}/{step_dir(100)}").exit_code == 0


def test_a_resharding_restore_that_fails_removes_its_staging_copy(s3_url, s3_server, tmp_path, monkeypatch):
    """The staging copy's manifest cannot be written (a 500 for good): the restore fails with
    a storage error (exit 3) and takes its staging copy, shard and all, with it."""
    src, dst = str(tmp_path / "src"), f"{s3_url}/dst"
    _save(src, steps=(100,))
    proxy = FaultProxy(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    proxy.rule = lambda method, path: ("500" if method == "PUT" and f"/dst/{PREFIX}" in path
                                       and path.split("?")[0].endswith("/manifest.json") else None)
    try:
        r = cli("restore", src, dst, "--world-size", "2")
    finally:
        proxy.stop()
    assert proxy.injected, "the restore wrote no staging manifest"
    assert r.exit_code == 3, r.stdout + r.stderr
    assert _staged(dst) == []


def test_an_interrupted_resharding_restore_removes_its_staging_copy(s3_url, s3_server, tmp_path):
    """Ctrl-C while the staging copy is being written (its marker's PUT held: the manifest went
    before its data): the restore says "interrupted" (exit 130) and takes its staging copy with it."""
    src, dst = str(tmp_path / "src"), f"{s3_url}/dst"
    _save(src, steps=(100,))
    held, reached = _holding(s3_server, lambda method, path: method == "PUT" and f"/dst/{PREFIX}" in path
                             and path.split("?")[0].endswith("/" + MARKER))
    try:
        restore = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "restore", src, dst, "--world-size", "2"],
                                   env={**os.environ, "AWS_ENDPOINT_URL": held.url},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert reached.wait(240), restore.communicate(timeout=60)  # a bound against hanging, not a timing assertion
        assert len(_staged(dst)) == 1  # its shard is in
        restore.send_signal(signal.SIGINT)
        held.release.set()
        out, err = restore.communicate(timeout=240)
    finally:
        held.release.set()
        held.stop()
    assert restore.returncode == 130 and "interrupted" in err, out + err
    assert _staged(dst) == []


def test_prune_deletes_no_staging_copy_while_no_checkpoint_verifies(tmp_path):
    """A restore into an empty root killed while copying: nothing there verifies, so prune
    refuses (exit 1) and deletes nothing, the staging copy included."""
    src, root = str(tmp_path / "src"), str(tmp_path / "root")
    _save(src, steps=(200,))
    copy_checkpoint(open_storage(src).sub(step_dir(200)), open_storage(root).sub(RUN_NAMED))
    _age(os.path.join(root, RUN_NAMED), 2 * HOUR)
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "1h", "--yes")
    assert r.exit_code == 1 and "no committed checkpoint" in r.stdout + r.stderr, r.stdout + r.stderr
    assert _staged(root) == [RUN_NAMED]


def test_a_staging_copy_pruned_under_a_live_restore_fails_it_and_commits_nothing(s3_url, s3_server, tmp_path):
    """The price of the idle rule alone (docs/decisions.md): a prune whose --partial-after is
    shorter than a restore's re-shard deletes the staging copy the restore reads from. The
    restore then fails (exit 3, one line saying the copy is no longer whole), nothing of step
    200 is committed, and the restore run again succeeds."""
    src, dst = str(tmp_path / "src"), f"{s3_url}/dst"
    _save(src)
    assert cli("restore", src, dst, "--step", "100", "--world-size", "2").exit_code == 0  # prune's anchor
    held, reached = _holding(s3_server, lambda method, path: method == "GET" and f"/dst/{PREFIX}" in path
                             and path.split("?")[0].endswith(".safetensors"))
    try:
        restore = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "restore", src, dst, "--world-size", "2"],
                                   env={**os.environ, "AWS_ENDPOINT_URL": held.url},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert reached.wait(240), restore.communicate(timeout=60)  # a bound against hanging, not a timing assertion
        pruned = cli("prune", dst, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
        assert pruned.exit_code == 0, pruned.stdout + pruned.stderr
        assert [n for n in pruned.json()["outcome"]["deleted"] if n.startswith(PREFIX)], pruned.stdout
        held.release.set()
        out, err = restore.communicate(timeout=240)
    finally:
        held.release.set()
        held.stop()
    assert restore.returncode == 3 and "no longer whole" in err, out + err
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert open_storage(dst).sub(step_dir(200)).stat(MARKER) is None
    again = cli("restore", src, dst, "--world-size", "2")
    assert again.exit_code == 0 and again.stdout.strip() == f"{dst}/{step_dir(200)}", again.stderr
    assert _staged(dst) == []
