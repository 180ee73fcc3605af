"""``ckptctl latest --resume-args``: the stack's resume arguments for exactly the checkpoint that
verified, argv-ready (resume-truth issue, #20).

The Hugging Face Trainer and Lightning runs are real: each framework saves, its newest
checkpoint is cut short, and the argv ``latest --resume-args`` printed is fed to that
framework's own argument handling and resume (HfArgumentParser into ``trainer.train``; an
``argparse`` ``--ckpt_path`` into ``Trainer.fit``), which must continue after the older step.
"""

from __future__ import annotations

import argparse
import os
import shlex

import pytest
import torch

from helpers import cli, make_checkpoints
from test_layouts import dcp_step


def _cut_short(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _argv(root: str, *more: str) -> list[str]:
    r = cli("latest", root, "--resume-args", *more)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.count("\n") == 1  # one line
    argv = shlex.split(r.stdout)
    assert cli("latest", root, "--json", *more).json()["resume"]["argv"] == argv  # the same, as a list
    return argv


def test_ckptctl_and_torchtitan_resume_args(tmp_path):
    native = str(tmp_path / "native")
    paths = make_checkpoints(native, [1, 2])
    assert _argv(native) == [paths[-1]]
    titan = str(tmp_path / "titan")
    os.makedirs(titan)
    dcp_step(titan, 20)
    dcp_step(titan, 40)
    assert _argv(titan, "--format", "dcp") == ["--checkpoint.load_step", "40"]
    r = cli("latest", titan)
    assert r.exit_code == 0 and r.stdout.strip() == os.path.join(titan, "step-40")


def test_hf_trainer_resumes_from_the_resume_args_after_a_corrupt_newest(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[frameworks]')")
    pytest.importorskip("accelerate", reason="accelerate (needed by transformers.Trainer) is not installed")
    from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

    from test_frameworks import _tiny_trainer

    out = str(tmp_path / "run")
    _tiny_trainer(out, max_steps=6).train()
    _cut_short(os.path.join(out, "checkpoint-6", "optimizer.pt"))  # complete by its rule, corrupt inside
    argv = _argv(out)
    assert argv == ["--resume_from_checkpoint", os.path.join(out, "checkpoint-4")]

    # the training script's side: its own argument parsing, then the Trainer's resume
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=["--output_dir", out, *argv])
    steps = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer = _tiny_trainer(out, max_steps=6)
    trainer.add_callback(Count())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    assert steps == [5, 6]


def test_lightning_fit_resumes_from_the_resume_args_after_a_corrupt_newest(tmp_path):
    L = pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen: list[int] = []

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _idx):
            seen.append(self.global_step)
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps: int, ckpt_path: str | None = None) -> None:
        torch.manual_seed(0)
        data = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False,
                            callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)])
        trainer.fit(Tiny(), data, ckpt_path=ckpt_path)

    out = str(tmp_path / "ckpts")
    fit(6)
    _cut_short(os.path.join(out, "epoch=0-step=6.ckpt"))
    argv = _argv(out)
    assert argv == ["--ckpt_path", os.path.join(out, "epoch=0-step=4.ckpt")]

    # the training script's side: `--ckpt_path` as Lightning's own scripts take it
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt_path")
    seen.clear()
    fit(8, parser.parse_args(argv).ckpt_path)
    assert seen == [4, 5, 6, 7]  # resumed after step 4, not from scratch and not from the cut file
