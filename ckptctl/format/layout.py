"""Where things live in a checkpoint root: step directories and the names inside them.

    ROOT/step-0000001000/
        rank-00000-of-00004.safetensors   one shard per writing rank
        manifest.json                     what the checkpoint holds
        COMMITTED                         the marker, written last

Steps are compared as integers, never as strings: ``step-10`` sorts after ``step-9`` even
when a directory was named by hand without padding.
"""

from __future__ import annotations

import re

STEP_PREFIX = "step-"
STEP_DIGITS = 10
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
SHARD_SUFFIX = ".safetensors"

_STEP_RE = re.compile(r"^step-(\d{1,19})$")
_SHARD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")


def step_dir(step: int) -> str:
    """``step_dir(1000) == "step-0000001000"``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int, world_size: int, part: int = 0) -> str:
    suffix = f"-{part}" if part else ""
    return f"rank-{rank:05d}-of-{world_size:05d}{suffix}{SHARD_SUFFIX}"


def is_valid_shard_name(name: str) -> bool:
    """A shard name is one plain file name: no directories, no dot-dot, nothing hidden."""
    return bool(_SHARD_RE.match(name)) and ".." not in name
