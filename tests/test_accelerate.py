"""Hugging Face Accelerate ``save_state`` roots (``layouts/accelerate.py``), written and resumed by
the real ``accelerate`` on CPU: ``ProjectConfiguration(automatic_checkpoint_naming=True)``
gives ``project_dir/checkpoints/checkpoint_N``.

Issue 20, case 6: ``ls checkpoints/`` showed 0 checkpoints; ``verify checkpoint_N`` of a
``save_state`` killed after ``model.safetensors`` said ok while ``load_state`` crashed; ``convert``
dropped ``optimizer.bin``, ``scheduler.bin`` and the RNG state without listing them.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from ckptctl.layouts import catalog
from ckptctl.layouts.accelerate import AccelerateLayout
from ckptctl.storage import open_storage
from helpers import cli

pytest.importorskip("accelerate")

# Three saves of a tiny model, optimizer, scheduler and shuffled loader, as accelerate's examples
# train: one epoch between saves. argv: project_dir.
_SAVE = r"""
import sys, warnings
warnings.simplefilter("ignore")
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
set_seed(0)
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True))
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
for _ in range(3):
    for x, y in dl:
        loss = ((model(x) - y) ** 2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    sched.step()
    acc.save_state()
"""

# A fresh job resuming as accelerate's examples do: `--resume_from_checkpoint PATH` handed to
# `accelerator.load_state`. argv: the broken checkpoint (its load_state must fail), then the
# arguments `ckptctl latest --resume-args` printed. Prints what was loaded.
_RESUME = r"""
import argparse, sys, warnings
warnings.simplefilter("ignore")
import torch
from accelerate import Accelerator
acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
model, opt, sched = acc.prepare(model, opt, sched)
try:
    acc.load_state(sys.argv[1])
except Exception as e:
    print("BROKEN-FAILED", type(e).__name__)
else:
    print("BROKEN-LOADED")
parser = argparse.ArgumentParser()
parser.add_argument("--resume_from_checkpoint")
args = parser.parse_args(sys.argv[2:])
acc.load_state(args.resume_from_checkpoint)
w = acc.unwrap_model(model).weight.detach().flatten().tolist()
print("WEIGHT", " ".join(repr(v) for v in w))
print("OPT_STEP", int(opt.state_dict()["state"][0]["step"]))
print("LR", sched.get_last_lr()[0])
"""


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def save_state_root(project: str) -> str:
    """Three real ``save_state`` calls into ``project``; returns ``project/checkpoints`` (also the
    layout conformance suite's template)."""
    _run(_SAVE, project)
    return os.path.join(project, "checkpoints")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """``project_dir/checkpoints`` after three real ``save_state`` calls (kept pristine: tests copy it)."""
    return save_state_root(str(tmp_path_factory.mktemp("accelerate") / "project"))


@pytest.fixture
def root(saved, tmp_path) -> str:
    out = str(tmp_path / "checkpoints")
    shutil.copytree(saved, out)
    return out


def kill_after_model(ckpt: str) -> None:
    """A ``save_state`` killed right after the model: ``save_accelerator_state`` writes the model
    first, then optimizer, scheduler and last ``random_states_0.pkl``."""
    for name in os.listdir(ckpt):
        if name != "model.safetensors":
            os.unlink(os.path.join(ckpt, name))


def test_real_save_state_writes_the_files_the_layout_reads(saved):
    assert sorted(os.listdir(saved)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(os.listdir(os.path.join(saved, "checkpoint_2"))) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]


def test_ls_lists_save_state_checkpoints(root):
    r = cli("ls", root, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    rows = {x["name"]: (x["layout"], x["status"]) for x in r.json()["checkpoints"]}
    assert rows == {f"checkpoint_{i}": ("accelerate", "committed") for i in range(3)}


def test_save_state_killed_after_the_model_does_not_verify(root):
    """Issue 20 case 6: only model.safetensors written. Before: verify said ok."""
    newest = os.path.join(root, "checkpoint_2")
    kill_after_model(newest)
    r = cli("verify", newest)
    assert r.exit_code == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    for missing in ("random_states_0.pkl", "optimizer.bin", "scheduler.bin"):
        assert missing in out, missing
    rows = {e.name: e for e in catalog.list_checkpoints(open_storage(root))}
    assert rows["checkpoint_2"].status == "partial" and "random_states_0.pkl" in rows["checkpoint_2"].reason
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == os.path.join(root, "checkpoint_1"), r.stdout + r.stderr
    r = cli("verify", root, "--latest", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("prune", root, "--keep-last", "1", "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["name"]: i["action"] for i in r.json()["plan"]["items"]}
    # the partial newest is left alone (it may still be written), the anchor is the newest complete one
    assert plan == {"checkpoint_0": "delete", "checkpoint_1": "keep", "checkpoint_2": "skip"}
    assert sorted(os.listdir(root)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]  # a dry run


def test_latest_resume_args_resume_the_newest_complete_save_in_accelerate(root):
    kill_after_model(os.path.join(root, "checkpoint_2"))
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0, r.stdout + r.stderr
    argv = shlex.split(r.stdout.strip())
    assert argv == ["--resume_from_checkpoint", os.path.join(root, "checkpoint_1")]
    out = _run(_RESUME, os.path.join(root, "checkpoint_2"), *argv)
    assert "BROKEN-FAILED" in out, out  # accelerate's own load_state crashes on the killed save
    from safetensors.torch import load_file

    want = load_file(os.path.join(root, "checkpoint_1", "model.safetensors"))["weight"].flatten().tolist()
    got = [float(v) for v in next(ln for ln in out.splitlines() if ln.startswith("WEIGHT")).split()[1:]]
    assert got == pytest.approx(want, abs=0)
    assert int(next(ln for ln in out.splitlines() if ln.startswith("OPT_STEP")).split()[1]) == 8  # 2 epochs x 4 batches
    assert float(next(ln for ln in out.splitlines() if ln.startswith("LR")).split()[1]) == pytest.approx(1e-2 / 4)


def test_load_level_decodes_every_file_rng_state_included(root):
    r = cli("verify", os.path.join(root, "checkpoint_1"), "--load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "not decoded" not in r.stdout and "unverified" not in r.stdout


def test_a_truncated_rng_file_is_an_unfinished_save(root):
    rng = os.path.join(root, "checkpoint_2", "random_states_0.pkl")
    with open(rng, "r+b") as f:
        f.truncate(os.path.getsize(rng) // 2)
    rows = {e.name: e for e in catalog.list_checkpoints(open_storage(root))}
    assert rows["checkpoint_2"].status == "partial" and "not a whole torch.save" in rows["checkpoint_2"].reason
    assert cli("verify", os.path.join(root, "checkpoint_2")).exit_code == 1


def test_a_zeroed_optimizer_file_fails_verify(root):
    opt = os.path.join(root, "checkpoint_2", "optimizer.bin")
    size = os.path.getsize(opt)
    with open(opt, "r+b") as f:
        f.write(b"\0" * size)
    r = cli("verify", os.path.join(root, "checkpoint_2"))
    assert r.exit_code == 1 and "optimizer.bin" in r.stdout + r.stderr
    r = cli("latest", root)
    assert r.stdout.strip() == os.path.join(root, "checkpoint_1"), r.stdout + r.stderr


def test_other_processes_rng_files_holes_and_a_missing_last_one(root):
    """Every process writes its own random_states_R.pkl with no commit record: a hole in the
    numbering is an unfinished save; a missing last one is caught against the previous save."""
    for i in range(3):
        d = os.path.join(root, f"checkpoint_{i}")
        shutil.copy(os.path.join(d, "random_states_0.pkl"), os.path.join(d, "random_states_1.pkl"))
    os.unlink(os.path.join(root, "checkpoint_2", "random_states_1.pkl"))  # process 1 died in its save
    r = cli("verify", os.path.join(root, "checkpoint_2"))
    assert r.exit_code == 1 and "random_states_1.pkl" in r.stdout + r.stderr, r.stdout + r.stderr
    assert cli("latest", root).stdout.strip() == os.path.join(root, "checkpoint_1")
    d = os.path.join(root, "checkpoint_1")
    shutil.copy(os.path.join(d, "random_states_0.pkl"), os.path.join(d, "random_states_3.pkl"))
    rows = {e.name: e for e in catalog.list_checkpoints(open_storage(root))}
    assert rows["checkpoint_1"].status == "partial" and "random_states_{2}" in rows["checkpoint_1"].reason


def test_convert_carries_the_training_state_or_lists_it_as_dropped(root, tmp_path):
    dst = str(tmp_path / "out.pt")
    r = cli("convert", os.path.join(root, "checkpoint_2"), dst, "--to", "torch", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["carried"] == ["optimizer.bin as optimizer/", "scheduler.bin as scheduler/"]
    assert any(d.startswith("random_states_0.pkl") for d in doc["dropped"]), doc["dropped"]
    out = torch.load(dst, weights_only=True)
    saved_opt = torch.load(os.path.join(root, "checkpoint_2", "optimizer.bin"), weights_only=True)
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
    assert out["scheduler"]["last_epoch"] == 3
    kill_after_model(os.path.join(root, "checkpoint_2"))
    os.unlink(dst)
    # without random_states_0.pkl it is a bare model directory: converted as safetensors, nothing to drop
    r = cli("convert", os.path.join(root, "checkpoint_2"), dst, "--to", "torch", "--json")
    assert r.exit_code == 0 and r.json()["carried"] == [], r.stdout + r.stderr


def test_empty_checkpoint_dir_and_model_only_saves(root):
    os.makedirs(os.path.join(root, "checkpoint_9"))  # save_state made it and died before writing
    os.makedirs(os.path.join(root, "step_9"))  # a user's empty folder: nobody's
    rows = {e.name: (e.layout, e.status) for e in catalog.list_checkpoints(open_storage(root))}
    assert rows["checkpoint_9"] == ("accelerate", "partial") and rows["step_9"] == ("unknown", "unknown")
    layout = AccelerateLayout().for_root(open_storage(root))
    st = open_storage(os.path.join(root, "checkpoint_1"))
    assert layout.kind_of_checkpoint(st).resumable
    os.unlink(os.path.join(root, "checkpoint_1", "optimizer.bin"))
    kind = layout.kind_of_checkpoint(st)
    assert kind.kind == "export" and "optimizer" in kind.reason


def test_a_save_state_into_a_trainer_style_name_is_never_deleted_as_a_partial(root):
    # save_state(output_dir=".../checkpoint-7"): the Trainer's name, accelerate's files. By the
    # Trainer's rule it is a save that never wrote trainer_state.json; by accelerate's it is
    # complete. A directory complete by any known rule is never deleted as an abandoned save.
    os.rename(os.path.join(root, "checkpoint_2"), os.path.join(root, "checkpoint-7"))
    listed = {c["name"]: c for c in cli("ls", root, "--json").json()["checkpoints"]}
    entry = listed["checkpoint-7"]
    assert entry["status"] == "unknown" and "complete by accelerate" in entry["reason"], entry
    r = cli("prune", root, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code in (0, 1), r.stdout + r.stderr
    assert os.path.isdir(os.path.join(root, "checkpoint-7"))


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin", "model.safetensors", ".ckptctl-seal.json"])
def test_a_hostile_record_or_sidecar_is_a_corrupt_checkpoint_and_latest_skips_it(root, name):
    """Issue 29, item 6: each file save_state writes (its commit record included) and ckptctl's
    seal beside them, as a FIFO, a 100 GB sparse file, random bytes, a directory or a symlink
    to /dev/zero: exit 0 or 1 everywhere, the checkpoint fails verify naming the file, and
    ``latest`` skips it for the older complete save."""
    from test_hostile_inputs import SPECIAL_FILES, assert_hostile_checkpoints_skipped, make_special

    hostile = {}
    for i, how in enumerate(SPECIAL_FILES):
        ckpt = os.path.join(root, f"checkpoint_{3 + i}")
        shutil.copytree(os.path.join(root, "checkpoint_2"), ckpt)
        if name == ".ckptctl-seal.json":
            assert cli("seal", ckpt).exit_code == 0
        make_special(os.path.join(ckpt, name), how)
        hostile[ckpt] = name
    assert_hostile_checkpoints_skipped(root, os.path.join(root, "checkpoint_2"), hostile)
