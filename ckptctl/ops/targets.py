"""What a path or URL given to a verb names, and the one diagnosis of a wrong target.

``ops.verbs`` (each verb by path, as the CLI names it) and the root-wide operations open their
targets here; what is at a path is ``layouts.classify``'s one answer, and these turn a wrong
answer into the one error every verb gives:

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

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.layouts.classify import NO_FORMAT_DIR, Found, classify
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


def existing(path: str) -> Found:
    """``classify(path)``, refusing a local path that does not exist or a malformed URL
    (UsageError, exit 2). An empty object-store prefix is a fresh root, as ``open_existing``
    takes it: only where one checkpoint is expected is it missing (``one_checkpoint``)."""
    if _MALFORMED_URL.match(path) and "://" not in path:
        raise _no_such(path)
    found = classify(path)
    if found.missing and found.local is not None:
        raise _no_such(path)
    return found


def one_checkpoint(path: str, verb: str = "this verb") -> Found:
    """What ``path`` is when one checkpoint is expected: a layout's checkpoint or a file
    format. Raises UsageError (missing, or a root of checkpoints) or InvalidCheckpoint
    (nothing that is a checkpoint)."""
    found = existing(path)
    if found.missing:  # nothing under an object-store prefix: no checkpoint is there
        raise _no_such(path)
    if found.what == "root":
        raise _root_error(path, found.entries, verb)
    if found.what == "nothing":
        raise _not_a_checkpoint(path, found.reason or NO_FORMAT_DIR)
    return found


def ckptctl_checkpoint(found: Found, verb: str) -> Storage:
    """The storage of ``found`` when its files are what ckptctl's own reader takes (a manifest
    and its shards: ``reshard``, a ``cp`` of one); anything else is refused (InvalidCheckpoint),
    saying that ``verb`` takes ckptctl checkpoints only and how to make one."""
    fmt = found.file_format()
    if fmt == "ckptctl" or (found.what == "checkpoint" and not found.claimed):
        return found.storage  # (unclaimed: named like ckptctl's step directory; its reader says what is missing)
    what = fmt or (found.in_layout.name if found.what == "checkpoint" else "foreign")
    raise _not_ckptctl(found.path, what, verb)


__all__ = ["Found", "ckptctl_checkpoint", "existing", "one_checkpoint", "open_existing", "open_root"]
