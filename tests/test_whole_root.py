"""The whole-root verbs: ``rm``, ``du`` and ``sync`` (local <-> S3), on real
checkpoints, real files and the moto S3 server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

from helpers import ckpt_dir, cli, make_checkpoints

from ckptctl.format.layout import MARKER, step_dir
from ckptctl.ops.lock import LOCK_KEY


def steps_in(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-"))


def flip_byte(path: str, offset: int = -40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        b = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))


SHARD = "rank-00000-of-00001.safetensors"


# --- rm --------------------------------------------------------------------------------------


def test_rm_deletes_named_checkpoints_and_refuses_the_newest_verified_one(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3, 4])
    r = cli("rm", ckpt_dir(root, 1), ckpt_dir(root, 2), "--yes")
    assert r.exit_code == 0, r.stderr
    assert steps_in(root) == [3, 4]
    assert re.search(r"deleted\s+.*step-0000000001", r.stdout)
    # The newest checkpoint that verifies: refused, nothing deleted (not even step 3).
    r = cli("rm", ckpt_dir(root, 3), ckpt_dir(root, 4), "--yes")
    assert r.exit_code == 1 and "--force" in r.stderr and "newest" in r.stderr
    assert steps_in(root) == [3, 4]
    assert not os.path.exists(os.path.join(root, LOCK_KEY))  # released on refusal
    # Once step 4 is corrupt, step 3 is the newest that verifies; step 4 may go.
    flip_byte(os.path.join(ckpt_dir(root, 4), SHARD))
    assert cli("rm", ckpt_dir(root, 3), "--yes").exit_code == 1
    assert cli("rm", ckpt_dir(root, 4), "--yes").exit_code == 0
    assert cli("rm", ckpt_dir(root, 3), "--yes", "--force").exit_code == 0
    assert steps_in(root) == []


def test_rm_dry_run_writes_nothing_and_json_and_usage_errors(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    before = sorted(os.listdir(root))
    r = cli("rm", ckpt_dir(root, 1), "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["schema"] == 2 and doc["dry_run"] and doc["checkpoints"][0]["result"] == "planned"
    assert doc["checkpoints"][0]["bytes"] > 0 and doc["checkpoints"][0]["url"].endswith(step_dir(1))
    assert sorted(os.listdir(root)) == before  # no lock, no verification record
    assert cli("rm", ckpt_dir(root, 1)).exit_code == 2  # no terminal to confirm on
    r = cli("rm", ckpt_dir(root, 9), "--yes")
    assert r.exit_code == 2 and "no such checkpoint" in r.stderr
    assert cli("rm", str(tmp_path / "nope" / step_dir(1)), "--yes").exit_code == 2
    assert steps_in(root) == [1, 2]


def test_rm_takes_the_lock_and_removes_the_marker_first(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from ckptctl.ops.lock import RootLock
        from ckptctl.storage import open_storage
        with RootLock(open_storage({root!r}), command="a prune"):
            print("held", flush=True)
            sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = cli("rm", ckpt_dir(root, 1), "--yes")
        assert r.exit_code == 3 and "a prune" in r.stderr
    finally:
        holder.communicate("", timeout=30)
    assert steps_in(root) == [1, 2]
    assert cli("rm", ckpt_dir(root, 1), "--yes").exit_code == 0  # released: free again
    assert steps_in(root) == [2]


def test_rm_on_s3(s3_url):
    make_checkpoints(s3_url, [1, 2, 3])
    assert cli("rm", f"{s3_url}/{step_dir(1)}", "--yes").exit_code == 0
    assert cli("rm", f"{s3_url}/{step_dir(3)}", "--yes").exit_code == 1
    steps = [c["step"] for c in cli("ls", s3_url, "--json").json()["checkpoints"]]
    assert steps == [2, 3]


# --- du --------------------------------------------------------------------------------------


def test_du_sizes_total_and_what_prune_would_free(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3, 4], size=20_000)
    os.makedirs(os.path.join(root, step_dir(5)))  # a save in progress: never counted as freed
    sizes = {s: sum(os.path.getsize(os.path.join(ckpt_dir(root, s), f)) for f in os.listdir(ckpt_dir(root, s)))
             for s in (1, 2, 3, 4)}
    r = cli("du", root, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["schema"] == 2 and doc["bytes"] == sum(sizes.values()) and doc["bytes_freed"] is None
    assert {c["step"]: c["bytes"] for c in doc["checkpoints"] if c["status"] == "committed"} == sizes
    # A partial entry says why it is not committed, as ls says it (a DCP save without .metadata).
    from test_layouts import dcp_step

    dcp_step(root, 6, complete=False)
    doc = cli("du", root, "--json").json()
    partial = next(c for c in doc["checkpoints"] if c["step"] == 6)
    listed = next(c for c in cli("ls", root, "--json").json()["checkpoints"] if c["step"] == 6)
    assert partial["status"] == "partial" and ".metadata" in partial["reason"] and partial["reason"] == listed["reason"]
    before = sorted(os.listdir(root))
    r = cli("du", root, "--keep-last", "2", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["bytes_freed"] == sizes[1] + sizes[2] and doc["checkpoints_freed"] == 2
    assert sorted(os.listdir(root)) == before  # writes nothing
    r = cli("du", root, "--keep-last", "2")
    assert "will free" in r.stdout and "(2 checkpoints)" in r.stdout
    # Exactly what prune then deletes.
    r = cli("prune", root, "--keep-last", "2", "--yes", "--json")
    assert sorted(r.json()["outcome"]["deleted"]) == [step_dir(1), step_dir(2)]


# --- sync ------------------------------------------------------------------------------------


def test_sync_local_to_s3_and_back_skips_verified_copies_and_recopies_damaged_ones(tmp_path, s3_url):
    src = str(tmp_path / "nvme")
    make_checkpoints(src, [1, 2, 3])
    r = cli("sync", src, s3_url, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["schema"] == 2 and doc["counts"]["copied"] == 3 and doc["bytes"] > 0
    assert [c["step"] for c in doc["checkpoints"]] == [1, 2, 3]  # step order
    assert cli("verify", s3_url, "--all").exit_code == 0
    # Nothing to do the second time; the copies are checked, not just seen.
    doc = cli("sync", src, s3_url, "--json").json()
    assert doc["counts"]["present"] == 3 and doc["counts"]["copied"] == 0
    # Back from S3 into a fresh local root; then damage one local copy: sync re-copies it.
    back = str(tmp_path / "back")
    assert cli("sync", s3_url, back).exit_code == 0
    assert steps_in(back) == [1, 2, 3]
    flip_byte(os.path.join(ckpt_dir(back, 2), SHARD))
    doc = cli("sync", s3_url, back, "--json").json()
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert by_step[2]["action"] == "copied" and "failed verification" in by_step[2]["detail"]
    assert by_step[1]["action"] == by_step[3]["action"] == "present"
    assert cli("verify", back, "--all").exit_code == 0


def test_sync_delete_never_removes_the_destinations_newest_verified_one(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2, 3])
    assert cli("sync", src, dst).exit_code == 0
    make_checkpoints(dst, [4])  # only at DST, and its newest
    shutil.rmtree(ckpt_dir(src, 1))
    r = cli("sync", src, dst, "--delete", "--dry-run", "--json")
    assert {c["step"]: c["action"] for c in r.json()["checkpoints"]} == {2: "present", 3: "present", 1: "would delete", 4: "kept"}
    assert steps_in(dst) == [1, 2, 3, 4]
    r = cli("sync", src, dst, "--delete")
    assert r.exit_code == 0, r.stderr
    assert steps_in(dst) == [2, 3, 4]


def test_sync_reports_a_corrupt_source_and_copies_the_rest(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2, 3])
    flip_byte(os.path.join(ckpt_dir(src, 2), SHARD))
    r = cli("sync", src, dst)
    assert r.exit_code == 1 and "step-0000000002" in r.stderr
    assert steps_in(dst) == [1, 3]
    assert not os.path.exists(os.path.join(ckpt_dir(dst, 2), MARKER))


def test_sync_resumes_after_a_kill(tmp_path):
    """A sync killed mid-copy (SIGKILL, in a real process) leaves its lock and a copy without a
    marker; the next run breaks the dead run's lock and finishes with everything verified."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2, 3], size=2_000_000)  # 24 MB each: long enough to be caught copying
    script = textwrap.dedent(f"""
        import sys
        from ckptctl.cli.app import app
        sys.argv = ["ckptctl", "sync", {src!r}, {dst!r}]
        app()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Killed once the first copy has begun (its step directory exists, marker or not).
        for _ in range(6000):
            if os.path.isdir(ckpt_dir(dst, 1)) and os.listdir(ckpt_dir(dst, 1)):
                break
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        proc.kill()
    finally:
        proc.wait(timeout=60)
    assert os.path.exists(os.path.join(dst, LOCK_KEY))  # the dead run's
    r = cli("sync", src, dst, "--json")
    assert r.exit_code == 0, r.stderr
    assert any("broke a stale lock" in n for n in r.json()["notes"])
    assert steps_in(dst) == [1, 2, 3]
    assert cli("verify", dst, "--all").exit_code == 0
    assert json.loads(cli("sync", src, dst, "--json").stdout)["counts"]["present"] == 3


def test_the_readme_cron_line_runs_as_written(tmp_path, s3_url):
    """The README's cron example (prune, sync to S3, verify --latest), only the local root and
    the bucket replaced, run by a real shell against the moto server."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = re.search(r"```cron\n(.*?)\n```", readme, re.S)
    assert block is not None, "README has no ```cron block"
    fields = block.group(1).split(None, 5)
    assert len(fields) == 6 and fields[0] == "*/15"
    line = fields[5].replace("/nvme/ckpt", str(tmp_path / "nvme")).replace("s3://training/run7", s3_url)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    for saved in ([1, 2, 3], [4, 5], []):  # training saves between cron runs; the last finds S3 in sync
        make_checkpoints(str(tmp_path / "nvme"), saved)
        p = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        assert (p.stdout, p.stderr) == ("", ""), (p.stdout, p.stderr)  # -q: cron mails nothing when all is well
    assert steps_in(str(tmp_path / "nvme")) == [3, 4, 5]
    assert [c["step"] for c in cli("ls", s3_url, "--json").json()["checkpoints"]] == [1, 2, 3, 4, 5]
    newest = cli("verify", s3_url, "--latest", "--json").json()["checkpoints"][-1]  # what the line's verify judged
    assert newest["ok"] and newest["url"].rstrip("/") == f"{s3_url}/{step_dir(5)}", newest
