"""The Hugging Face ``Trainer`` (and every subclass: TRL's ``SFTTrainer``, ``DPOTrainer``, ...):
a ``TrainerCallback`` that seals each ``checkpoint-N`` right after the Trainer wrote it and,
optionally, applies a ckptctl retention policy instead of ``save_total_limit``.

    from ckptctl import KeepBest, KeepLast
    from ckptctl.integrations.trainer import SealCallback

    trainer = Trainer(..., args=TrainingArguments(..., save_total_limit=None),
                      callbacks=[SealCallback(retention=KeepBest(2, "eval_loss") | KeepLast(2))])

``on_save`` runs after the Trainer's save has finished, ``trainer_state.json`` (its commit
file) included; the processes of a distributed job wait for each other there (each writes its
own RNG file). Then, on the main process, the checkpoint is handed to a background thread that
hashes each file once and writes the seal ``ckptctl seal`` writes (``integrations.sealer``),
then runs ``ckptctl prune``'s retention on ``output_dir``: the newest checkpoint verified
and test-loaded before anything older is deleted, the Trainer's best checkpoint
(``best_model_checkpoint``) always kept. Training goes on meanwhile; ``on_train_end`` waits for
the last seal. ``ckptctl verify OUTPUT_DIR --latest`` then checks every byte of the newest one.
Keep ``save_total_limit`` unset with ``retention``: both would delete.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptctl.integrations.sealer import BackgroundSealer
from ckptctl.ops.retention.policies import Policy, RetentionPolicy

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


class SealCallback(TrainerCallback):
    """See the module docstring. ``retention``: the rules applied to ``output_dir`` after each
    seal (None: the Trainer's own ``save_total_limit``, if any, rotates as before)."""

    def __init__(self, retention: Policy | RetentionPolicy | None = None) -> None:
        self.sealer = BackgroundSealer(retention)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        # Every process writes its own RNG file into the checkpoint: the seal waits for all.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if state.is_world_process_zero:
            root = args.output_dir or "."
            self.sealer.submit(os.path.join(root, f"{PREFIX}-{state.global_step}"), root)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.sealer.wait()


__all__ = ["SealCallback"]
