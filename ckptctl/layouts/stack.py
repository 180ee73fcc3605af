"""What every other tool's layout has in common: a directory per checkpoint under a root,
named with its step, complete by that stack's own commit rule, made of files that can be
checked without ever running the stack's pickle code.

``StackLayout`` is how the built-in layouts of other tools implement the ``Layout`` protocol
(``base``): an implementation detail of ``layouts/``, never something a verb or a plugin needs
to know of. A subclass says (``dcp``, ``hf_trainer``, ``megatron``, ``deepspeed``,
``lightning``, ``accelerate``, ``composer``, ``nemo``):

- which directory names are its checkpoints and which files make a directory its own
  (``pattern``, ``own_files``, ``alone_files``: a directory no layout claims is never deleted);
- its commit rule (``commit_state``: committed, partial or corrupt, from the files the stack's
  own resume logic reads, and the pointer file at the root where it has one);
- what each file is (``kind_of``), which files its resume reads (``resume_files``), what else
  to check (``extra_checks``): ``check`` is ``file_check.check_files`` with these;
- what prune must protect (``protected``), which file it deletes first (``commit_files``), and
  what a resume takes (``resume``).
"""

from __future__ import annotations

import copy
import re
import zipfile
from typing import Iterable, Sequence

from ckptctl.errors import NotFound
from ckptctl.format.manifest import Manifest
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import NOT_TOLD, CheckpointKind, Examined, Numbering, Resume
from ckptctl.layouts.checked import ALONE, Checked, Level, Problem, Split
from ckptctl.layouts.file_check import FileKind, check_files, kind_by_suffix, name_of, sealed_as_another
from ckptctl.layouts.files import inspect_local
from ckptctl.layouts.inspected import Inspected
from ckptctl.layouts.removal import commit_files_first
from ckptctl.layouts.stack_copying import StackCopying
from ckptctl.format.seal import Seal
from ckptctl.progress import Progress
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.known import Listed
from ckptctl.storage.stored_file import local_copy, open_file


class StackLayout(StackCopying):
    """Base of the built-in layouts of other tools; subclasses set the class attributes and
    override ``commit_state`` and ``kind_of`` (and ``extra_checks``, ``protected``, ``resume``).
    How their checkpoints are copied is ``layouts.stack_copying``'s."""

    name = "?"
    title = "?"  # the stack, as the man page names it
    pattern: re.Pattern[str] = re.compile(r"(?!)")  # a directory name -> step (group 1)
    own_files: re.Pattern[str] = re.compile(r"(?!)")  # names that make a directory this stack's
    # Names that make a directory this stack's checkpoint whatever the directory is called
    # (DCP's ``.metadata``: ``dcp.save`` takes any directory); None: only under its own names.
    alone_files: re.Pattern[str] | None = None
    # The files the stack's resume reads (keys relative to the checkpoint); None: every file.
    resume_files: re.Pattern[str] | None = None
    claims_empty = False  # an empty directory under our name is our dead save
    files_are_checkpoints = False  # one file per checkpoint (Lightning), not a directory
    commit_files: tuple[str, ...] = ()  # deleted first: what the commit rule reads
    pointer_file: str | None = None  # the root-level file the stack's default resume reads
    allowed: tuple[object, ...] = ()  # extra globals for torch.load(weights_only=True)
    seal_note: str | None = None  # why ``seal`` leaves this layout's checkpoints alone (None: it seals them)
    integration: str | None = None  # what in ``ckptctl.integrations`` seals this stack's saves as they are written
    commit_marker: str | None = None  # the commit rule reads more than one file's presence

    def __init__(self) -> None:
        self.root: Storage | None = None

    # --- recognise and step ----------------------------------------------------------------

    def for_root(self, root: Storage) -> "StackLayout":
        bound = copy.copy(self)
        bound.root = root
        bound.read_root(root)
        return bound

    def for_listed_root(self, root: Storage, children: Sequence[ObjectInfo]) -> "StackLayout":
        """``for_root``, with ``children`` the listing of ``root`` just made: a pointer file the
        listing does not hold is read as missing without a request (``storage.known``); the
        layout is bound to ``root`` itself, so nothing it reads later is answered from it."""
        bound = self.for_root(Listed(root, children))
        bound.root = root
        return bound

    def read_root(self, root: Storage) -> None:
        """Read the root's pointer file, for stacks that have one."""

    def step_of(self, child: ObjectInfo) -> int | None:
        if child.kind not in ("dir", "link"):
            return None
        return self.step_in_name(child.key.rsplit("/", 1)[-1])

    def step_in_name(self, name: str) -> int | None:
        """The step this layout reads in a checkpoint's name, or None."""
        m = self.pattern.match(name)
        return int(m.group(1)) if m is not None and len(m.group(1)) <= 18 else None

    def numbered_by(self, name: str) -> Numbering:
        return "step"  # every stack but accelerate names its checkpoints by training step

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        if not names:
            return self.claims_empty
        return any(self.own_files.match(n) for n in names)

    def claims_alone(self, ckpt: Storage, names: frozenset[str]) -> bool:
        return self.alone_files is not None and any(self.alone_files.match(n) for n in names)

    # --- commit rule and removal -------------------------------------------------------------

    def examine(self, ckpt: Storage) -> Examined:
        try:
            return self.commit_state(ckpt, self.step_in_name(name_of(ckpt)))
        except NotFound:
            # Deleted while read (a prune, the tool's own rotation): nothing to trust or keep.
            return Examined("partial", "removed while it was being read")

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        """The stack's commit rule for the checkpoint ``ckpt`` (its directory's storage; for a
        layout whose checkpoints are files, a storage rooted at the file: key "")."""
        raise NotImplementedError

    def removal_order(self, keys: Iterable[str]) -> list[str]:
        return commit_files_first(keys, self.commit_files)

    # --- checking and inspecting --------------------------------------------------------------

    def kind_of(self, rel: str) -> FileKind:
        """What the file ``rel`` (relative to the checkpoint) is, for checking."""
        return kind_by_suffix(rel)

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        """Stack-specific checks (required files, sidecars, checksums)."""

    def check(self, ckpt: Storage, level: Level, *, split: Split = ALONE, progress: Progress | None = None) -> Checked:
        out = check_files(self, ckpt, level, kind_of=self.kind_of, allowed=self.allowed, extra=self.extra_checks,
                          split=split)
        if out.unsummed and self.seal_note is None:  # its files get checksums from a seal
            out.seal_hint = (f"`ckptctl seal {ckpt.url}` records checksums of every byte, so that verify checks them"
                             + (f"; {self.integration} seals each save as it is written" if self.integration else ""))
        return out

    def reads_on_resume(self, rel: str) -> bool:
        return self.resume_files is None or self.resume_files.match(rel) is not None

    def identity(self, ckpt: Storage) -> str | None:
        return None  # no record names its contents: each prune checks it afresh (or by its seal)

    def inspect(self, ckpt: Storage, *, tensors: bool = False) -> Inspected:
        result = inspect_local(ckpt, tensors=tensors)
        kind = self.kind_of_checkpoint(ckpt)
        result.content, result.content_reason = kind.kind, kind.reason
        name = name_of(ckpt)
        result.numbered_by = self.numbered_by(name)
        if result.step is None and result.numbered_by != "step":  # its files record none: the name's number, labelled
            result.step = self.step_in_name(name)
        return result

    def sealed_as_another(self, seal: Seal) -> str | None:
        """Why ``seal`` is not this layout's (``file_check.sealed_as_another``)."""
        return sealed_as_another(self.name, seal)

    # --- pointers (the root-level commit record of DeepSpeed and Megatron) -----------------

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None:
        return None

    def pointer_step(self, raw: bytes) -> int | None:
        return None

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        return None

    def assuming_pointer(self, name: str, step: int) -> "StackLayout":
        return self

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {}

    # --- resume and metrics --------------------------------------------------------------------

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        """Resumable or a model-only export, from file names and headers (no tensor data).
        What cannot be read to tell counts as resumable: verify then judges the file, so a
        damaged checkpoint is reported as damaged, never hidden as an export."""
        return NOT_TOLD

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"{ckpt_path}", (ckpt_path,))

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        """Metrics the stack recorded for its checkpoints ``(name, step)``, by name (the
        Trainer's ``trainer_state.json``); most stacks record none ckptctl reads."""
        return {}


def whole_torch_file(ckpt: Storage, unfinished: str) -> Examined:
    """The commit rule of a checkpoint that is one ``torch.save`` file (Lightning, Composer):
    complete when it is a whole zip archive (its directory, written last, is at its end), corrupt
    when its end records are damaged; ``unfinished`` says why a 0-byte or cut file is that
    stack's own unfinished save."""
    f = open_file(ckpt, "")
    if f is None:
        return Examined("partial", "removed while it was being read")
    with f:
        if f.size == 0:
            return Examined("partial", f"0 bytes: {unfinished}")
        ended = safe_load.archive_end_of(f)
    if ended is None:
        return Examined("committed")
    status, why = ended
    # A cut write has no end record; end records that are there but wrong are damage (a flipped
    # byte), never the stack's unfinished save.
    return Examined(status, f"not a whole torch.save archive (no zip directory at its end): {unfinished}"
                    if status == "partial" else why)


REMOTE_KEYS_LIMIT = 64 << 20  # largest object downloaded only to read its top-level keys


def top_level_keys(ckpt: Storage, key: str, allowed: Sequence[object] = ()) -> dict[str, bool] | str:
    """The top-level keys of the ``torch.save`` dict ``key``, each with whether its value is
    not None (DeepSpeed saves ``optimizer: None`` under ZeRO); a string saying why not when it
    cannot be read safely (``top_level``)."""
    doc = top_level(ckpt, key, allowed)
    return doc if isinstance(doc, str) else {k: v is not None for k, v in doc.items()}


def top_level(ckpt: Storage, key: str, allowed: Sequence[object] = ()) -> dict[str, object] | str:
    """The top-level dict (its string keys) of the ``torch.save`` file ``key``, read with
    ``torch.load(weights_only=True)`` and tensors memory-mapped (their bytes are not read); a
    string saying why not when it cannot be read safely (never unpickled beyond ``allowed``)."""
    import pickle

    import torch

    f = open_file(ckpt, key)
    if f is None:
        return f"{key} is not a regular file"
    if f.fd_path is None and f.size > REMOTE_KEYS_LIMIT:
        # torch.load needs the whole file at hand: on object storage that is a download of
        # every tensor only to list a dict's keys, so a large one is not read (``ls`` stays cheap).
        f.close()
        return f"{key} is {f.size} bytes on object storage, not downloaded to tell"
    try:
        with f, local_copy(f) as where, torch.serialization.safe_globals(list(allowed)):
            doc = torch.load(where, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(where))
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, KeyError, TypeError, IndexError,
            AttributeError, OverflowError, RecursionError, zipfile.BadZipFile) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"{key} could not be read safely ({first[:120]})"
    if not isinstance(doc, dict):
        return f"{key} does not hold a dict"
    return {k: v for k, v in doc.items() if isinstance(k, str)}


def optimizer_in_file(ckpt: Storage, key: str, allowed: Sequence[object], export: str) -> CheckpointKind:
    """Resumable when the ``torch.save`` dict ``key`` holds an ``optimizer`` that is not None
    (DeepSpeed's and Megatron's model states without ZeRO or a distributed optimizer), else an
    export (``export`` says why); not told apart when it cannot be read safely."""
    found = top_level_keys(ckpt, key, allowed)
    if isinstance(found, str):
        return undetermined(found)
    if found.get("optimizer"):
        return CheckpointKind("resumable", f"{key} holds the optimizer state")
    return CheckpointKind("export", export)


def undetermined(why: str) -> CheckpointKind:
    """A checkpoint whose content could not be read: counted as resumable (verify judges it)."""
    return CheckpointKind("resumable", f"not told apart: {why}; verify judges it")


def finding_in(ckpt: Storage, key: str, e: Exception, hint: str | None = None) -> Problem:
    """A problem a reader raised about the file ``key`` of ``ckpt``, as a ``Problem`` naming
    that file once: the reader's own ``URL: `` prefix is dropped (the report names the file)."""
    text = str(e)
    prefix = f"{ckpt.url_of(key)}: "
    return Problem(text[len(prefix):] if text.startswith(prefix) else text, file=key, hint=hint)
