"""``ckptctl convert`` from other stacks' checkpoints: the step is taken from the
source, a Hugging Face Trainer checkpoint's optimizer and scheduler come along, RNG state
survives ckptctl -> ckptctl, ``--strip-prefix`` for inference, Hugging Face hub cache snapshots
read through their links, and an unfinished DCP save is a checkpoint problem (exit 1).

The files are the stacks' own: a real ``transformers.Trainer`` where it is installed; otherwise,
and for the detailed cases, files written with the same calls the stacks' sources make (named
at each builder).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from ckptctl import Checkpointer
from helpers import cli


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    return m, opt


def _hf_checkpoint(root: str, step: int, *, global_step: int | None = None) -> str:
    """``checkpoint-N`` as ``Trainer._save_checkpoint`` (transformers/trainer.py) writes it:
    ``save_model`` -> model.safetensors (safetensors.torch.save_file, metadata format=pt) +
    training_args.bin (torch.save of the TrainingArguments object); ``_save_optimizer_and_scheduler``
    -> optimizer.pt, scheduler.pt (torch.save of their state_dicts); ``_save_rng_state`` ->
    rng_state.pth (python, numpy, cpu states); ``TrainerState.save_to_json`` -> trainer_state.json, last."""
    from safetensors.torch import save_file

    m, opt = _model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # what get_linear_schedule_with_warmup returns
    opt.step()
    sched.step()
    d = os.path.join(root, f"checkpoint-{step}")
    os.makedirs(d)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    torch.save(argparse.Namespace(output_dir=root), os.path.join(d, "training_args.bin"))  # a pickled class, as TrainingArguments is
    torch.save(opt.state_dict(), os.path.join(d, "optimizer.pt"))
    torch.save(sched.state_dict(), os.path.join(d, "scheduler.pt"))
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               os.path.join(d, "rng_state.pth"))
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step if global_step is None else global_step, "epoch": 1.0,
                   "best_model_checkpoint": None, "log_history": [{"loss": 1.5, "step": step}]}, f, indent=2)
    return d


def test_hf_trainer_checkpoint_carries_step_optimizer_scheduler_and_lists_what_it_drops(tmp_path):
    src = _hf_checkpoint(str(tmp_path), 40)
    out = str(tmp_path / "ck")
    r = cli("convert", src, out, "--to", "ckptctl", "--json")
    assert r.exit_code == 0, r.stderr
    rep = r.json()
    assert rep["step"] == 40 and "trainer_state.json global_step" in rep["step_from"] and "checkpoint-40" in rep["step_from"]
    assert any(c.startswith("optimizer.pt") for c in rep["carried"]) and any(c.startswith("scheduler.pt") for c in rep["carried"])
    dropped = " | ".join(rep["dropped"])
    assert "training_args.bin" in dropped and "rng_state.pth" in dropped  # a class pickle; numpy's state needs pickle
    assert cli("verify", out).exit_code == 0
    doc = cli("inspect", out, "--json").json()
    assert doc["step"] == 40
    # Files unread by design (a class pickle, numpy's RNG state) are no damage: the source verifies.
    exported = str(tmp_path / "exported")
    shutil.copytree(src, exported)
    for path in (src, exported):
        r = cli("verify", path)
        assert r.exit_code == 0, r.stdout + r.stderr
    # Back to torch: the optimizer and scheduler load into fresh ones, bitwise.
    pt = str(tmp_path / "back.pt")
    assert cli("convert", out, pt, "--to", "torch").exit_code == 0
    back = torch.load(pt, weights_only=True)
    saved_opt = torch.load(os.path.join(src, "optimizer.pt"), weights_only=True)
    m, opt = _model()
    opt.load_state_dict(back["optimizer"])
    for i, st in saved_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(opt.state_dict()["state"][i][k], v)
    assert back["scheduler"]["last_epoch"] == torch.load(os.path.join(src, "scheduler.pt"), weights_only=True)["last_epoch"]
    assert back["trainer_state"]["global_step"] == 40
    from safetensors.torch import load_file

    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        assert torch.equal(back["model"][k], v), k
    # Human output says where the step came from and what was dropped.
    r = cli("convert", src, str(tmp_path / "ck2"), "--to", "ckptctl")
    assert r.exit_code == 0 and "step 40 (from" in r.stderr and "dropped: training_args.bin" in r.stderr


def test_hf_step_disagreement_is_refused_unless_step_is_given(tmp_path):
    src = _hf_checkpoint(str(tmp_path), 30, global_step=20)  # checkpoint-30 says 20 inside
    r = cli("convert", src, str(tmp_path / "a"), "--to", "ckptctl")
    assert r.exit_code == 1 and "disagrees about its step" in r.stderr and "--step" in r.stderr
    r = cli("convert", src, str(tmp_path / "b"), "--to", "ckptctl", "--step", "30", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["step"] == 30 and "20 (trainer_state.json global_step)" in r.json()["step_from"]


def test_hf_checkpoint_without_trainer_state_is_an_unfinished_save(tmp_path):
    src = _hf_checkpoint(str(tmp_path), 10)
    os.unlink(os.path.join(src, "trainer_state.json"))
    r = cli("convert", src, str(tmp_path / "a"), "--to", "ckptctl")
    assert r.exit_code == 1 and "trainer_state.json" in r.stderr


def test_hf_truncated_optimizer_is_listed_as_dropped_and_fails_verify(tmp_path):
    src = _hf_checkpoint(str(tmp_path), 10)
    p = os.path.join(src, "optimizer.pt")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    r = cli("convert", src, str(tmp_path / "a"), "--to", "ckptctl", "--json")
    assert r.exit_code == 0, r.stderr
    assert any(d.startswith("optimizer.pt: not carried") for d in r.json()["dropped"])
    assert not any(c.startswith("optimizer.pt") for c in r.json()["carried"])
    r = cli("verify", src)
    assert r.exit_code == 1 and "optimizer.pt" in r.stdout + r.stderr


def test_real_transformers_trainer_checkpoint_converts_with_its_step_and_optimizer(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[frameworks]')")
    pytest.importorskip("accelerate", reason="accelerate (needed by transformers.Trainer) is not installed")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    src = str(tmp_path / "run" / "checkpoint-2")
    out = str(tmp_path / "ck")
    r = cli("convert", src, out, "--to", "ckptctl", "--json")
    assert r.exit_code == 0, r.stderr
    rep = r.json()
    assert rep["step"] == 2 and "trainer_state.json global_step" in rep["step_from"]
    assert {c.split()[0] for c in rep["carried"]} >= {"optimizer.pt", "scheduler.pt", "trainer_state.json"}
    assert any(d.startswith("training_args.bin") for d in rep["dropped"])
    names = {t["name"] for t in cli("inspect", out, "--tensors", "--json").json()["tensors"]}
    assert "model/transformer.wte.weight" in names and any(n.startswith("optimizer/state/") for n in names)
    # Inference hand-off: back to the names transformers expects.
    st = str(tmp_path / "st")
    assert cli("convert", out, st, "--to", "safetensors", "--only", "model/", "--strip-prefix", "model/").exit_code == 0
    fresh = GPT2LMHeadModel.from_pretrained(src)
    from safetensors.torch import load_file

    loaded = load_file(os.path.join(st, "model.safetensors"))
    assert "transformer.wte.weight" in loaded
    for k, v in loaded.items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def _dcp_save(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_torchtitan_dcp_step_from_train_state_and_directory(tmp_path):
    """torchtitan's Checkpointer saves ``states = {"model", "optimizer", "lr_scheduler",
    "dataloader", "train_state"}`` with ``TrainState.state_dict() -> {"step":
    torch.tensor(step, dtype=torch.int32), ...}`` (torchtitan/train.py) into ``step-N``."""
    m, _ = _model()
    d = str(tmp_path / "step-12")
    _dcp_save(d, {"model": m.state_dict(), "train_state": {"step": torch.tensor(12, dtype=torch.int32),
                                                           "current_loss": torch.tensor(0.5)}})
    r = cli("convert", d, str(tmp_path / "ck"), "--to", "ckptctl", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["step"] == 12 and "torchtitan train_state step" in r.json()["step_from"]
    # Newer torchtitan saves a plain int; a directory name that disagrees is refused.
    d2 = str(tmp_path / "step-13")
    _dcp_save(d2, {"model": m.state_dict(), "train_state": {"step": 14}})
    r = cli("convert", d2, str(tmp_path / "ck2"), "--to", "ckptctl")
    assert r.exit_code == 1 and "says 14" in r.stderr and "says 13" in r.stderr


def test_megatron_iteration_and_lightning_global_step(tmp_path):
    m, _ = _model()
    # Megatron-LM torch_dist: iter_{:07d} (megatron/training/checkpointing.py) holding DCP files.
    d = str(tmp_path / "iter_0000050")
    _dcp_save(d, {"model": m.state_dict()})
    r = cli("convert", d, str(tmp_path / "ck"), "--to", "ckptctl", "--json")
    assert r.exit_code == 0 and r.json()["step"] == 50 and "Megatron" in r.json()["step_from"]
    # Lightning: Trainer.save_checkpoint -> dict with "global_step" (lightning/pytorch/trainer/connectors/checkpoint_connector.py).
    ck = str(tmp_path / "epoch=1-step=30.ckpt")
    torch.save({"state_dict": m.state_dict(), "epoch": 1, "global_step": 30, "pytorch-lightning_version": "2.4.0"}, ck)
    r = cli("convert", ck, str(tmp_path / "ck2"), "--to", "ckptctl", "--json")
    assert r.exit_code == 0 and r.json()["step"] == 30 and "'global_step'" in r.json()["step_from"] and "Lightning file name" in r.json()["step_from"]


def test_no_step_is_refused_for_ckptctl_and_step_option_supplies_it(tmp_path):
    m, _ = _model()
    pt = str(tmp_path / "weights.pt")
    torch.save(m.state_dict(), pt)
    r = cli("convert", pt, str(tmp_path / "ck"), "--to", "ckptctl")
    assert r.exit_code == 2 and "records no training step" in r.stderr and "--step N" in r.stderr
    assert not os.path.exists(str(tmp_path / "ck" / "manifest.json"))
    assert cli("convert", pt, str(tmp_path / "w.safetensors"), "--to", "safetensors").exit_code == 0  # no step needed there
    r = cli("convert", pt, str(tmp_path / "ck"), "--to", "ckptctl", "--step", "7")
    assert r.exit_code == 0, r.stderr
    assert cli("inspect", str(tmp_path / "ck"), "--json").json()["step"] == 7
    # A resume continues from it: the Checkpointer loads step 7, not 0.
    fresh, _ = _model()
    assert Checkpointer(str(tmp_path / "unused")).load(str(tmp_path / "ck"), {"0.weight": torch.empty(3, 4), "0.bias": torch.empty(3),
                                                                            "1.weight": torch.empty(2, 3), "1.bias": torch.empty(2)}) == 7


def test_strip_prefix_renames_keeps_or_filters_and_refuses_collisions(tmp_path):
    m, opt = _model()
    src = Checkpointer(str(tmp_path / "root")).save(5, {"model": m, "optimizer": opt}).wait()
    pt = str(tmp_path / "w.pt")
    r = cli("convert", src, pt, "--to", "torch", "--only", "model/", "--strip-prefix", "model/", "--json")
    assert r.exit_code == 0 and r.json()["renamed"] == 4
    sd = torch.load(pt, weights_only=True)
    assert set(sd) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(sd)  # what inference code does
    assert torch.equal(fresh[0].weight, m[0].weight)
    # Without --only the other names stay as they were.
    st = str(tmp_path / "all")
    assert cli("convert", src, st, "--to", "safetensors", "--strip-prefix", "model/").exit_code == 0
    from safetensors import safe_open

    with safe_open(os.path.join(st, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "0.weight" in keys and any(k.startswith("optimizer/state/") for k in keys) and not any(k.startswith("model/") for k in keys)
    # Two names that would become one: refused, nothing written.
    torch.save({"model": {"w": torch.ones(2)}, "w": torch.zeros(2)}, str(tmp_path / "clash.pt"))
    out = str(tmp_path / "clash.safetensors")
    r = cli("convert", str(tmp_path / "clash.pt"), out, "--to", "safetensors", "--strip-prefix", "model/")
    assert r.exit_code == 2 and "'model/w'" in r.stderr and "'w'" in r.stderr and not os.path.exists(out)
    assert cli("convert", str(tmp_path / "clash.pt"), out, "--to", "safetensors", "--strip-prefix", "model/", "--only", "model/").exit_code == 0


def test_rng_state_is_kept_on_ckptctl_to_ckptctl(tmp_path):
    m, opt = _model()
    torch.manual_seed(1234)
    src = Checkpointer(str(tmp_path / "root")).save(3, {"model": m, "optimizer": opt}).wait()
    expected = torch.rand(4)  # what the job draws next after the save
    out = str(tmp_path / "out" / "step-0000000003")
    r = cli("convert", src, out, "--to", "ckptctl", "--json")
    assert r.exit_code == 0 and r.json()["dropped"] == [], r.stdout + r.stderr
    torch.manual_seed(99)
    fresh, fresh_opt = _model()
    Checkpointer(str(tmp_path / "unused")).load(out, {"model": fresh, "optimizer": fresh_opt})
    assert torch.equal(torch.rand(4), expected)  # the generator resumed where it was saved
    # --only leaves it out, and says so.
    r = cli("convert", src, str(tmp_path / "only"), "--to", "ckptctl", "--only", "model/", "--json")
    assert r.exit_code == 0 and any("RNG" in d and "--only" in d for d in r.json()["dropped"])


def _hub_snapshot(cache: str) -> str:
    """``huggingface_hub`` layout (file_download.py): blobs/<hash>, snapshots/<rev>/<file> ->
    ../../blobs/<hash>, relative links."""
    from safetensors.torch import save_file

    repo = os.path.join(cache, "models--org--tiny")
    os.makedirs(os.path.join(repo, "blobs"))
    snap = os.path.join(repo, "snapshots", "0123abcd")
    os.makedirs(snap)
    os.makedirs(os.path.join(repo, "refs"))
    m, _ = _model()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, os.path.join(repo, "blobs", "aa11"), metadata={"format": "pt"})
    with open(os.path.join(repo, "blobs", "bb22"), "w") as f:
        f.write("{}")
    os.symlink("../../blobs/aa11", os.path.join(snap, "model.safetensors"))
    os.symlink("../../blobs/bb22", os.path.join(snap, "config.json"))
    return snap


def test_hub_cache_snapshot_is_read_through_links_inside_the_cache(tmp_path):
    snap = _hub_snapshot(str(tmp_path / "hub"))
    doc = cli("inspect", snap, "--json").json()
    assert doc["format"] == "safetensors" and doc["tensor_count"] == 4
    r = cli("verify", snap, "--load")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli("convert", snap, str(tmp_path / "ck"), "--to", "ckptctl", "--step", "0")
    assert r.exit_code == 0, r.stderr
    assert cli("verify", str(tmp_path / "ck")).exit_code == 0
    # The file itself, given directly, too.
    assert cli("convert", os.path.join(snap, "model.safetensors"), str(tmp_path / "w.pt"), "--to", "torch").exit_code == 0


def test_hub_cache_sharded_snapshot_with_linked_index(tmp_path):
    m, opt = _model()
    src = Checkpointer(str(tmp_path / "root")).save(9, {"model": m, "optimizer": opt}).wait()
    sharded = str(tmp_path / "sharded")
    assert cli("convert", src, sharded, "--to", "safetensors", "--max-shard-size", "100B").exit_code == 0
    repo = tmp_path / "hub" / "models--org--sharded"
    snap = repo / "snapshots" / "feed"
    os.makedirs(repo / "blobs")
    os.makedirs(snap)
    for i, name in enumerate(sorted(os.listdir(sharded))):
        shutil.move(os.path.join(sharded, name), repo / "blobs" / f"h{i}")
        os.symlink(f"../../blobs/h{i}", snap / name)
    assert (snap / "model.safetensors.index.json").is_symlink() and len(os.listdir(snap)) > 2
    r = cli("convert", str(snap), str(tmp_path / "ck"), "--to", "ckptctl", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["step"] == 9 and r.json()["tensors"] == 16  # the step ckptctl recorded in the metadata
    assert cli("verify", str(tmp_path / "ck")).exit_code == 0


def test_hub_cache_link_leaving_the_cache_is_refused_naming_it(tmp_path):
    snap = _hub_snapshot(str(tmp_path / "hub"))
    outside = str(tmp_path / "elsewhere.safetensors")
    shutil.copy(os.path.realpath(os.path.join(snap, "model.safetensors")), outside)
    os.unlink(os.path.join(snap, "model.safetensors"))
    os.symlink(outside, os.path.join(snap, "model.safetensors"))
    for args in (["convert", snap, str(tmp_path / "ck"), "--to", "safetensors"], ["inspect", snap]):
        r = cli(*args)
        assert r.exit_code == 1 and "model.safetensors" in r.stderr and "outside the hub cache" in r.stderr, r.stderr
    r = cli("verify", snap)
    assert r.exit_code == 1 and "outside the hub cache" in r.stdout + r.stderr
    # A link in a directory that is no hub cache is refused as before.
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    os.symlink(outside, os.path.join(plain, "model.safetensors"))
    r = cli("convert", plain, str(tmp_path / "ck2"), "--to", "safetensors")
    assert r.exit_code == 1 and "symlink" in r.stderr


def test_dcp_directory_without_metadata_exits_1(tmp_path):
    m, _ = _model()
    d = str(tmp_path / "step-5")
    _dcp_save(d, {"model": m.state_dict()})
    os.unlink(os.path.join(d, ".metadata"))
    r = cli("convert", d, str(tmp_path / "ck"), "--to", "ckptctl")
    assert r.exit_code == 1 and ".metadata" in r.stderr and "did not finish" in r.stderr


def test_rng_and_per_rank_state_of_every_rank_are_kept_on_ckptctl_to_ckptctl(tmp_path):
    """Two real gloo ranks save (each its own RNG and ``extra``); the conversion keeps both
    ranks' headers, so each rank of a 2-rank job resumes with its own state."""
    from dist_workers import launch

    from ckptctl.load.reader import CheckpointReader
    from ckptctl.storage import open_storage

    root, ref = str(tmp_path / "root"), str(tmp_path / "ref.pt")
    res = launch("train_save", 2, {"mode": "ddp", "root": root, "save_step": 2, "ref": ref}, str(tmp_path / "a"))
    assert all("path" in v for v in res.values()), res
    src = res[0]["path"]
    out = str(tmp_path / "out")
    r = cli("convert", src, out, "--to", "ckptctl", "--json")
    assert r.exit_code == 0 and r.json()["dropped"] == [], r.stdout + r.stderr
    assert cli("verify", out).exit_code == 0
    with CheckpointReader(open_storage(src)) as a, CheckpointReader(open_storage(out)) as b:
        before, after = a.rank_states(), b.rank_states()
        assert b.manifest.world_size == 2 and b.manifest.step == 2
    assert set(before) == {0, 1} and before == after
    assert before[0] != before[1]  # each rank's own: not rank 0's copied
