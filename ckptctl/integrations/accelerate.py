"""Hugging Face Accelerate: a hook on ``Accelerator.save_state`` that seals each directory it
writes and, optionally, applies a ckptctl retention policy to their root.

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from ckptctl import KeepLast
    from ckptctl.integrations.accelerate import seal_saves

    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True))
    sealing = seal_saves(accelerator, retention=KeepLast(2))
    ...
    accelerator.save_state()          # unchanged: writes checkpoints/checkpoint_N, then it is sealed
    sealing.close()                   # at the end: waits for the last seal

Accelerate has a pre-save hook only (``register_save_state_pre_hook``, before any file is
written), so ``seal_saves`` wraps this ``Accelerator``'s ``save_state``: the original runs, and
on the main process each file it writes with ``torch.save`` or safetensors' ``save_file``
(model, optimizer, scheduler, sampler, its RNG state) is hashed from the page cache as soon as
it is closed, on a background thread, while the save goes on (``integrations.savehooks``);
every process waits for the others (their RNG files are part of the checkpoint), then the main
process hands the directory to a background thread that fsyncs it, reads once more only what
no hook saw written (the other processes' RNG files) and writes the seal ``ckptctl seal``
writes, then runs ``ckptctl prune``'s retention on the directory above it
(``integrations.sealer``). Use underscore names (``checkpoint_N``, ``step_N``, ``epoch_N``: the
accelerate layout's) for explicit ``save_state(output_dir)`` calls, and leave
``ProjectConfiguration(total_limit=...)`` unset with ``retention``: both would delete.
"""

from __future__ import annotations

import os
from typing import Any

import accelerate.utils.other

from ckptctl.integrations.savehooks import Recorded, recording
from ckptctl.integrations.sealer import BackgroundSealer
from ckptctl.ops.retention.policies import Policy, RetentionPolicy


class SealSaves:
    """The hook ``seal_saves`` installs; ``close`` waits for the last seal and removes it."""

    def __init__(self, accelerator: Any, retention: Policy | RetentionPolicy | None = None) -> None:
        self.accelerator = accelerator
        self.sealer = BackgroundSealer(retention)
        self.written: Recorded | None = None  # the files the last save hashed as it closed them
        self._save_state = accelerator.save_state
        accelerator.save_state = self.save_state  # this instance only; the class is untouched

    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> str:
        if not self.accelerator.is_main_process:  # the main process seals, alone
            location = self._save_state(output_dir, *args, **kwargs)
            self.accelerator.wait_for_everyone()
            return location
        with recording(also=[(accelerate.utils.other, "safe_save_file")]) as written:
            location = self._save_state(output_dir, *args, **kwargs)
        self.written = written
        self.accelerator.wait_for_everyone()
        path = os.fspath(location)
        self.sealer.submit(path, os.path.dirname(os.path.abspath(path)), written)
        return location

    def close(self) -> None:
        self.sealer.close()
        if self.accelerator.save_state == self.save_state:
            del self.accelerator.save_state  # the class's method again


def seal_saves(accelerator: Any, retention: Policy | RetentionPolicy | None = None) -> SealSaves:
    """Seal every ``accelerator.save_state()`` from now on; see the module docstring."""
    return SealSaves(accelerator, retention)


__all__ = ["SealSaves", "seal_saves"]
