"""The wrong level gets a hint, never a silent or misleading answer (issue 20, item 7).

Each case is a real directory laid out as its tool writes it (ckptctl's Checkpointer,
torchtitan's DCP ``checkpoint/step-N`` under its dump folder, Lightning's ``ModelCheckpoint``)
and the CLI runs as a real process where its streams matter:

- ``ls`` of one checkpoint is a usage error (exit 2) pointing at ``inspect`` and at its parent:
  "0 checkpoints, exit 0" read as a fresh run;
- ``ls`` of a folder whose subdirectory holds the checkpoints lists nothing (exit 0: that is
  the truth about the folder) with a hint on stderr naming the subdirectory;
- ``restore`` judges SRC by the listing ``ls`` shows: Lightning's one-file checkpoints are
  refused saying restore does not copy them, never "nothing has been saved there";
- ``reshard`` of a DCP step says it takes ckptctl checkpoints and how to make one, not that a
  DCP directory is accepted;
- an empty partial directory shows its directory's age, never 1970's;
- every ``ckptctl VERB --option`` a hint or message names exists on that verb.
"""

from __future__ import annotations

import ast
import os
import re
import time
from pathlib import Path

import pytest

from ckptctl.cli.app import app
from helpers import ckpt_dir, cli, cli_subprocess, make_checkpoints

PACKAGE = Path(__file__).resolve().parent.parent / "ckptctl"
# A command line as hints write one: `ckptctl VERB ...` in backticks, or $(ckptctl VERB ...).
_COMMAND = re.compile(r"(?:`|\$\()ckptctl ([a-z]+)([^`)]*)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def dcp_step(root: str, step: int) -> str:
    """A torchtitan checkpoint, ``step-{step}`` under its ``checkpoint/`` folder
    (torchtitan/components/checkpoint.py), written by the real DCP writer (as
    tests/test_layouts.py makes them)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, f"step-{step}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.full((64,), float(step))}, "train_state": {"step": step}}, checkpoint_id=path)
    return path


def _verb_options() -> dict[str, set[str]]:
    import typer.main

    group = typer.main.get_group(app)
    return {name: {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
            for name, cmd in group.commands.items()}


def _named(text: str) -> list[tuple[str, str | None]]:
    """(verb, option) for every ``ckptctl VERB ... --option`` in ``text`` (option None for a
    verb named without one)."""
    found: list[tuple[str, str | None]] = []
    for m in _COMMAND.finditer(text):
        opts = _OPTION.findall(m.group(2))
        found.extend((m.group(1), o) for o in opts) if opts else found.append((m.group(1), None))
    return found


def _check_named(text: str, verbs: dict[str, set[str]]) -> list[str]:
    bad = []
    for verb, opt in _named(text):
        if verb not in verbs:
            bad.append(f"`ckptctl {verb}`: no such verb in {text!r}")
        elif opt is not None and opt not in verbs[verb] | {"--help", "-h"}:
            bad.append(f"`ckptctl {verb} {opt}`: {verb} has no {opt} (in {text!r})")
    return bad


def _source_strings(path: Path) -> list[str]:
    """Every string literal of a module, f-strings with their fields as X."""
    tree = ast.parse(path.read_text(), str(path))
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            texts.append("".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
    return texts


def test_the_checker_fails_on_an_option_the_verb_lacks():
    verbs = _verb_options()
    assert _check_named("pass --latest or --all: `ckptctl verify ROOT --latest`", verbs) == []
    assert _check_named("`ckptctl inspect ROOT --latest`", verbs)  # inspect has no --latest
    assert _check_named("`ckptctl frobnicate ROOT`", verbs)


def test_every_hint_names_options_its_verb_has():
    verbs = _verb_options()
    bad = [f"{path.relative_to(PACKAGE.parent)}: {b}"
           for path in sorted(PACKAGE.rglob("*.py")) for text in _source_strings(path)
           for b in _check_named(text, verbs)]
    assert bad == []


# --- ls -----------------------------------------------------------------------------------------


def test_ls_of_one_checkpoint_is_a_usage_error_naming_inspect_and_its_parent(tmp_path):
    root = str(tmp_path / "ckpt")
    one = make_checkpoints(root, [1, 2])[0]
    dump = tmp_path / "dump" / "checkpoint"
    dcp = dcp_step(str(dump), 10)
    for path, what in ((one, "a ckptctl checkpoint"), (dcp, "a dcp checkpoint")):
        r = cli_subprocess("ls", path)
        assert r.exit_code == 2, (path, r.exit_code, r.stderr)
        assert r.stdout == ""
        assert f"{path} is {what}, not a root of checkpoints" in r.stderr, r.stderr
        assert f"`ckptctl inspect {path}`" in r.stderr and f"`ckptctl ls {os.path.dirname(path)}`" in r.stderr
        assert _check_named(r.stderr, _verb_options()) == []
        doc = cli("ls", path, "--json").json()  # under --json, the error is JSON on stdout
        assert doc["exit"] == 2 and doc["error"]["type"] == "UsageError"
    assert cli("inspect", one).exit_code == 0 and cli("ls", root).exit_code == 0  # what the hint suggests works


def test_ls_of_torchtitans_dump_folder_hints_at_its_checkpoint_subdirectory(tmp_path):
    dump = tmp_path / "outputs"
    for s in (10, 20):
        dcp_step(str(dump / "checkpoint"), s)
    (dump / "tb").mkdir()  # torchtitan's tensorboard folder beside it
    r = cli_subprocess("ls", str(dump))
    assert r.exit_code == 0, r.stderr  # the listing is true: nothing directly in it
    assert r.stdout.split() == ["STEP", "FORMAT", "STATUS", "SIZE", "AGE", "PATH"]
    assert "checkpoint/ holds 2 checkpoints" in r.stderr and f"`ckptctl ls {dump}/checkpoint`" in r.stderr, r.stderr
    r = cli_subprocess("ls", str(dump), "--json")
    assert r.exit_code == 0 and r.json()["checkpoints"] == [] and "checkpoint/ holds 2" in r.stderr
    r = cli("ls", str(dump / "checkpoint"), "--json")
    assert [c["step"] for c in r.json()["checkpoints"]] == [10, 20]


def test_ls_of_an_empty_root_stays_quiet_and_exit_0(tmp_path):
    (tmp_path / "logs").mkdir()  # a subdirectory holding no checkpoint: no hint
    r = cli_subprocess("ls", str(tmp_path))
    assert r.exit_code == 0 and "hint" not in r.stderr, r.stderr


def test_an_empty_partial_shows_its_directory_age_not_the_epoch(tmp_path):
    root = str(tmp_path)
    os.makedirs(ckpt_dir(root, 7))
    old = time.time() - 3600
    os.utime(ckpt_dir(root, 7), (old, old))
    (row,) = cli("ls", root, "--json").json()["checkpoints"]
    assert row["status"] == "partial" and row["created"] == pytest.approx(old, abs=1)
    assert 3500 < row["age_s"] < 4000, row
    r = cli("ls", root)
    assert " 1h" in r.stdout and "d " not in r.stdout, r.stdout


# --- restore, reshard ----------------------------------------------------------------------------


def test_restore_of_a_lightning_dirpath_says_it_does_not_copy_one_file_checkpoints(tmp_path):
    from test_frameworks import _lightning_run

    out = str(tmp_path / "ckpts")
    _lightning_run(out)
    listed = cli("ls", out, "--json").json()["counts"]["committed"]
    assert listed == 3
    r = cli_subprocess("restore", out, str(tmp_path / "dst"))
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.stderr)
    assert "holds 3 Lightning checkpoints" in r.stderr and "nothing has been saved" not in r.stderr, r.stderr
    assert "ckptctl latest SRC --format lightning" in r.stderr
    assert _check_named(r.stderr, _verb_options()) == []
    r = cli_subprocess("restore", os.path.join(out, "epoch=0-step=4.ckpt"), str(tmp_path / "dst"))
    assert r.exit_code == 2 and "lightning checkpoint file" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "dst")
    r = cli_subprocess("ls", os.path.join(out, "epoch=0-step=4.ckpt"))
    assert r.exit_code == 2 and "lightning checkpoint file, not a root" in r.stderr, r.stderr


def test_restore_of_a_dump_folder_names_the_subdirectory(tmp_path):
    dump = tmp_path / "outputs"
    dcp_step(str(dump / "checkpoint"), 10)
    r = cli("restore", str(dump), str(tmp_path / "dst"))
    assert r.exit_code == 1 and "checkpoint/ holds 1 checkpoint" in r.stderr, r.stderr
    assert f"`ckptctl restore {dump}/checkpoint DST`" in r.stderr and "nothing has been saved" not in r.stderr
    os.makedirs(ckpt_dir(str(tmp_path / "partial"), 3))  # partials only: said so, with ls to see why
    r = cli("restore", str(tmp_path / "partial"), str(tmp_path / "dst"))
    assert r.exit_code == 1 and "no committed checkpoint to restore (1 partial)" in r.stderr, r.stderr
    (tmp_path / "empty").mkdir()
    r = cli("restore", str(tmp_path / "empty"), str(tmp_path / "dst"))
    assert r.exit_code == 1 and "nothing has been saved there" in r.stderr  # only where it is true


def test_reshard_of_a_dcp_step_says_what_it_takes(tmp_path):
    step = dcp_step(str(tmp_path / "checkpoint"), 10)
    r = cli("reshard", step, str(tmp_path / "out"), "--world-size", "2")
    assert r.exit_code == 1, r.stderr
    assert "is a dcp checkpoint; reshard takes ckptctl checkpoints only" in r.stderr, r.stderr
    assert f"`ckptctl convert {step} DIR --to ckptctl`" in r.stderr and "a DCP directory" not in r.stderr
    assert not os.path.exists(tmp_path / "out")


def test_a_root_given_for_one_checkpoint_names_only_options_the_verb_has(tmp_path):
    root = str(tmp_path / "root")
    make_checkpoints(root, [1, 2])
    verbs = _verb_options()
    for args in (["inspect", root], ["verify", root], ["reshard", root, str(tmp_path / "o"), "-w", "1"],
                 ["cp", root, str(tmp_path / "c")]):
        r = cli(*args)
        assert r.exit_code == 2 and "this is a root holding 2 checkpoints" in r.stderr, (args, r.stderr)
        assert _check_named(r.stderr, verbs) == [], args
        assert ("--latest" in r.stderr) == (args[0] == "verify"), (args, r.stderr)


def test_ls_of_one_checkpoint_on_object_storage(s3_url):
    make_checkpoints(s3_url, [1, 2])
    r = cli("ls", f"{s3_url}/step-0000000002")
    assert r.exit_code == 2 and "is a ckptctl checkpoint, not a root of checkpoints" in r.stderr, r.stderr
    assert f"`ckptctl ls {s3_url}`" in r.stderr
    r = cli("ls", s3_url.rsplit("/", 1)[0])  # the bucket above the run: the run is named
    assert r.exit_code == 0 and "prefix/ holds 2 checkpoints" in r.stderr, r.stderr


def _hint_texts(path: Path) -> list[str]:
    """The text of every ``hint=`` argument in a module (f-string fields as X)."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.keyword) and node.arg == "hint":
            subs = list(ast.walk(node.value))
            parts = {id(v) for sub in subs if isinstance(sub, ast.JoinedStr) for v in sub.values}  # not alone
            for sub in subs:
                if isinstance(sub, ast.JoinedStr):
                    texts.append("".join(v.value if isinstance(v, ast.Constant) else "X" for v in sub.values))
                elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in parts:
                    texts.append(sub.value)
    return texts


def test_hint_texts_finds_hints_in_fstrings(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text('raise E("x", hint=f"pass --nope or `ckptctl ls {root}`")\n')
    assert _hint_texts(mod) == ["pass --nope or `ckptctl ls X`"]
    assert "--nope" not in _verb_options()["prune"]


def test_a_verbs_own_hints_name_only_its_options():
    # cli/VERB.py's hints speak to someone running VERB: "pass --yes" must be one of VERB's
    verbs = _verb_options()
    bad = []
    for name, options in verbs.items():
        path = PACKAGE / "cli" / f"{name}.py"
        if not path.exists():
            continue
        for text in _hint_texts(path):
            bare = _COMMAND.sub("", text)  # options of a command line the hint spells out are checked above
            bad += [f"{name}: {o} in {text!r}" for o in _OPTION.findall(bare) if o not in options]
    assert bad == []
