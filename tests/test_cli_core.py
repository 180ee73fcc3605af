"""ls / inspect / verify / latest through the real CLI: output, --json and exit codes."""

from __future__ import annotations

import os

import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER
from helpers import ckpt_dir, cli, cli_subprocess, make_checkpoints


def test_ls_sorts_numerically_and_shows_status(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [9, 10, 100])
    os.makedirs(os.path.join(root, "step-0000000200"))  # being written: no marker
    os.rename(ckpt_dir(root, 9), os.path.join(root, "step-9"))  # hand-named, unpadded
    rows = cli("ls", root, "--json").json()["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [(9, "committed"), (10, "committed"), (100, "committed"), (200, "partial")]
    human = cli("ls", root)
    assert human.exit_code == 0 and "partial" in human.stdout


def test_inspect_reports_groups_and_tensors(tmp_path):
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with Checkpointer(str(tmp_path)) as ck:
        path = ck.save(7, {"model": model, "optimizer": opt, "extra": {"lr": 0.1}}).wait()
    doc = cli("inspect", path, "--tensors", "--json").json()
    assert doc["step"] == 7 and doc["world_size"] == 1
    assert doc["bytes_by_group"]["model"] == (64 * 32 + 32) * 4
    assert doc["bytes_by_group"]["optimizer"] >= 2 * doc["bytes_by_group"]["model"]  # Adam: 2 moments
    assert "extra" in doc["state_keys"]
    names = {t["name"] for t in doc["tensors"]}
    assert "model/weight" in names and "optimizer/state/weight/exp_avg" in names
    assert doc["stats"]["stall_s"] > 0
    human = cli("inspect", path)
    assert "optimizer" in human.stdout and human.exit_code == 0


def test_latest_skips_a_corrupt_newest_and_exit_1_when_none(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    newest = ckpt_dir(root, 2)
    shard = next(n for n in os.listdir(newest) if n.endswith(".safetensors"))
    with open(os.path.join(newest, shard), "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x00\x01\x02")
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 1)
    assert "skipped" in r.stderr and "step-0000000002" in r.stderr
    # quick level does not read data and accepts the newest
    assert cli("latest", root, "--level", "quick").stdout.strip() == newest
    os.unlink(os.path.join(ckpt_dir(root, 1), MARKER))
    r = cli("latest", root)
    assert r.exit_code == 1 and "none of 1 committed" in r.stderr


def test_verify_root_latest_and_all(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3])
    doc = cli("verify", root, "--all", "--json").json()
    assert doc["ok"] and [c["step"] for c in doc["checkpoints"]] == [1, 2, 3]  # newest last, as ls
    doc = cli("verify", root, "--latest", "--json").json()
    assert [c["step"] for c in doc["checkpoints"]] == [3]


def test_exit_codes_usage_and_missing(tmp_path):
    assert cli("verify", str(tmp_path), "--quick", "--load").exit_code == 2
    assert cli("latest", str(tmp_path), "--level", "bogus").exit_code == 2
    r = cli("latest", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "no such file or directory" in r.stderr and "Traceback" not in r.stderr
    r = cli("inspect", str(tmp_path))  # an empty directory: not a checkpoint
    assert r.exit_code == 1 and "not a checkpoint" in r.stderr
    os.makedirs(ckpt_dir(str(tmp_path), 5))  # a step directory being written: no marker yet
    r = cli("inspect", ckpt_dir(str(tmp_path), 5))
    assert r.exit_code == 1 and "not committed" in r.stderr


def test_console_script_runs_in_a_real_process(tmp_path):
    make_checkpoints(str(tmp_path), [1])
    r = cli_subprocess("latest", str(tmp_path))
    assert r.exit_code == 0
    assert r.stdout.strip() == ckpt_dir(str(tmp_path), 1)
    r = cli_subprocess("--help")
    assert r.exit_code == 0 and "verify" in r.stdout


def test_help_paragraphs_wrap_to_the_terminal_not_to_the_source():
    # Typer keeps a docstring's line breaks; ours are joined first, so at any width a
    # paragraph is only broken where the terminal needs it.
    from inspect import cleandoc

    from ckptctl.cli.app import app

    for command in app.registered_commands:
        r = cli_subprocess(command.name, "--help", env={"TERMINAL_WIDTH": "1000", "TERM": "dumb"})
        assert r.exit_code == 0, r.stderr
        shown = [line.strip(" │") for line in r.stdout.splitlines()]
        for paragraph in cleandoc(command.callback.__doc__ or "").split("\n\n")[1:]:
            one_line = " ".join(part.strip() for part in paragraph.splitlines())
            assert one_line in shown, f"ckptctl {command.name} --help broke: {one_line[:60]!r}"
