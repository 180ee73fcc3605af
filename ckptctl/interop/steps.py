"""The training step a foreign checkpoint was saved at, from what its own stack records.

Every stack records the step somewhere, and a checkpoint converted without it resumes at step
0 (ckptctl's own manifest has a step; a missing one used to be written as 0, so a resumed job
silently restarted its schedule). Where each stack keeps it:

- names: Lightning ``epoch=E-step=S.ckpt`` (``ModelCheckpoint``'s default file name), Hugging Face Trainer ``checkpoint-N`` (``transformers.trainer``:
  ``f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"``), Megatron-LM ``iter_NNNNNNN``
  (``megatron/training/checkpointing.py``: ``'iter_{:07d}'``), torchtitan ``step-N``
  (``torchtitan/components/checkpoint.py``), DeepSpeed ``global_stepN``;
- contents: HF ``trainer_state.json`` ``global_step``; torchtitan's ``train_state`` entry
  (``{"step": torch.tensor(step, dtype=torch.int32), ...}``, or a plain int in newer
  releases); a ``step`` / ``global_step`` / ``iteration`` key at the top of a ``torch.save``
  file (Lightning ``.ckpt`` files hold ``global_step``, Megatron's legacy
  ``model_optim_rng.pt`` holds ``iteration``); ckptctl's own ``ckptctl.step`` metadata.

Each finding is a ``StepClue`` (the step and where it was read). The clues of one checkpoint
must agree: a ``checkpoint-1500`` whose ``trainer_state.json`` says 1400 is refused rather
than guessed (``decide_step``), unless the caller names the step explicitly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import InvalidCheckpoint, UsageError

# Directory names that carry the step, by the stack that writes them.
_NAMED = (
    (re.compile(r"^checkpoint-(\d+)$"), "Hugging Face Trainer directory name"),
    (re.compile(r"^iter_(\d+)$"), "Megatron-LM directory name"),
    (re.compile(r"^step-(\d+)$"), "directory name"),
    (re.compile(r"^global_step(\d+)$"), "DeepSpeed directory name"),
)
_LIGHTNING = re.compile(r"(?:^|[-_])step=(\d+)(?:[-_.]|$)")
_MP_RANK = re.compile(r"^mp_rank_\d+(_\d+)?$")
# Top-level keys of a torch.save file that hold the step, most specific first.
STEP_KEYS = ("global_step", "step", "iteration")
MAX_STEP = 10**15  # far above any real run; keeps a garbled value out of directory names


@dataclass(frozen=True)
class StepClue:
    step: int
    origin: str  # where it was read, for messages: "trainer_state.json global_step"


def from_name(path: str) -> list[StepClue]:
    """The clue in the name of the checkpoint directory: ``path`` itself, or for a file the
    directory holding it (for Megatron's legacy ``iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt``,
    the one above ``mp_rank_XX``). Directories further up say nothing about the step."""
    p = os.path.abspath(path).rstrip("/")
    if not os.path.isdir(p):
        m = _LIGHTNING.search(os.path.basename(p))
        if m and int(m.group(1)) <= MAX_STEP:  # ModelCheckpoint's default name: epoch=E-step=S.ckpt
            return [StepClue(int(m.group(1)), f"Lightning file name {os.path.basename(p)!r}")]
        p = os.path.dirname(p)
        if _MP_RANK.match(os.path.basename(p)):
            p = os.path.dirname(p)
    base = os.path.basename(p)
    for pattern, what in _NAMED:
        m = pattern.match(base)
        if m and int(m.group(1)) <= MAX_STEP:
            return [StepClue(int(m.group(1)), f"{what} {base!r}")]
    return []


def as_step(value: Any) -> int | None:
    """An int step out of a plain value or a one-element integer tensor; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_STEP else None
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1 and not value.is_floating_point() and not value.is_complex():
        v = int(value.reshape(-1)[0].item())
        return v if 0 <= v <= MAX_STEP else None
    return None


def decide_step(clues: list[StepClue], explicit: int | None, where: str) -> tuple[int | None, str]:
    """The step to write and a note saying where it came from.

    ``explicit`` (``--step``) always wins; the note then says when the source disagreed. Without
    it the source's clues must agree (InvalidCheckpoint naming both otherwise). No clue and no
    ``explicit``: ``(None, "")``; the caller decides whether that is acceptable."""
    if explicit is not None:
        if explicit < 0 or explicit > MAX_STEP:
            raise UsageError(f"--step {explicit} is out of range", hint=f"give a step between 0 and {MAX_STEP}")
        differ = sorted({f"{c.step} ({c.origin})" for c in clues if c.step != explicit})
        return explicit, ("--step" + (f"; the source says {', '.join(differ)}" if differ else ""))
    steps = {c.step for c in clues}
    if len(steps) > 1:
        said = "; ".join(f"{c.origin} says {c.step}" for c in clues)
        raise InvalidCheckpoint(f"{where}: the checkpoint disagrees about its step: {said}",
                                hint="find out which is right and pass it with --step N")
    if not clues:
        return None, ""
    return clues[0].step, " and ".join(dict.fromkeys(c.origin for c in clues))
