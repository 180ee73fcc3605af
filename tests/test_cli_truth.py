"""What the CLI says is what is true (issue 30), on roots the stacks themselves wrote: a real
Hugging Face ``Trainer``, accelerate's ``save_state``, Lightning's ``ModelCheckpoint`` and
``torch.distributed.checkpoint.save`` (torchtitan's ``step-N``), each built once per module and
copied into each test's root.

- ``verify ROOT --latest`` exits 1 whenever the newest committed checkpoint fails, naming it and
  the one ``latest`` resumes instead (it exited 0 because an older one verified);
- a verdict says ``checksums`` only where every byte was hashed against a recorded checksum:
  a flipped byte in a format without checksums passes as ``structure``, with the hint to
  ``seal`` on every verb that judges it, ``latest`` included; ``0 B read`` never goes with ok.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Callable

import pytest
import torch

from helpers import cli

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[frameworks]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[frameworks]')")
pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")


def _hf(out: str) -> str:
    from test_frameworks import _tiny_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _tiny_trainer(out, max_steps=4).train()
    return out


def _accelerate(out: str) -> str:
    from test_accelerate import save_state_root

    return save_state_root(out)


def _lightning(out: str) -> str:
    from test_frameworks import _lightning_run

    _lightning_run(out)
    return out


def _dcp(out: str) -> str:
    from test_layouts import dcp_step

    for step in (1, 2):
        dcp_step(out, step)
    return out


BUILDERS: dict[str, Callable[[str], str]] = {"hf-trainer": _hf, "accelerate": _accelerate, "lightning": _lightning,
                                             "dcp": _dcp}
# Each root's checkpoints, oldest first, as the stack named them.
NAMES = {"hf-trainer": ["checkpoint-2", "checkpoint-4"], "accelerate": ["checkpoint_0", "checkpoint_1", "checkpoint_2"],
         "lightning": ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"], "dcp": ["step-1", "step-2"]}


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {}


@pytest.fixture
def real_root(templates: dict[str, str], tmp_path_factory: pytest.TempPathFactory, tmp_path) -> Callable[[str], str]:
    """A copy of the root the stack ``name`` wrote (built on first use in this module)."""

    def copy(name: str) -> str:
        if name not in templates:
            templates[name] = BUILDERS[name](str(tmp_path_factory.mktemp(name) / "root"))
        out = str(tmp_path / name)
        shutil.copytree(templates[name], out, symlinks=True)
        return out

    return copy


def _data_file(ckpt: str) -> str:
    """The file of ``ckpt`` that holds its model's tensors."""
    if os.path.isfile(ckpt):
        return ckpt
    names = sorted(os.listdir(ckpt))
    return os.path.join(ckpt, next(n for n in names if n == "model.safetensors" or n.endswith(".distcp")))


def _break(path: str) -> None:
    """Damage the checkpoint at ``path`` so that every layout's own check sees it: a data file
    cut short (its header or records name bytes that are not there), or, for a one-file torch
    zip (Lightning, whose commit rule calls a short file unfinished), one record's bytes flipped
    (its CRC-32 no longer matches)."""
    if os.path.isfile(path):
        from test_integration_stacks import _flip_in_data

        _flip_in_data(path)
        return
    data = _data_file(path)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 16)


@pytest.mark.parametrize("stack", list(BUILDERS))
def test_verify_latest_fails_when_the_newest_checkpoint_fails(stack: str, real_root) -> None:
    root = real_root(stack)
    *_, older, newest = [os.path.join(root, n) for n in NAMES[stack]]
    _break(newest)
    r = cli("verify", root, "--latest")
    assert r.exit_code == 1, r.stdout + r.stderr  # main: 0, because the older one verifies
    assert f"FAILED  {newest}" in r.stdout and f"ok  {older}" in r.stdout, r.stdout
    assert f"`ckptctl latest` would resume {older}" in r.stderr, r.stderr
    doc = cli("verify", root, "--latest", "--json").json()
    assert not doc["ok"] and [c["ok"] for c in doc["checkpoints"]][:2] == [False, True]
    assert older in doc["fallback"]
    got = cli("latest", root)  # the pre-resume check still names the one to resume
    assert got.exit_code == 0 and got.stdout.strip() == older, got.stdout + got.stderr


def _flip_tensor_byte(path: str) -> None:
    """One bit of a tensor's bytes flipped, past the file's header: a value that still decodes."""
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        b = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("stack", ["hf-trainer", "accelerate", "dcp"])
def test_no_checksum_recorded_is_structure_with_the_seal_hint_on_every_verb(stack: str, real_root) -> None:
    root = real_root(stack)
    newest = os.path.join(root, NAMES[stack][-1])
    _flip_tensor_byte(_data_file(newest))
    r = cli("verify", newest)
    assert r.exit_code == 0, r.stdout + r.stderr  # nothing records what the byte was
    assert r.stdout.startswith(f"ok  {newest}") and "(structure)" in r.stdout and "(checksums)" not in r.stdout
    assert " 0 B read" not in r.stdout, r.stdout  # main, DCP: "0 B read ... (checksums)"
    assert f"`ckptctl seal {newest}`" in r.stderr, r.stderr
    assert cli("verify", newest, "--json").json()["checkpoints"][0]["checked"] == "structure"
    for args in (["verify", root, "--latest"], ["verify", root, "--all"], ["latest", root],
                 ["prune", root, "--keep-last", "1", "--dry-run"]):
        r = cli(*args)
        assert r.exit_code == 0 and "(checksums)" not in r.stdout, (args, r.stdout)
        assert f"`ckptctl seal {newest}`" in r.stderr, (args, r.stderr)  # main: only for one checkpoint
    assert cli("latest", root, "--json").json()["checked"] == "structure"
    # sealed, its bytes have checksums: now verify says so, and sees the next flipped bit
    assert cli("seal", newest).exit_code == 0
    r = cli("verify", newest)
    assert r.exit_code == 0 and "(checksums)" in r.stdout and "ckptctl seal" not in r.stderr, r.stdout + r.stderr
    _flip_tensor_byte(_data_file(newest))
    assert cli("verify", newest).exit_code == 1


ROOT_VERBS = [("latest", "{}", "ckptctl latest {}"), ("verify", "{} --latest", "ckptctl verify {} --latest"),
              ("verify", "{} --all", "ckptctl verify {} --all"),
              ("prune", "{} --keep-last 1 --dry-run", "ckptctl prune {} ..."), ("du", "{}", "ckptctl du {}")]


@pytest.mark.parametrize(("verb", "args", "fix"), ROOT_VERBS)
def test_a_root_verb_one_level_off_names_the_path_to_use(verb: str, args: str, fix: str, real_root, tmp_path) -> None:
    """torchtitan's dump folder holds its steps in ``checkpoint/``: given the dump folder or one
    step, each root-level verb says so and names the root (main: "nothing has been saved here
    yet", exit 1; ``du``: "0 checkpoints", exit 0)."""
    dump = str(tmp_path / "dump")
    os.makedirs(dump)
    root = os.path.join(dump, "checkpoint")
    shutil.move(real_root("dcp"), root)
    step = os.path.join(root, "step-2")
    for given, use, said in ((step, root, "is a dcp checkpoint, not a root of checkpoints"),
                             (dump, root, "no checkpoint directly in")):
        r = cli(verb, *args.format(given).split())
        assert r.exit_code == 2 and said in r.stderr and f"`{fix.format(use)}`" in r.stderr, (given, r.stderr)
        assert "Traceback" not in r.stderr and "nothing has been saved" not in r.stderr
    assert cli(verb, *args.format(root).split()).exit_code == 0  # what it names works


def test_lightning_inspect_counts_the_weights_as_the_model(real_root) -> None:
    """Lightning's ``state_dict`` is the model (main: ``model 0 B``, the weights under ``other``)."""
    newest = os.path.join(real_root("lightning"), NAMES["lightning"][-1])
    doc = cli("inspect", newest, "--json", "--tensors").json()
    model = {t["name"]: t["group"] for t in doc["tensors"] if t["name"].startswith("state_dict/")}
    assert set(model) == {"state_dict/layer.weight", "state_dict/layer.bias"} and set(model.values()) == {"model"}
    assert doc["bytes_by_group"]["model"] == (4 + 1) * 4, doc["bytes_by_group"]  # Linear(4, 1) in fp32


def test_accelerate_save_index_is_labelled_and_step_rules_refuse_it(real_root) -> None:
    """accelerate's automatic ``checkpoint_N`` counts saves, not training steps (the ``step`` in
    ``random_states_0.pkl`` is its gradient accumulation counter, reset each epoch): ``ls`` and
    ``inspect`` say so, and prune's step rules refuse the root before deleting anything (main:
    the save index shown as STEP, ``inspect`` said ``step -``, and ``--keep-every 2`` deleted
    checkpoint_1 as a step that is no multiple of 2)."""
    root = real_root("accelerate")
    names = NAMES["accelerate"]
    r = cli("ls", root)
    assert r.exit_code == 0 and all(f"{i}*  accelerate" in r.stdout for i in range(3)), r.stdout
    assert "* not a training step: the save index in the name (checkpoint_0 to checkpoint_2)" in r.stderr, r.stderr
    rows = cli("ls", root, "--json").json()["checkpoints"]
    assert [(x["step"], x["numbered_by"]) for x in rows] == [(i, "save index") for i in range(3)]
    newest = os.path.join(root, names[-1])
    r = cli("inspect", newest)
    assert "save index  2   (not a training step" in r.stdout and "\nstep " not in r.stdout, r.stdout
    doc = cli("inspect", newest, "--json").json()
    assert (doc["step"], doc["numbered_by"]) == (2, "save index")
    for args in (["prune", root, "--keep-every", "2", "--yes"], ["prune", root, "--keep-last", "1", "--keep", "1", "--yes"],
                 ["prune", root, "--keep-every", "2", "--dry-run", "--json"], ["du", root, "--keep-every", "2"]):
        r = cli(*args)
        flag = "--keep-every" if "--keep-every" in args else "--keep"
        said = r.json()["error"]["message"] if "--json" in args else r.stderr.removeprefix("usage error: ")
        assert r.exit_code == 2 and said.startswith(f"{flag} reads checkpoint numbers as training steps") \
            and f"by save index under {root}" in said, (args, r.stdout + r.stderr)
        assert "Traceback" not in r.stderr and "--keep-last N" in r.stdout + r.stderr
        assert sorted(os.listdir(root)) == names, args  # nothing deleted
    r = cli("prune", root, "--keep-last", "2", "--yes")  # a rule that reads only their order still works
    assert r.exit_code == 0 and sorted(os.listdir(root)) == names[1:], r.stdout + r.stderr


def test_accelerate_save_index_is_named_so_by_latest_verify_and_prune(real_root) -> None:
    """Every verdict names accelerate's checkpoint_N by what N counts, as ls and inspect do
    (main: ``latest --json`` had no numbered_by, and verify's lines, its fallback and prune's
    anchor and reasons said ``step 2`` of a save index)."""
    root = real_root("accelerate")
    names = NAMES["accelerate"]
    doc = cli("latest", root, "--json").json()
    assert (doc["step"], doc["numbered_by"], doc["layout"]) == (2, "save index", "accelerate"), doc
    r = cli("verify", root, "--latest")
    assert r.exit_code == 0 and r.stdout.startswith(f"ok  {os.path.join(root, names[-1])}  save index 2: "), r.stdout
    assert cli("verify", root, "--latest", "--json").json()["checkpoints"][0]["numbered_by"] == "save index"
    r = cli("prune", root, "--keep-last", "1", "--dry-run")
    assert r.exit_code == 0 and f"anchor: {os.path.join(root, names[-1])} (save index 2, " in r.stdout, r.stdout
    assert r.stdout.count("older than the anchor (save index 2)") == 2 and "step 2" not in r.stdout, r.stdout
    items = cli("prune", root, "--keep-last", "1", "--dry-run", "--json").json()["plan"]["items"]
    assert {i["numbered_by"] for i in items} == {"save index"}, items
    _break(os.path.join(root, names[-1]))  # the fallback names the one a resume takes by its save index
    r = cli("verify", root, "--latest")
    assert r.exit_code == 1 and f"would resume {os.path.join(root, names[1])} (save index 1)" in r.stdout + r.stderr
    assert "step" not in r.stdout + r.stderr.replace("training step", ""), r.stdout + r.stderr


def test_step_rules_still_apply_to_roots_numbered_by_step(real_root) -> None:
    """The refusal is the layout's: a root of training steps (the Trainer's checkpoint-N) keeps
    --keep-every and --keep, and its ls and inspect say step."""
    root = real_root("hf-trainer")
    assert {x["numbered_by"] for x in cli("ls", root, "--json").json()["checkpoints"]} == {"step"}
    r = cli("prune", root, "--keep-every", "4", "--keep", "2", "--dry-run")
    assert r.exit_code == 0 and "pinned" in r.stdout and "keep-every 4" in r.stdout, r.stdout + r.stderr
    assert cli("inspect", os.path.join(root, "checkpoint-4"), "--json").json()["numbered_by"] == "step"


def test_lightning_last_ckpt_is_shown_as_an_alias_never_pruned_nor_counted(real_root) -> None:
    """``last.ckpt`` (``ModelCheckpoint(save_last=True)``: a copy of the newest save, rewritten at
    every save) is shown by ``ls`` with the step it records and the checkpoint of that step
    (main: never mentioned), and is no checkpoint of its own: ``--keep-last 1`` keeps the real
    step 6 besides it, and prune never deletes it, copy or symlink (``save_last="link"``)."""
    root = real_root("lightning")
    names = NAMES["lightning"]
    r = cli("ls", root)
    assert r.exit_code == 0 and "last.ckpt" not in r.stdout, r.stdout
    assert f"last.ckpt: step 6, as {names[-1]}; ModelCheckpoint(save_last=True)'s copy" in r.stderr, r.stderr
    assert "prune never deletes or counts it" in r.stderr
    doc = cli("ls", root, "--json").json()
    assert [(a["name"], a["layout"], a["step"], a["same_as"]) for a in doc["aliases"]] == [
        ("last.ckpt", "lightning", 6, names[-1])]
    assert [c["name"] for c in doc["checkpoints"]] == names
    # The run's first save is its best (ModelCheckpoint's best_model_path): kept as Lightning keeps it.
    r = cli("prune", root, "--keep-last", "1", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["name"]: (i["action"], i["reason"]) for i in r.json()["plan"]["items"]}
    assert set(plan) == set(names) and plan[names[-1]][0] == "keep" and "keep-last 1" in plan[names[-1]][1], plan
    assert plan[names[1]][0] == "delete" and "best_model_path" in plan[names[0]][1], plan
    assert sorted(os.listdir(root)) == sorted([names[0], names[-1], "last.ckpt"])
    os.unlink(os.path.join(root, "last.ckpt"))
    os.symlink(names[-1], os.path.join(root, "last.ckpt"))  # save_last="link"
    r = cli("ls", root)
    assert "last.ckpt: step unknown; ModelCheckpoint(save_last=\"link\")'s link" in r.stderr, r.stderr
    assert cli("prune", root, "--keep-last", "1", "--yes").exit_code == 0
    assert sorted(os.listdir(root)) == sorted([names[0], names[-1], "last.ckpt"])
    assert os.path.islink(os.path.join(root, "last.ckpt"))
