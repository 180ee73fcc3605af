"""Retention as a library API (issue #19): the policy objects the CLI builds, given to the
Checkpointer; metrics recorded at save time and ``KeepBest``; Trainer's logged metrics; the
``--keep-best`` options of prune and du."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import ckptctl
from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.manifest import MAX_METRICS, Manifest
from ckptctl.layouts.native_read import read_committed
from ckptctl.ops.retention.policies import (
    AnyOf, Candidate, InvalidPolicy, KeepBest, KeepEvery, KeepLast, KeepWithin, RetentionPolicy,
)
from ckptctl.storage import open_storage
from helpers import cli


def state(step: int) -> dict:
    return {"model": {"w": torch.full((64,), float(step))}, "extra": {"step": step}}


def names(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


# --- KeepBest and composition, pure -----------------------------------------------------------


def test_keep_best_keeps_the_n_best_and_says_which_value() -> None:
    cands = [Candidate(s, 0.0, {"val_loss": v}) for s, v in ((1, 0.5), (2, 0.213), (3, 0.4), (4, 0.3))]
    assert KeepBest(2, "val_loss").reasons(cands) == {2: "best 2 of val_loss (0.213)", 4: "best 2 of val_loss (0.3)"}
    assert KeepBest(1, "val_loss", mode="max").reasons(list(reversed(cands))) == {1: "best 1 of val_loss (0.5)"}


def test_keep_best_ties_go_to_the_newer_and_missing_metrics_are_not_ranked() -> None:
    cands = [Candidate(1, 0.0, {"acc": 0.9}), Candidate(2, 0.0), Candidate(3, 0.0, {"acc": 0.9})]
    assert KeepBest(1, "acc", "max").reasons(cands) == {3: "best 1 of acc (0.9)"}
    # Step 2 has no acc: neither among the best nor a reason to delete; another rule may keep it.
    decided = (KeepBest(2, "acc", "max") | KeepLast(1)).reasons(cands)
    assert 2 not in decided
    decisions = RetentionPolicy([KeepBest(5, "acc", "max")]).decide(cands, anchor_step=3)
    assert decisions[2].keep is False and decisions[1].keep and decisions[3].keep


def test_keep_best_with_a_metric_nobody_records_keeps_everything() -> None:
    cands = [Candidate(s, 0.0, {"val_loss": 1.0 / s}) for s in (1, 2, 3)]
    reasons = KeepBest(1, "val_los").reasons(cands)  # a typo must not delete the history
    assert set(reasons) == {1, 2, 3}
    assert all("no checkpoint records val_los" in r for r in reasons.values())


def test_the_anchor_is_kept_whatever_its_metric() -> None:
    cands = [Candidate(1, 0.0, {"loss": 0.1}), Candidate(2, 0.0, {"loss": 9.0})]
    decisions = RetentionPolicy([KeepBest(1, "loss")]).decide(cands, anchor_step=2)
    assert decisions[2].keep and decisions[2].reasons[0].startswith("anchor")
    assert decisions[1].reasons == ("best 1 of loss (0.1)",)


def test_policies_compose_with_or() -> None:
    combined = KeepLast(3) | KeepEvery(1000)
    assert isinstance(combined, AnyOf)
    assert RetentionPolicy.of(combined).describe() == "keep-last 3, keep-every 1000"
    three = combined | KeepWithin(60)
    assert [type(p) for p in RetentionPolicy.of(three).policies] == [KeepLast, KeepEvery, KeepWithin]
    assert (RetentionPolicy([KeepLast(1)]) | KeepEvery(5)).describe() == "keep-last 1, keep-every 5"
    cands = [Candidate(s, float(s)) for s in (1000, 1500, 2000, 2500)]
    assert combined.reasons(cands)[2000] == "keep-last 3; keep-every 1000"


@pytest.mark.parametrize("make, message", [
    (lambda: KeepBest(0, "loss"), "KeepBest: n must be at least 1, got 0"),
    (lambda: KeepBest(1, ""), "KeepBest: metric must be a printable name"),
    (lambda: KeepBest(1, "loss", "lowest"), "KeepBest: mode must be \"min\" or \"max\", got 'lowest'"),
    (lambda: Candidate(1, 0.0, {"loss": math.nan}), "Candidate.metrics['loss'] must be a finite number"),
])
def test_bad_parameters_are_value_errors(make, message) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message)


# --- the manifest's metrics --------------------------------------------------------------------


def _manifest_doc(**extra) -> bytes:
    m = Manifest.new(5, 1, [], {}, {}, {}, metrics={"val_loss": 0.25, "acc": 1})
    doc = json.loads(m.to_json())
    doc.update(extra)
    return json.dumps(doc).encode()


def test_metrics_round_trip_and_are_optional() -> None:
    m = Manifest.from_json(_manifest_doc(), "m")
    assert m.metrics == {"val_loss": 0.25, "acc": 1.0}
    doc = json.loads(_manifest_doc())
    del doc["metrics"]
    assert Manifest.from_json(json.dumps(doc).encode(), "m").metrics == {}
    assert "metrics" not in json.loads(Manifest.new(5, 1, [], {}, {}, {}).to_json())


@pytest.mark.parametrize("metrics, why", [
    ({"loss": "low"}, "entry 'loss' is not a number"),
    ({"loss": True}, "entry 'loss' is not a number"),
    ({"loss": float("nan")}, "entry 'loss' is not finite"),
    ({"": 1.0}, "printable"),
    ({f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}, "entries, more than"),
    ([1.0], "is not an object"),
])
def test_hostile_metrics_are_a_checkpoint_problem(metrics, why) -> None:
    raw = _manifest_doc(metrics=metrics)  # NaN is written as NaN, which manifests may hold in ``state``
    with pytest.raises(InvalidCheckpoint, match=why):
        Manifest.from_json(raw, "m")


# --- the Checkpointer --------------------------------------------------------------------------


def test_checkpointer_retention_keeps_the_best_and_the_newest(tmp_path) -> None:
    root = str(tmp_path)
    losses = {1: 0.5, 2: 0.2, 3: 0.4, 4: 0.3, 5: 0.6}
    with Checkpointer(root, retention=KeepLast(1) | KeepBest(1, "val_loss")) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, state(step), metrics={"val_loss": loss}).wait()
    assert names(root) == ["step-0000000002", "step-0000000005"]
    manifest, _ = read_committed(open_storage(root).sub("step-0000000002"))
    assert manifest.metrics == {"val_loss": 0.2}


def test_keep_last_is_shorthand_and_not_both(tmp_path) -> None:
    root = str(tmp_path)
    with pytest.raises(ValueError, match="pass one or the other"):
        Checkpointer(root, keep_last=1, retention=KeepLast(2))
    with pytest.raises(ValueError, match="KeepLast: n must be at least 1, got 0"):
        Checkpointer(root, keep_last=0)
    with pytest.raises(TypeError, match="retention must be a retention policy"):
        Checkpointer(root, retention=3)  # type: ignore[arg-type]
    with Checkpointer(root, keep_last=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state(step)).wait()
    assert names(root) == ["step-0000000003"]


@pytest.mark.parametrize("metrics", [{"loss": math.inf}, {"loss": "0.2"}, {1: 0.2}, [("loss", 0.2)]])
def test_bad_metrics_fail_the_save_before_anything_is_written(tmp_path, metrics) -> None:
    root = str(tmp_path)
    with Checkpointer(root) as ckpt:
        with pytest.raises(ValueError, match="metrics"):
            ckpt.save(1, state(1), metrics=metrics)
    assert names(root) == []


def test_policy_classes_are_exported_lazily_without_torch() -> None:
    assert ckptctl.KeepBest is KeepBest and ckptctl.RetentionPolicy is RetentionPolicy
    code = ("import sys, ckptctl; p = ckptctl.KeepLast(3) | ckptctl.KeepBest(2, 'val_loss'); "
            "print(ckptctl.RetentionPolicy.of(p).describe(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "keep-last 3, best 2 of val_loss (lowest) False"


# --- the CLI -----------------------------------------------------------------------------------


def _saved(root: str, losses: dict[int, float | None]) -> None:
    with Checkpointer(root) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, state(step), metrics=None if loss is None else {"val_loss": loss}).wait()


def test_prune_keep_best_says_why_each_is_kept(tmp_path) -> None:
    root = str(tmp_path)
    _saved(root, {1: 0.5, 2: 0.213, 3: None, 4: 0.4, 5: 0.45})
    r = cli("prune", root, "--keep-best", "2", "--metric", "val_loss", "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["step"]: i for i in r.json()["plan"]["items"]}
    assert {s: i["action"] for s, i in plan.items()} == {1: "delete", 2: "keep", 3: "delete", 4: "keep", 5: "keep"}
    assert plan[2]["reason"] == "best 2 of val_loss (0.213)"
    assert plan[2]["metrics"] == {"val_loss": 0.213} and plan[3]["metrics"] == {}
    assert r.json()["plan"]["policy"] == "best 2 of val_loss (lowest)"
    r = cli("du", root, "--keep-best", "1", "--metric", "val_loss", "--mode", "max", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    # max: 0.5 (step 1) is the best; 5 is the anchor; 3 has no val_loss and nothing keeps it.
    assert {e["step"]: e["prune"] for e in doc["checkpoints"]} == {1: "keep", 2: "delete", 3: "delete", 4: "delete", 5: "keep"}
    assert doc["checkpoints_freed"] == 3 and doc["policy"] == "best 1 of val_loss (highest)"


@pytest.mark.parametrize("verb", ["prune", "du"])
@pytest.mark.parametrize("args, text", [
    (["--keep-best", "2"], "--keep-best needs --metric NAME"),
    (["--keep-last", "1", "--metric", "val_loss"], "--metric is used only with --keep-best"),
    (["--keep-best", "0", "--metric", "x"], "--keep-best must be at least 1, got 0"),
    (["--keep-best", "1", "--metric", "x", "--mode", "up"], '--mode must be "min" or "max", got up'),
])
def test_keep_best_usage_errors(tmp_path, verb, args, text) -> None:
    r = cli(verb, str(tmp_path), *args, "--dry-run" if verb == "prune" else "--quiet")
    assert r.exit_code == 2 and text in r.stderr, r.stderr


# --- Hugging Face Trainer ----------------------------------------------------------------------


def test_trainer_logged_metrics_and_best_metric(tmp_path) -> None:
    from test_layouts import hf_checkpoint

    root = str(tmp_path)
    evals = {100: 0.9, 200: 0.3, 300: 0.5, 400: 0.7}
    best_so_far = {100: 100, 200: 200, 300: 200, 400: 200}
    for step, loss in evals.items():
        path = hf_checkpoint(root, step)
        history = [{"step": s, "eval_loss": v, "epoch": s / 100} for s, v in evals.items() if s <= step]
        best = best_so_far[step]
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step, "log_history": history, "best_metric": evals[best],
                       "best_model_checkpoint": os.path.join(root, f"checkpoint-{best}")}, f)
    r = cli("prune", root, "--keep-best", "2", "--metric", "eval_loss", "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["step"]: i for i in r.json()["plan"]["items"]}
    assert plan[200]["reason"].startswith("best 2 of eval_loss (0.3)")
    assert plan[300]["reason"] == "best 2 of eval_loss (0.5)"
    assert plan[100]["action"] == "delete" and plan[400]["action"] == "keep"
    r = cli("prune", root, "--keep-best", "2", "--metric", "best_metric", "--dry-run", "--json")
    plan = {i["step"]: i for i in r.json()["plan"]["items"]}
    assert plan[100]["reason"] == "best 2 of best_metric (0.9)"  # once Trainer's best
    assert plan[300]["action"] == "delete"  # never Trainer's best: no best_metric, no other rule


def test_trainer_values_that_are_not_finite_numbers_are_no_metric(tmp_path) -> None:
    from test_layouts import hf_checkpoint

    root = str(tmp_path)
    logged = {100: float("nan"), 200: "0.1", 300: 0.4, 400: True}
    for step, value in logged.items():
        path = hf_checkpoint(root, step)
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step, "log_history": [{"step": step, "eval_loss": value}]}, f)
    r = cli("prune", root, "--keep-best", "1", "--metric", "eval_loss", "--dry-run", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["step"]: i for i in r.json()["plan"]["items"]}
    assert {s: i["metrics"] for s, i in plan.items()} == {100: {}, 200: {}, 300: {"eval_loss": 0.4}, 400: {}}
    assert {s: i["action"] for s, i in plan.items()} == {100: "delete", 200: "delete", 300: "keep", 400: "keep"}
