"""``-q/--quiet`` for cron (issue 20, item 8): cron mails whatever a job prints, so a healthy
run under -q prints nothing at all, on stdout or stderr; what means trouble still prints.

Every check runs the real command in a real process (the streams are the point), on real
checkpoints. What -q keeps: the answer a script captures (the --json document; the path
``latest``, ``restore`` and ``cp`` print), and errors, refusals and failing checkpoints.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from helpers import ckpt_dir, cli_subprocess, make_checkpoints


def _flip_a_shard_byte(ckpt: str) -> None:
    shard = next(os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt)) if n.startswith("rank-"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 10)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _silent(*args: str) -> None:
    r = cli_subprocess(*args)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "", ""), (args, r.exit_code, r.stdout, r.stderr)


def test_the_cron_verbs_print_nothing_when_all_is_well(tmp_path):
    root, mirror = str(tmp_path / "nvme"), str(tmp_path / "mirror")
    make_checkpoints(root, [1, 2, 3, 4])
    _silent("prune", "-q", root, "--keep-last", "2", "--yes")
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        os.path.basename(ckpt_dir(root, s)) for s in (3, 4)]
    _silent("prune", "-q", root, "--keep-last", "2", "--yes")  # the next */15 run: nothing to do
    _silent("sync", "-q", root, mirror)
    _silent("sync", "-q", root, mirror)  # already in sync
    _silent("verify", "-q", mirror, "--latest")
    _silent("verify", "-q", mirror, "--all")
    _silent("verify", "-q", ckpt_dir(mirror, 4))
    _silent("du", "-q", root)
    _silent("rm", "-q", "--yes", ckpt_dir(mirror, 3))
    assert not os.path.exists(ckpt_dir(mirror, 3))


def test_without_q_the_same_runs_do_print(tmp_path):
    # the other side of the checks above: what -q takes away is really there without it
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    r = cli_subprocess("prune", root, "--keep-last", "2", "--yes")
    assert r.exit_code == 0 and "anchor:" in r.stdout and "deleted" in r.stdout, r.stdout
    r = cli_subprocess("verify", root, "--latest")
    assert r.exit_code == 0 and r.stdout.startswith("ok "), r.stdout


def test_paths_a_script_captures_still_print(tmp_path):
    root = str(tmp_path / "src")
    make_checkpoints(root, [5])
    r = cli_subprocess("restore", "-q", root, str(tmp_path / "dst"))
    assert (r.exit_code, r.stdout, r.stderr) == (0, ckpt_dir(str(tmp_path / "dst"), 5) + "\n", ""), r
    r = cli_subprocess("cp", "-q", ckpt_dir(root, 5), str(tmp_path / "copy"))
    assert (r.exit_code, r.stdout, r.stderr) == (0, ckpt_dir(str(tmp_path / "copy"), 5) + "\n", ""), r
    r = cli_subprocess("latest", "-q", root)
    assert (r.exit_code, r.stdout, r.stderr) == (0, ckpt_dir(root, 5) + "\n", ""), r


def test_json_is_data_and_prints_under_q(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    r = cli_subprocess("prune", "-q", "--json", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    assert [os.path.basename(d.rstrip("/")) for d in r.json()["outcome"]["deleted"]] == [os.path.basename(ckpt_dir(root, 1))]
    r = cli_subprocess("verify", "-q", "--json", root, "--latest")
    assert r.exit_code == 0 and r.json()["ok"] and r.stderr == ""


def test_trouble_still_prints_under_q(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    _flip_a_shard_byte(ckpt_dir(root, 2))
    r = cli_subprocess("verify", "-q", ckpt_dir(root, 2))
    assert r.exit_code == 1 and "FAILED" in r.stdout and "failed verification" in r.stderr, (r.stdout, r.stderr)
    r = cli_subprocess("verify", "-q", root, "--all")
    assert r.exit_code == 1 and "FAILED" in r.stdout and "ok " not in r.stdout, r.stdout
    # latest falls back past the corrupt step 2: the path is the answer, the skip is trouble
    r = cli_subprocess("latest", "-q", root)
    assert r.exit_code == 0 and r.stdout == ckpt_dir(root, 1) + "\n" and "skipped" in r.stderr, r
    r = cli_subprocess("restore", "-q", root, str(tmp_path / "dst"))
    assert r.exit_code == 0 and "skipping step 2" in r.stderr, r
    # prune leaves the broken newer checkpoint in place and says so (exit 1, cron mails)
    r = cli_subprocess("prune", "-q", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 1 and "broken checkpoint(s) left in place" in r.stderr, (r.stdout, r.stderr)
    _flip_a_shard_byte(ckpt_dir(root, 1))  # nothing verifies: prune refuses, and shows its plan
    r = cli_subprocess("prune", "-q", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 1 and r.stdout + r.stderr != "", r
    assert os.path.isdir(ckpt_dir(root, 1)) and os.path.isdir(ckpt_dir(root, 2))


def test_the_readme_cron_lines_use_q():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = [line for line in readme.splitlines() if re.match(r"^(\*/\d+|\d+) [\d*]", line) and "ckptctl" in line]
    assert lines, "no cron line in the README"
    for line in lines:
        for cmd in re.findall(r"ckptctl ([a-z]+)((?: (?!&&)\S+)*)", line):
            assert " -q" in f" {cmd[1]}", (cmd, line)


def test_reshard_and_convert_print_nothing_under_q(tmp_path):
    root = str(tmp_path / "root")
    (ckpt,) = make_checkpoints(root, [7])
    _silent("reshard", "-q", ckpt, ckpt_dir(str(tmp_path / "two"), 7), "--world-size", "2")
    _silent("convert", "-q", ckpt, str(tmp_path / "model.safetensors"), "--to", "safetensors")
    r = cli_subprocess("convert", ckpt, str(tmp_path / "again.safetensors"), "--to", "safetensors")
    assert r.exit_code == 0 and r.stdout.startswith("ok ") and "found ckptctl" in r.stderr, (r.stdout, r.stderr)
