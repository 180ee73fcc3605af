"""Where things live in a checkpoint root: step directories and the names inside them.

    ROOT/step-0000001000/
        rank-00000-of-00004.safetensors   one shard per writing rank
        manifest.json                     what the checkpoint holds
        COMMITTED                         the marker, written last

Every file a marker commits is published only under a name nothing else has (never replacing
a file), so a committed step cannot change under its marker. Where a canonical name is taken
by another attempt at the same step (a dead save's leftover, a zombie job), a save publishes
under its attempt's name instead: the save id, 16 hex digits, before the suffix
(``rank-00000-of-00004.<id>.safetensors``, ``manifest.<id>.json``). The manifest lists its
shards by name, and the marker names its manifest when it is not ``manifest.json``.

Steps are compared as integers, never as strings: ``step-10`` sorts after ``step-9`` even
when a directory was named by hand without padding.
"""

from __future__ import annotations

import re
import secrets

STEP_PREFIX = "step-"
STEP_DIGITS = 10
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
SHARD_SUFFIX = ".safetensors"

MAX_STEP = 2**63 - 1  # a step is a signed 64-bit count everywhere it is stored or compared

# Plain ASCII digits only: ``\d`` alone also matches other scripts' digits (``step-٤٠`` would
# read as 40), and ``$`` accepts a trailing newline; ``\Z`` does not.
_STEP_RE = re.compile(r"step-([0-9]{1,19})\Z", re.ASCII)
SAVE_ID_HEX = 16
_SAVE_ID_RE = re.compile(r"[0-9a-f]{16}\Z", re.ASCII)
_MANIFEST_RE = re.compile(r"manifest(\.[0-9a-f]{16})?\.json\Z", re.ASCII)
_SHARD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")
# The names ``shard_name`` gives, with an attempt's save id before the suffix where the
# canonical name was taken (``attempt_name``).
_OWN_SHARD_RE = re.compile(r"rank-[0-9]{5}-of-[0-9]{5}(-[0-9]+)?(\.[0-9a-f]{16})?\.safetensors\Z", re.ASCII)


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


def is_own_shard_name(name: str) -> bool:
    """A name ckptctl gives its shard files (``shard_name``, or an attempt's): how a directory
    of ckptctl's is told apart from other tools' by its file names."""
    return _OWN_SHARD_RE.match(name) is not None


def is_valid_shard_name(name: str) -> bool:
    """A shard name is one plain file name: no directories, no dot-dot, nothing hidden."""
    return bool(_SHARD_RE.match(name)) and ".." not in name


def new_save_id() -> str:
    """A fresh random save id: 16 lowercase hex digits (64 bits)."""
    return secrets.token_hex(SAVE_ID_HEX // 2)


def is_save_id(text: str) -> bool:
    return bool(_SAVE_ID_RE.match(text))


def attempt_name(name: str, save_id: str) -> str:
    """The name one save attempt publishes ``name`` under when ``name`` itself is taken:
    ``attempt_name("manifest.json", "0123456789abcdef") == "manifest.0123456789abcdef.json"``."""
    if not is_save_id(save_id):
        raise ValueError(f"not a save id: {save_id!r}")
    stem, dot, suffix = name.rpartition(".")
    if not dot or not stem:
        raise ValueError(f"{name!r} has no suffix to put a save id before")
    return f"{stem}.{save_id}.{suffix}"


def is_manifest_name(name: str) -> bool:
    """``manifest.json`` or an attempt's ``manifest.<save id>.json``: one plain name, never a
    path (a marker may name its manifest, and a marker is untrusted input)."""
    return bool(_MANIFEST_RE.match(name))
