"""The Hugging Face ``Trainer`` (and every subclass: TRL's ``SFTTrainer``, ``DPOTrainer``, ...):
a ``TrainerCallback`` that seals each ``checkpoint-N`` right after the Trainer wrote it and,
optionally, applies a ckptctl retention policy instead of ``save_total_limit``.

    from ckptctl import KeepBest, KeepLast
    from ckptctl.integrations.trainer import SealCallback

    trainer = Trainer(..., args=TrainingArguments(..., save_total_limit=None),
                      callbacks=[SealCallback(retention=KeepBest(2, "eval_loss") | KeepLast(2))])

While the Trainer saves a checkpoint (its ``_save_checkpoint``, which every subclass's save
goes through), each file it writes with ``torch.save`` or safetensors' ``save_file`` (model,
optimizer, scheduler, RNG state, ``training_args.bin``) is hashed from the page cache as soon
as it is closed, on a background thread, while the save goes on (``integrations.savehooks``).
``on_save`` runs after the Trainer's save has finished, ``trainer_state.json`` (its commit
file) included; the processes of a distributed job wait for each other there (each writes its
own RNG file). Then, on the main process, the checkpoint is handed to a background thread that
fsyncs it, reads once more only what no hook saw written (JSON files, the other processes' RNG
files) and writes the seal ``ckptctl seal`` writes (``integrations.sealer``), then runs
``ckptctl prune``'s retention on ``output_dir``: the newest checkpoint verified and test-loaded
before anything older is deleted, the Trainer's best checkpoint (``best_model_checkpoint``)
always kept. Training goes on meanwhile; ``on_train_end`` waits for the last seal. ``ckptctl
verify OUTPUT_DIR --latest`` then checks every byte of the newest one. Keep
``save_total_limit`` unset with ``retention``: both would delete.

To see a save begin and end, ``Trainer._save_checkpoint`` is wrapped once, for the class, the
first time a ``SealCallback`` is made: a trainer without one saves exactly as before.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch.distributed as dist
import transformers.modeling_utils
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptctl.integrations.savehooks import Recorded, recording
from ckptctl.integrations.sealer import BackgroundSealer
from ckptctl.ops.retention.policies import Policy, RetentionPolicy

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


class SealCallback(TrainerCallback):
    """See the module docstring. ``retention``: the rules applied to ``output_dir`` after each
    seal (None: the Trainer's own ``save_total_limit``, if any, rotates as before)."""

    def __init__(self, retention: Policy | RetentionPolicy | None = None) -> None:
        self.sealer = BackgroundSealer(retention)
        self.written: Recorded | None = None  # the files the last save hashed as it closed them
        _wrap_save_checkpoint()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        written, self.written = self.written, None
        # Every process writes its own RNG file into the checkpoint: the seal waits for all.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if state.is_world_process_zero:
            root = args.output_dir or "."
            self.sealer.submit(os.path.join(root, f"{PREFIX}-{state.global_step}"), root, written)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.sealer.wait()


_wrapping = threading.Lock()


def _wrap_save_checkpoint() -> None:
    """Wrap ``Trainer._save_checkpoint`` (once) so that a trainer with a ``SealCallback`` saves
    inside ``savehooks.recording``: on its own thread, for that save only."""
    with _wrapping:
        original = Trainer._save_checkpoint
        if getattr(original, "_ckptctl_records", False):
            return

        @functools.wraps(original)
        def _save_checkpoint(self: Trainer, model: Any, trial: Any) -> None:
            callback = next((c for c in self.callback_handler.callbacks if isinstance(c, SealCallback)), None)
            if callback is None or not self.is_world_process_zero():  # the main process seals, alone
                return original(self, model, trial)
            with recording(also=[(transformers.modeling_utils, "safe_save_file")]) as written:
                result = original(self, model, trial)
            callback.written = written
            return result

        _save_checkpoint._ckptctl_records = True  # type: ignore[attr-defined]
        Trainer._save_checkpoint = _save_checkpoint  # type: ignore[method-assign]


__all__ = ["SealCallback"]
