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

MAX_STEP = 2**63 - 1  # a step is a signed 64-bit count everywhere it is stored or compared

# Plain ASCII digits only: ``\d`` alone also matches other scripts' digits (``step-٤٠`` would
# read as 40), and ``$`` accepts a trailing newline; ``\Z`` does not.
_STEP_RE = re.compile(r"step-([0-9]{1,19})\Z", re.ASCII)
_SHARD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")


def step_dir(step: int) -> str:
    """``step_dir(1000) == "step-0000001000"``."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory."""
    m = _STEP_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def shard_name(rank: int, world_size: int, part: int = 0) -> str:
    """``shard_name(1, 4) == "rank-00001-of-00004.safetensors"``; ``part`` > 0 adds ``-part``."""
    suffix = f"-{part}" if part else ""
    return f"rank-{rank:05d}-of-{world_size:05d}{suffix}{SHARD_SUFFIX}"


def is_valid_shard_name(name: str) -> bool:
    """A shard name is one plain file name: no directories, no dot-dot, nothing hidden."""
    return bool(_SHARD_RE.match(name)) and ".." not in name
