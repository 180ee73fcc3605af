"""The CLI behaves like a well-made Unix tool in scripts and cron (issue 13, "Conventions"):
missing paths and wrong targets, closed pipes, JSON errors, unexpected errors, --version,
output that stays one line per record when piped, and strict CKPTCTL_* environment values.

Everything runs the real CLI: in-process through Typer's runner, or in a real process where
the behaviour depends on real file descriptors (pipes, terminals, the environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER
from ckptctl.version import __version__
from helpers import ckpt_dir, cli, cli_subprocess, make_checkpoints

LONG = "decoder_layers_0_self_attention_query_key_value_projection_weight_with_a_long_descriptive_suffix"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    r = str(tmp_path_factory.mktemp("conventions"))
    make_checkpoints(r, [1, 2])
    return r


def _verbs_on(path: str, tmp: str) -> list[list[str]]:
    """Every verb, given ``path`` where it takes an existing checkpoint or root."""
    return [
        ["ls", path],
        ["latest", path],
        ["verify", path],
        ["verify", path, "--latest"],
        ["verify", path, "--all"],
        ["inspect", path],
        ["prune", path, "--keep-last", "1", "--yes"],
        ["interval", path, "--mtbf", "1d"],
        ["cp", path, os.path.join(tmp, "cp-dst")],
        ["restore", path, os.path.join(tmp, "restore-dst")],
        ["reshard", path, os.path.join(tmp, "reshard-dst"), "--world-size", "2"],
        ["convert", path, os.path.join(tmp, "convert-dst"), "--to", "safetensors"],
    ]


@pytest.mark.parametrize("missing", ["typo", "s3:/bucket"])
def test_a_missing_path_or_malformed_url_is_exit_2_on_every_verb(tmp_path, missing):
    path = str(tmp_path / missing) if missing == "typo" else missing
    for args in _verbs_on(path, str(tmp_path)):
        r = cli(*args)
        assert r.exit_code == 2, (args, r.exit_code, r.stderr)
        assert f"no such file or directory: {path}" in r.stderr, (args, r.stderr)
        assert r.stdout == "", args
    assert sorted(os.listdir(tmp_path)) == []  # nothing was created on the way (no DST, no lock)
    assert "s3://bucket" in cli("ls", "s3:/bucket").stderr  # the hint shows the URL meant


def test_an_empty_existing_root_is_exit_1_no_committed_checkpoint(tmp_path):
    for args in (["latest", str(tmp_path)], ["verify", str(tmp_path), "--latest"], ["verify", str(tmp_path), "--all"]):
        r = cli(*args)
        assert r.exit_code == 1 and "no committed checkpoint" in r.stderr, (args, r.stderr)
    r = cli("ls", str(tmp_path))
    assert r.exit_code == 0


def test_a_root_where_one_checkpoint_is_expected_says_did_you_mean_latest(root, tmp_path):
    for args in (["inspect", root], ["verify", root], ["reshard", root, str(tmp_path / "out"), "-w", "1"], ["cp", root, str(tmp_path / "cp")]):
        r = cli(*args)
        assert r.exit_code == 2, (args, r.stderr)
        # verify is the one verb with --latest; the others say they take one checkpoint
        tail = "did you mean --latest?" if args[0] == "verify" else f"{args[0]} takes one checkpoint"
        assert f"this is a root holding 2 checkpoints; {tail}" in r.stderr, (args, r.stderr)
        assert "still being written" not in r.stderr
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "cp")
    assert cli("verify", root, "--latest").exit_code == 0  # what it suggests works


def test_a_file_that_is_no_checkpoint_is_exit_1_not_a_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    for verb in ("inspect", "verify"):
        r = cli(verb, str(script))
        assert r.exit_code == 1, (verb, r.stderr)
        assert f"not a checkpoint: {script}" in r.stderr and "storage error" not in r.stderr, r.stderr
    (tmp_path / "notes").mkdir()
    r = cli("inspect", str(tmp_path / "notes"))
    assert r.exit_code == 1 and "not a checkpoint" in r.stderr


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """``ckptctl ARGS`` with stdout a pipe whose reader has gone (``| head -1`` that exited)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "ckptctl.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)


def test_a_closed_pipe_stops_quietly_with_exit_0(root):
    for args in (["verify", root, "--all"], ["ls", root], ["ls", root, "--json"], ["latest", root]):
        p = _run_into_closed_pipe(*args)
        assert p.returncode == 0, (args, p.returncode, p.stderr)
        assert p.stderr == "", (args, p.stderr)


def test_a_closed_pipe_after_head_under_pipefail(tmp_path):
    # The shell form from the issue, with more output than a pipe holds, so that the pipe
    # really closes while ckptctl is still writing.
    for s in range(3000):
        os.makedirs(ckpt_dir(str(tmp_path), s))  # partial checkpoints: no marker
    cmd = f"set -o pipefail; {sys.executable} -m ckptctl.cli ls {tmp_path} | head -1"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["STEP", "FORMAT", "STATUS", "SIZE", "AGE", "PATH"] and p.stderr == ""


def test_errors_are_json_on_stdout_under_json(tmp_path, root):
    r = cli("latest", str(tmp_path), "--json")
    assert r.exit_code == 1
    doc = r.json()
    assert doc["exit"] == 1 and doc["schema"] == 2
    assert doc["error"]["type"] == "NoValidCheckpoint" and "no committed checkpoint" in doc["error"]["message"]
    assert doc["error"]["hint"]
    r = cli("inspect", str(tmp_path / "typo"), "--json")
    assert r.exit_code == 2
    assert r.json()["error"]["message"] == f"no such file or directory: {tmp_path / 'typo'}"
    assert r.json()["exit"] == 2 and r.json()["error"]["type"] == "UsageError"
    assert "no such file or directory" in r.stderr  # the person still reads stderr
    # A verb that already printed its document and then exits 1 prints exactly one document.
    broken = str(tmp_path / "broken")
    make_checkpoints(broken, [1])
    os.unlink(os.path.join(ckpt_dir(broken, 1), MARKER))
    os.makedirs(ckpt_dir(broken, 2))
    with open(os.path.join(ckpt_dir(broken, 2), MARKER), "w") as f:
        f.write("{garbled")
    r = cli("verify", broken, "--all", "--json")
    assert r.exit_code == 1
    assert r.json()["ok"] is False and len(r.json()["checkpoints"]) == 1 and "error" not in r.json()


def _with_read_only_stdout(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``ckptctl ARGS`` whose stdout is a file opened read-only: every write fails with an
    OSError that is no ckptctl error (a real fault, like a broken log redirection)."""
    target = tmp_path / "stdout"
    target.write_text("")
    full_env = {k: v for k, v in os.environ.items() if k != "CKPTCTL_DEBUG"}
    with open(target, "rb") as ro:
        return subprocess.run([sys.executable, "-m", "ckptctl.cli", *args], stdout=ro, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**full_env, **(env or {})})


def test_an_unexpected_exception_is_exit_3_with_one_line(tmp_path, root):
    p = _with_read_only_stdout(tmp_path, "ls", root)
    assert p.returncode == 3, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("internal error: OSError:") and "--debug" in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    for debug in (["--debug", "ls", root], ["ls", root]):
        p = _with_read_only_stdout(tmp_path, *debug, env=None if debug[0] == "--debug" else {"CKPTCTL_DEBUG": "1"})
        assert p.returncode != 0 and "Traceback" in p.stderr, (debug, p.stderr)


def test_version():
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"ckptctl {__version__}"
    r = cli_subprocess("--version")
    assert r.exit_code == 0 and __version__ in r.stdout


def test_piped_output_is_one_line_per_record_whatever_columns(tmp_path):
    names = [f"{LONG}_{i}" for i in range(6)]
    with Checkpointer(str(tmp_path)) as ck:
        path = ck.save(1, {"model": {n: torch.zeros(4) for n in names}}).wait()
    for columns in ("20", "80", "400"):
        r = cli_subprocess("inspect", path, "--tensors", env={"COLUMNS": columns})
        assert r.exit_code == 0, r.stderr
        assert "…" not in r.stdout
        rows = [line for line in r.stdout.splitlines() if LONG in line]
        assert len(rows) == len(names), (columns, r.stdout)
        for line, name in zip(sorted(rows), sorted(names)):
            assert line.split()[0] == f"model/{name}" and line.split()[1] == "float32"
        r = cli_subprocess("ls", str(tmp_path), env={"COLUMNS": columns})
        lines = r.stdout.splitlines()
        assert len(lines) == 2 and lines[1].split()[-1] == ckpt_dir(str(tmp_path), 1), r.stdout


@pytest.mark.parametrize("value", ["many", "0", "-3", "2.5"])
def test_a_malformed_settings_variable_is_exit_2_naming_it(root, value):
    r = cli_subprocess("ls", root, env={"CKPTCTL_IO_THREADS": value})
    assert r.exit_code == 2, r.stderr
    assert "CKPTCTL_IO_THREADS" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_settings_come_from_the_environment():
    code = "from ckptctl import settings as s; print(s.IO_THREADS, s.VERIFY_THREADS, s.COPY_THREADS, s.STREAM_THREADS)"
    env = {**os.environ, "CKPTCTL_IO_THREADS": "3", "CKPTCTL_VERIFY_THREADS": " 2 ", "CKPTCTL_COPY_THREADS": ""}
    env.pop("CKPTCTL_STREAM_THREADS", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["3", "2", "4", "4"]  # set, set with blanks, empty = default, unset = default


def test_every_json_object_carries_the_schema_version(root, tmp_path):
    ckpt = ckpt_dir(root, 2)
    docs = {
        "inspect": cli("inspect", ckpt, "--json"),
        "verify": cli("verify", ckpt, "--json"),
        "verify --all": cli("verify", root, "--all", "--json"),
        "latest": cli("latest", root, "--json"),
        "interval": cli("interval", "--cost", "30s", "--mtbf", "1d", "--json"),
        "prune --dry-run": cli("prune", root, "--keep-last", "1", "--dry-run", "--json"),
        "cp": cli("cp", ckpt, str(tmp_path / "copy"), "--json"),
    }
    for verb, r in docs.items():
        assert r.exit_code == 0, (verb, r.stderr)
        assert r.json()["schema"] == 2, verb
    listed = cli("ls", root, "--json").json()  # an object too, the checkpoints under "checkpoints"
    assert listed["schema"] == 2 and isinstance(listed["checkpoints"], list)


@pytest.mark.parametrize("shell, script", [("bash", "COMP_WORDS"), ("zsh", "#compdef"), ("fish", "complete --command")])
def test_shell_completion_is_available(shell, script):
    # The shell named wins over the one typer detects from the parent processes: run under
    # /bin/sh (a Dockerfile RUN, cron, a CI step), detection found "sh" and the command failed
    # with "Shell sh not supported"; under bash, zsh's script request printed bash's.
    p = subprocess.run(["/bin/sh", "-c", '"$0" -m ckptctl.cli --show-completion "$1"', sys.executable, shell],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and script in p.stdout, (p.returncode, p.stderr)
    assert "--install-completion" in cli("--help").stdout


def test_object_storage_targets(s3_url):
    # An object-store prefix with nothing under it cannot be told from a missing one: as one
    # checkpoint it is "no such file or directory"; as a root it is an empty root.
    r = cli("inspect", f"{s3_url}/step-0000000001")
    assert r.exit_code == 2 and "no such file or directory" in r.stderr, r.stderr
    assert cli("latest", s3_url).exit_code == 1
    make_checkpoints(s3_url, [1, 2, 3])
    r = cli("verify", s3_url)
    assert r.exit_code == 2 and "this is a root holding 3 checkpoints; did you mean --latest?" in r.stderr, r.stderr
    assert cli("inspect", f"{s3_url}/step-0000000003", "--json").json()["step"] == 3


def test_ls_and_verify_all_list_newest_last_with_a_summary(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 10])
    os.makedirs(ckpt_dir(root, 20))  # partial
    listed = cli("ls", root)
    steps = [int(line.split()[0]) for line in listed.stdout.splitlines()[1:]]
    assert steps == [1, 2, 10, 20]
    assert listed.stderr.startswith("4 checkpoints: 3 committed, 1 partial; total ") and "KiB" in listed.stderr
    verified = cli("verify", root, "--all")
    assert [line.split()[1] for line in verified.stdout.splitlines()] == [ckpt_dir(root, s) for s in (1, 2, 10)]
    assert verified.stderr.startswith("3 checkpoints verified: 3 ok, 0 failed;")
    assert [c["step"] for c in cli("verify", root, "--all", "--json").json()["checkpoints"]] == [1, 2, 10]


def test_prune_without_a_terminal_and_without_yes_is_a_usage_error(root):
    # Documented in prune's help and man page: exit 2, and nothing is deleted.
    p = subprocess.run([sys.executable, "-m", "ckptctl.cli", "prune", root, "--keep-last", "1"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--yes" in p.stderr, p.stderr
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000001", "step-0000000002"]
    page = (Path(__file__).resolve().parent.parent / "man" / "ckptctl-prune.1").read_text()
    assert "2 usage error, including no terminal to confirm on" in " ".join(page.split())


def _stderr_on_a_terminal(*args: str) -> str:
    """What ``ckptctl ARGS`` writes to stderr when stderr is a terminal (an 80x24
    pseudo-terminal; a fresh one is 0 columns wide, where tqdm draws nothing)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        p = subprocess.run([sys.executable, "-m", "ckptctl.cli", *args], stdout=subprocess.PIPE, stderr=slave,
                           stdin=subprocess.DEVNULL, timeout=120)
        assert p.returncode == 0
        shown = b""
        while select.select([master], [], [], 0.5)[0]:  # all of it is buffered: the process has exited
            data = os.read(master, 65536)
            if not data:
                break
            shown += data
        return shown.decode(errors="replace")
    finally:
        os.close(master)
        os.close(slave)


def test_progress_on_a_terminal_in_binary_units_and_none_with_quiet(root):
    ckpt = ckpt_dir(root, 2)
    shown = _stderr_on_a_terminal("verify", ckpt)
    assert "verify:" in shown and "iB" in shown and " MB" not in shown and " kB" not in shown, shown
    assert _stderr_on_a_terminal("verify", ckpt, "--quiet") == ""
    assert _stderr_on_a_terminal("latest", root, "-q") == ""
