"""Sealing keeps time (issue 20 §5): a seal records the checkpoint's own commit time, and every
age and calendar rule reads it instead of the seal file's mtime. Trainer checkpoints are built
as ``Trainer._save_checkpoint`` writes them (trainer_state.json last) and DCP steps by the real
``torch.distributed.checkpoint.save``; ages are real mtimes set with ``os.utime``."""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import pytest
import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.seal import SEAL, parse_seal
from helpers import cli

DAY = 86400.0

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp


def _age(path: str, age_s: float) -> None:
    old = time.time() - age_s
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            os.utime(os.path.join(dirpath, f), (old, old))
        os.utime(dirpath, (old, old))


def trainer_checkpoint(root: str, step: int, age_s: float) -> str:
    from safetensors.torch import save_file

    path = os.path.join(root, f"checkpoint-{step}")
    os.makedirs(path)
    save_file({"w": torch.full((4,), float(step))}, os.path.join(path, "model.safetensors"))
    torch.save(argparse.Namespace(lr=1.0), os.path.join(path, "training_args.bin"))
    torch.save({"state": {}, "param_groups": [{"lr": 1e-3, "params": []}]}, os.path.join(path, "optimizer.pt"))
    torch.save({"last_epoch": step}, os.path.join(path, "scheduler.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "best_model_checkpoint": None, "log_history": []}, f)
    _age(path, age_s)
    return path


def _created(root: str) -> dict[str, float]:
    r = cli("ls", root, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return {c["name"]: c["created"] for c in r.json()["checkpoints"]}


def _plan(root: str, *policy: str) -> dict[str, str]:
    r = cli("prune", root, *policy, "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return {i["name"]: i["action"] for i in r.json()["plan"]["items"]}


def test_sealing_a_trainer_root_changes_no_age_and_no_calendar_decision(tmp_path):
    root = str(tmp_path)
    # two checkpoints a day, six to three days old
    for i, step in enumerate(range(100, 900, 100)):
        trainer_checkpoint(root, step, (6 - i // 2) * DAY - (i % 2) * 3600)
    before, plan_before = _created(root), _plan(root, "--keep-daily", "2")
    assert list(plan_before.values()).count("delete") > 0  # the rule has something to decide
    r = cli("seal", root, "--json")
    assert r.exit_code == 0 and all(c["status"] == "sealed" for c in r.json()["checkpoints"]), r.stdout
    after = _created(root)
    assert after == pytest.approx(before, abs=1e-3)
    assert _plan(root, "--keep-daily", "2") == plan_before
    seal = parse_seal(open(os.path.join(root, "checkpoint-800", SEAL), "rb").read(), "seal")
    assert seal.committed == pytest.approx(before["checkpoint-800"], abs=1e-3) and seal.created > seal.committed + DAY
    # sealed again: nothing is rewritten, the first time stays
    raw = open(os.path.join(root, "checkpoint-800", SEAL), "rb").read()
    assert cli("seal", root).exit_code == 0
    assert open(os.path.join(root, "checkpoint-800", SEAL), "rb").read() == raw
    assert _created(root) == pytest.approx(before, abs=1e-3)


def test_a_sealed_dcp_step_keeps_its_age_here_and_in_a_copy(tmp_path):
    root, other = str(tmp_path / "a"), str(tmp_path / "b")
    path = os.path.join(root, "step-10")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(8)}, "train_state": {"step": 10}}, checkpoint_id=path, no_dist=True)
    _age(path, 72 * 3600)
    r = cli("ls", root, "--json")
    (row,) = r.json()["checkpoints"]
    assert row["age_s"] == pytest.approx(72 * 3600, abs=60)
    assert cli("seal", path).exit_code == 0
    (row,) = cli("ls", root, "--json").json()["checkpoints"]
    assert row["age_s"] == pytest.approx(72 * 3600, abs=60)
    # a copy writes every file now; the seal it carries keeps the checkpoint's age
    r = cli("cp", path, os.path.join(other, "step-10"), "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    (row,) = cli("ls", other, "--json").json()["checkpoints"]
    assert row["age_s"] == pytest.approx(72 * 3600, abs=60)


def test_an_older_seal_without_the_commit_time_falls_back_to_the_newest_modification(tmp_path):
    """Seals written before the field existed: the age is what it always was, the newest
    modification inside (the seal's own file included), as man/ckptctl-layouts.7 says."""
    root = str(tmp_path)
    path = trainer_checkpoint(root, 100, 6 * DAY)
    assert cli("seal", path).exit_code == 0
    doc = json.loads(open(os.path.join(path, SEAL), "rb").read())
    del doc["committed"]
    with open(os.path.join(path, SEAL), "w") as f:
        json.dump(doc, f)
    assert _created(root)["checkpoint-100"] == pytest.approx(os.path.getmtime(os.path.join(path, SEAL)), abs=1e-3)


def test_a_commit_time_after_the_seal_is_refused():
    doc = {"kind": "ckptctl-seal", "version": 1, "layout": "dcp", "name": "step-1", "step": 1, "created": 100.0,
           "committed": 200.0, "tool": {}, "algorithm": "xxh3-64", "chunk_size": 64 << 20, "files": []}
    with pytest.raises(InvalidCheckpoint, match="committed"):
        parse_seal(json.dumps(doc).encode(), "seal")
