"""What a path or URL given to a verb names, and the one diagnosis of a wrong target.

``ops.verbs`` (each verb by path, as the CLI names it) and the root-wide operations open their
targets here, so every verb says the same about a wrong one:

- a path that does not exist, or a malformed URL (``s3:/bucket``): UsageError (exit 2),
  "no such file or directory: PATH", never an empty listing that looks like a fresh run;
- a checkpoint root where one checkpoint is expected: UsageError "this is a root holding N
  checkpoints; did you mean --latest?";
- a file or directory that is no checkpoint of any format: InvalidCheckpoint (exit 1)
  "not a checkpoint: PATH", not a storage error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.format.layout import MANIFEST, MARKER, parse_step_dir
from ckptctl.interop.detect import CKPTCTL_SHARD, foreign_format
from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.storage import Storage, open_storage

# "s3:/bucket", "file:relative": a scheme with fewer than two slashes is a typo of a URL, which
# would otherwise be taken for a relative local path that does not exist.
_MALFORMED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(?!//)")


def _no_such(path: str) -> UsageError:
    hint = "check the path for a typo, and that its filesystem is mounted"
    if _MALFORMED_URL.match(path):
        scheme, rest = path.split(":", 1)
        hint = f"a URL needs two slashes: {scheme}://{rest.lstrip('/')}"
    return UsageError(f"no such file or directory: {path}", hint=hint)


def open_existing(path: str) -> Storage:
    """``open_storage(path)``, refusing a local path that does not exist. Object-store
    prefixes cannot be told apart from empty ones, so only local paths are checked here."""
    if _MALFORMED_URL.match(path) and "://" not in path:
        raise _no_such(path)
    st = open_storage(path)
    local = st.local_path()
    if local is not None and not os.path.lexists(local):
        raise _no_such(path)
    return st


def open_root(path: str) -> Storage:
    """The checkpoint root ``path`` names, which must exist: UsageError (exit 2) for a missing
    local path, a malformed URL or a regular file."""
    st = open_existing(path)
    local = st.local_path()
    if local is not None and not os.path.isdir(local):
        raise UsageError(f"not a directory: {path}", hint="give the checkpoint root, the directory holding step-XXXXXXXXXX")
    return st


Kind = Literal["ckptctl", "foreign"]


@dataclass(frozen=True)
class Target:
    """What a path given as one checkpoint is: ``ckptctl`` (``storage`` opened) or
    ``foreign`` (``format`` is dcp, safetensors or torch; ``path`` is then a local path)."""

    path: str
    kind: Kind
    storage: Storage | None = None
    format: str | None = None


def _root_error(path: str, n: int, verb: str) -> UsageError:
    # Only verify has --latest/--all: every other verb's hint names what it does take.
    many = f"this is a root holding {n} checkpoint{'' if n == 1 else 's'}"
    one = f"{path.rstrip('/')}/step-XXXXXXXXXX"
    if verb == "verify":
        return UsageError(f"{many}; did you mean --latest?",
                          hint=f"name one checkpoint ({one}), or pass --latest or --all: `ckptctl verify {path} --latest`")
    return UsageError(f"{many}; {verb} takes one checkpoint",
                      hint=f"name one checkpoint ({one}); `ckptctl ls {path}` lists them")


def _not_a_checkpoint(path: str, what: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(
        f"not a checkpoint: {path} ({what})",
        hint="give a checkpoint directory (ROOT/step-XXXXXXXXXX), a DCP directory, a .safetensors or a torch.save file",
    )


def _not_ckptctl(path: str, fmt: str, verb: str) -> InvalidCheckpoint:
    """Another tool's checkpoint given to a verb that reads ckptctl's only (reshard, cp of a
    bare DCP or safetensors directory): say so, and what makes one it can read."""
    return InvalidCheckpoint(
        f"{path} is a {fmt} checkpoint; {verb} takes ckptctl checkpoints only",
        hint=f"make one first: `ckptctl convert {path} DIR --to ckptctl`"
             + (", then reshard DIR" if verb == "reshard" else ""),
    )


def resolve_checkpoint(path: str, *, foreign: bool = True, verb: str = "this verb") -> Target:
    """Say what ``path`` holds when one checkpoint is expected. Raises UsageError (missing
    path, or a root of checkpoints) or InvalidCheckpoint (nothing that is a checkpoint).
    With ``foreign=False`` another tool's checkpoint is refused, saying that ``verb`` takes
    ckptctl checkpoints only."""
    st = open_existing(path)
    local = st.local_path()
    if local is None:  # object storage: only ckptctl checkpoints live there
        if st.stat(MARKER) is not None or st.stat(MANIFEST) is not None:
            return Target(path, "ckptctl", st)
        steps = list_checkpoints(st)
        if steps:
            raise _root_error(path, len(steps), verb)
        if next(iter(st.list()), None) is None:
            raise _no_such(path)
        return Target(path, "ckptctl", st)  # objects but no marker: the reader says why
    if os.path.isdir(local):
        names = os.listdir(local)
        if MARKER in names or MANIFEST in names or any(CKPTCTL_SHARD.match(n) for n in names):
            return Target(path, "ckptctl", st)
    fmt = foreign_format(local)
    if fmt is not None:
        if not foreign:
            raise _not_ckptctl(path, fmt, verb)
        return Target(local, "foreign", format=fmt)  # the readers of other formats take a local path
    if not os.path.isdir(local):
        raise _not_a_checkpoint(path, "a file of no checkpoint format")
    steps = list_checkpoints(st)
    if steps:
        raise _root_error(path, len(steps), verb)
    if parse_step_dir(os.path.basename(local.rstrip("/"))) is not None:
        return Target(path, "ckptctl", st)  # a step directory still empty: the reader says "not committed"
    raise _not_a_checkpoint(path, "no manifest, marker, DCP .metadata or .safetensors in it")


__all__ = ["Target", "open_existing", "open_root", "resolve_checkpoint"]
