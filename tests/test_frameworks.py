"""Other tools' checkpoints written by the tools themselves (the ``.[frameworks]`` extra).

The Hugging Face ``Trainer`` trains a tiny GPT-2 built from a config (no download) on CPU,
saving every two steps, and its process is SIGKILLed in the middle of the last save; Lightning's
``ModelCheckpoint`` saves every two steps and its newest file is cut short. Then ``ckptctl
latest`` and ``ckptctl prune`` act on the output directory as a launcher and a cron job would,
without a line of training code changed, and the Trainer resumes from what ``latest`` printed.
Each test skips, naming the package, when its framework is not installed (``scripts/setup.sh``
installs them).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import cli


def _tiny_trainer(out: str, max_steps: int = 8, trainer_class: type | None = None):
    """A 2-layer GPT-2 (hidden size 32) from a config, saving and evaluating every 2 steps; the
    first evaluation scores best, so Trainer's best checkpoint is the oldest."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    data = [{"input_ids": torch.randint(0, 64, (16,))} for _ in range(16)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    evals = {"n": 0}

    def score(_pred):
        evals["n"] += 1
        return {"score": 100.0 - evals["n"]}

    args = TrainingArguments(
        output_dir=out, max_steps=max_steps, save_steps=2, eval_steps=2, eval_strategy="steps", save_strategy="steps",
        per_device_train_batch_size=4, per_device_eval_batch_size=4, load_best_model_at_end=True,
        metric_for_best_model="score", greater_is_better=True, report_to=[], use_cpu=True, logging_steps=100,
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    cls = trainer_class or Trainer
    return cls(model=model, args=args, train_dataset=data, eval_dataset=data[:4], compute_metrics=score)


# Run as a script: train, and SIGKILL this very process in the middle of the save of step 8,
# after the model, optimizer and scheduler, before the RNG state and trainer_state.json.
_KILLED_IN_SAVE = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from transformers import Trainer
from test_frameworks import _tiny_trainer

class DiesInSave(Trainer):
    def _save_rng_state(self, output_dir):
        if self.state.global_step == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_rng_state(output_dir)

_tiny_trainer(sys.argv[1], trainer_class=DiesInSave).train()
"""


def test_hf_trainer_killed_in_a_save_latest_resume_and_prune_keeps_best(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[frameworks]')")
    pytest.importorskip("accelerate", reason="accelerate (needed by transformers.Trainer) is not installed")
    import subprocess
    import sys

    out = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", _KILLED_IN_SAVE, out, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    saved = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert saved == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert not os.path.exists(os.path.join(out, "checkpoint-8", "trainer_state.json"))  # Trainer writes it last
    with open(os.path.join(out, "checkpoint-6", "trainer_state.json")) as f:
        assert os.path.basename(json.load(f)["best_model_checkpoint"]) == "checkpoint-2"

    r = cli("latest", out, "--level", "load", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    got = r.json()
    assert got["layout"] == "hf-trainer" and got["url"] == os.path.join(out, "checkpoint-6"), got
    assert "--resume_from_checkpoint" in got["resume"]["option"]
    r = cli("ls", out, "--json")
    assert {x["name"]: x["status"] for x in r.json()["checkpoints"]}["checkpoint-8"] == "partial"

    r = cli("prune", out, "--keep-last", "2", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert plan["checkpoint-2"]["action"] == "keep" and "best_model_checkpoint" in plan["checkpoint-2"]["reason"]
    assert plan["checkpoint-4"]["action"] == "keep" and plan["checkpoint-6"]["action"] == "keep"
    assert plan["checkpoint-8"]["action"] == "skip"  # incomplete but fresh: may still be written
    verification = plan["checkpoint-6"]["verification"]
    assert verification["ok"] and "rng_state" not in (verification["note"] or "")  # numpy RNG state: allowed
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == saved

    # the launcher's side: resume from what `ckptctl latest` printed
    from transformers import TrainerCallback

    steps = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer = _tiny_trainer(out, max_steps=10)
    trainer.add_callback(Count())
    trainer.train(resume_from_checkpoint=got["url"])
    assert steps == [7, 8, 9, 10]


def _lightning_run(out: str) -> None:
    L = pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _idx):
            loss = self.layer(batch).pow(2).mean()
            self.log("score", -float(self.global_step))  # the first save is the best one
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)
    saver = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True,
                            monitor="score", mode="max")
    trainer = L.Trainer(max_steps=6, callbacks=[saver], accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)


def test_lightning_model_checkpoint_latest_and_prune(tmp_path):
    out = str(tmp_path / "ckpts")
    _lightning_run(out)
    names = sorted(os.listdir(out))
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"], names
    newest = os.path.join(out, "epoch=0-step=6.ckpt")
    with open(newest, "r+b") as f:  # cut short, as a kill mid-write leaves it
        f.truncate(os.path.getsize(newest) // 2)
    r = cli("ls", out, "--json")
    assert {x["name"]: (x["layout"], x["status"]) for x in r.json()["checkpoints"]} == {
        "epoch=0-step=2.ckpt": ("lightning", "committed"), "epoch=0-step=4.ckpt": ("lightning", "committed"),
        "epoch=0-step=6.ckpt": ("lightning", "partial")}
    r = cli("latest", out, "--level", "load", "--json")
    assert r.exit_code == 0 and r.json()["url"].endswith("epoch=0-step=4.ckpt"), r.stdout + r.stderr
    r = cli("prune", out, "--keep-last", "1", "--partial-after", "0s", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    plan = {i["name"]: i for i in r.json()["plan"]["items"]}
    assert plan["epoch=0-step=2.ckpt"]["action"] == "keep" and "best_model_path" in plan["epoch=0-step=2.ckpt"]["reason"]
    assert sorted(os.listdir(out)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
