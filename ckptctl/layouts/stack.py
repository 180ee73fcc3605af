"""What every other tool's layout has in common: a directory per checkpoint under a root,
named with its step, complete by that stack's own commit rule, made of files that can be
checked without ever running the stack's pickle code.

A ``StackLayout`` subclass says four things (``dcp``, ``hf_trainer``, ``megatron``,
``deepspeed``, ``lightning``: the one whose checkpoints are files, not directories):

- which directory names are its checkpoints and which files make a directory its own
  (``claims``: a directory no layout claims is never deleted);
- its commit rule (``examine``: committed, partial or corrupt, from the files the stack's own
  resume logic reads, and the pointer file at the root where it has one);
- what each file is, for ``check`` at the three levels: quick (presence, regular file,
  non-empty, sizes and headers), checksums (the checksums that exist: the CRC-32 of every
  ``torch.save`` record, Megatron's ``integrity.json``), load (test-load every file safely);
- what prune must protect (pointer targets, Trainer's best checkpoint), which file it deletes
  first (the one the commit rule reads), and what a resume takes (``resume``).

Every file is read through the checkpoint's ``Storage`` (``storage.stored_file``), so each
layout works the same on a local directory and under an ``s3://`` prefix.
"""

from __future__ import annotations

import copy
import re
import zipfile
from typing import Iterable, Literal, Sequence

from ckptctl.errors import NotFound
from ckptctl.format.seal import SEAL, Seal, is_seal_file
from ckptctl.layouts import safe_load
from ckptctl.format.manifest import Manifest
from ckptctl.layouts.base import NOT_TOLD, Checked, CheckpointKind, Examined, Finding, Resume
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.stored_file import StoredFile, local_copy, open_file

Level = Literal["quick", "checksums", "load"]
FileKind = Literal["torch", "safetensors", "json", "pickle", "distcp", "other"]

NO_CHECKSUMS = ("{what} record no checksums: corruption that still decodes cannot be detected there")


def files_below(ckpt: Storage) -> list[ObjectInfo]:
    """Every file below the checkpoint ``ckpt``, recursively, symlinks included (kind "link")
    but never followed; keys relative to ``ckpt``."""
    return sorted(ckpt.list(), key=lambda info: info.key)


def name_of(ckpt: Storage) -> str:
    """The last component of the checkpoint's URL: its directory (or file) name."""
    return ckpt.url.rstrip("/").rsplit("/", 1)[-1]


class StackLayout:
    """Base of the layouts of other tools; subclasses set the class attributes and override
    ``commit_state`` and ``kind_of`` (and ``extra_checks``, ``protected``, ``resume``)."""

    name = "?"
    title = "?"  # the stack, as the man page names it
    pattern: re.Pattern[str] = re.compile(r"(?!)")  # a directory name -> step (group 1)
    own_files: re.Pattern[str] = re.compile(r"(?!)")  # names that make a directory this stack's
    # Names that make a directory this stack's checkpoint whatever the directory is called
    # (DCP's ``.metadata``: ``dcp.save`` takes any directory); None: only under its own names.
    alone_files: re.Pattern[str] | None = None
    claims_empty = False  # an empty directory under our name is our dead save
    files_are_checkpoints = False  # one file per checkpoint (Lightning), not a directory
    commit_files: tuple[str, ...] = ()  # deleted first: what the commit rule reads
    pointer_file: str | None = None  # the root-level file the stack's default resume reads
    allowed: tuple[object, ...] = ()  # extra globals for torch.load(weights_only=True)
    seal_note: str | None = None  # why ``seal`` leaves this layout's checkpoints alone (None: it seals them)
    # Another tool's checkpoints: judged by ``check`` (no manifest of every byte), never written
    # or deleted by ``rm``, and partial by ``commit_state`` rather than by one file's presence.
    verified_by_manifest = False
    written_by_ckptctl = False
    commit_marker: str | None = None

    def __init__(self) -> None:
        self.root: Storage | None = None

    # --- catalog protocol ----------------------------------------------------------------

    def for_root(self, root: Storage) -> "StackLayout":
        bound = copy.copy(self)
        bound.root = root
        bound.read_root(root)
        return bound

    def read_root(self, root: Storage) -> None:
        """Read the root's pointer file, for stacks that have one."""

    def step_of(self, child: ObjectInfo) -> int | None:
        if child.kind not in ("dir", "link"):
            return None
        m = self.pattern.match(child.key.rsplit("/", 1)[-1])
        return int(m.group(1)) if m is not None and len(m.group(1)) <= 18 else None

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        if not names:
            return self.claims_empty
        return any(self.own_files.match(n) for n in names)

    def claims_alone(self, ckpt: Storage, names: frozenset[str]) -> bool:
        """Whether a directory named by none of this layout's names, holding ``names``, is
        still one of its checkpoints (``layouts.classify``: a path named alone)."""
        return self.alone_files is not None and any(self.alone_files.match(n) for n in names)

    def is_marked(self, ckpt: Storage) -> bool:
        return self.examine(ckpt).status != "partial"

    def examine(self, ckpt: Storage) -> Examined:
        try:
            return self.commit_state(ckpt, self.step_in_name(name_of(ckpt)))
        except NotFound:
            # Deleted while read (a prune, the tool's own rotation): nothing to trust or keep.
            return Examined("partial", "removed while it was being read")

    def step_in_name(self, name: str) -> int | None:
        """The step this layout reads in a checkpoint's name, or None."""
        m = self.pattern.match(name)
        return int(m.group(1)) if m is not None and len(m.group(1)) <= 18 else None

    # --- what subclasses say -------------------------------------------------------------

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        """The stack's commit rule for the checkpoint ``ckpt`` (its directory's storage; for a
        layout whose checkpoints are files, a storage rooted at the file: key "")."""
        raise NotImplementedError

    def kind_of(self, rel: str) -> FileKind:
        """What the file ``rel`` (relative to the checkpoint) is, for checking."""
        if rel.endswith(".safetensors"):
            return "safetensors"
        if rel.endswith(".json"):
            return "json"
        if rel.endswith((".pt", ".pth", ".bin")):
            return "torch"
        if rel.endswith(".distcp"):
            return "distcp"
        return "other"

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        """Stack-specific checks (required files, sidecars, checksums)."""

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        """Names under the root that prune must keep, with why: pointer targets and the like.
        ``entries`` are (name, status) of this layout's checkpoints under the root."""
        return {}

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"{ckpt_path}", (ckpt_path,))

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        """Metrics the stack recorded for its checkpoints ``(name, step)``, by name (the
        Trainer's ``trainer_state.json``); most stacks record none ckptctl reads."""
        return {}

    def sealed_as_another(self, seal: Seal) -> str | None:
        """Why ``seal`` is not this layout's: it was made when the directory read as another
        layout's checkpoint (its files changed since); None when it is this layout's."""
        return None if seal.layout == self.name else f"sealed as a {seal.layout} checkpoint, now read as {self.name}"

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        """Resumable or a model-only export, from file names and headers (no tensor data).
        What cannot be read to tell counts as resumable: verify then judges the file, so a
        damaged checkpoint is reported as damaged, never hidden as an export."""
        return NOT_TOLD

    # --- checking -------------------------------------------------------------------------

    def check(self, ckpt: Storage, level: Level = "checksums") -> Checked:
        """Every file of the checkpoint at ``level``; problems go in the result, nothing
        raises for them. Each level includes the ones before."""
        out = Checked()
        out.step = self.step_in_name(name_of(ckpt))
        try:
            self._check_dir(ckpt, level, out)
        except NotFound as e:
            out.problems.append(Finding(f"removed while it was being verified ({e})",
                                        hint="another process is deleting it; do not resume from it"))
        return out

    def _check_dir(self, ckpt: Storage, level: Level, out: Checked) -> None:
        seen = self.commit_state(ckpt, out.step)
        if seen.status != "committed":
            out.problems.append(Finding(seen.reason or seen.status,
                                        hint="it is not a complete checkpoint; use an older one"))
        # The seal (``ckptctl seal``) is ckptctl's sidecar, not one of the stack's files; it is
        # checked against by ``ops.verify.layouts``. A checkpoint that is one file is key "".
        listed = ([ObjectInfo("", 0, 0.0)] if self.files_are_checkpoints
                  else [f for f in files_below(ckpt) if not is_seal_file(f.key)])
        files = [f.key for f in listed]
        out.files = len(files)
        unchecksummed: set[str] = set()
        for info in listed:
            rel = info.key
            # Opened once for every check of this file: on object storage each open is a request.
            f = open_file(ckpt, rel) if info.kind == "file" else None
            if f is None:
                out.problems.append(Finding("not a regular file (a symlink, FIFO or device); never followed", file=rel,
                                            hint="the checkpoint layout was altered; treat it as untrusted"))
                continue
            with f:
                kind = self.kind_of(rel)
                if f.size == 0 and kind != "other":
                    out.problems.append(Finding("0 bytes: the write never finished", file=rel,
                                                hint="the save was cut short (power loss?); use an older checkpoint"))
                    continue
                self._check_file(f, rel or name_of(ckpt), kind, level, out, unchecksummed)
        self.extra_checks(ckpt, files, level, out)
        if level != "quick" and unchecksummed:
            out.notes.append(NO_CHECKSUMS.format(what=", ".join(sorted(unchecksummed))))

    def _check_file(self, f: StoredFile, shown: str, kind: FileKind, level: Level, out: Checked,
                    unsummed: set[str]) -> None:
        """The checks of one open file at ``level``; ``shown`` names it in the report."""
        if kind == "pickle":
            if level != "load":
                out.not_loaded.append(f"{shown}: presence and size only (a pickle of a class; never unpickled)")
                return
            not_decoded, structural = safe_load.pickle_file_of(f, self.name, self.allowed)
            (out.not_loaded if not_decoded else out.structural).append(f"{shown}: {not_decoded or structural}")
            return
        problem: str | None = None
        if kind == "torch":
            problem = safe_load.zip_structure_of(f)
            legacy = problem is None and safe_load.is_legacy(f)
            if legacy and level != "quick":
                unsummed.add("legacy (pre-zip) torch.save files")
            elif problem is None and level != "quick":
                problem, n = safe_load.zip_crc_of(f)
                out.bytes_read += n
            if problem is None and level == "load":
                problem, not_decoded, structural = safe_load.torch_file_of(f, self.allowed, self.name)
                if not_decoded:
                    out.not_loaded.append(f"{shown}: {not_decoded}")
                elif structural:
                    out.structural.append(f"{shown}: {structural}")
        elif kind == "safetensors":
            problem = safe_load.safetensors_header_of(f)
            if problem is None and level != "quick":
                unsummed.add("*.safetensors")
            if problem is None and level == "load":
                problem, n = safe_load.safetensors_file_of(f)
                out.bytes_read += n
        elif kind == "json":
            _doc, problem = safe_load.json_of(f)
        elif kind == "distcp" and level != "quick":
            unsummed.add("*.distcp")  # their records are checked and loaded from .metadata
        if problem is not None:
            out.problems.append(Finding(problem, file=shown))

    def removal_order(self, keys: Iterable[str]) -> list[str]:
        """Keys in the order a delete takes them: the commit files first, so that a delete
        cut short never leaves something that reads as complete."""
        first = {k: i for i, k in enumerate(self.commit_files)}
        # The seal right after the commit files: a delete cut short then leaves the stack's
        # own files (a partial checkpoint its layout claims and prune later removes), never a
        # directory holding only the seal, which no layout claims.
        first.setdefault(SEAL, len(self.commit_files))
        return sorted(keys, key=lambda k: (first.get(k, len(first)), k))

    # --- pointers (the root-level commit record of DeepSpeed and Megatron) -----------------

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None:
        """The root-level pointer file that commits the checkpoint ``name`` (key, content),
        for stacks whose commit rule reads one; None for the others."""
        return None

    def pointer_step(self, raw: bytes) -> int | None:
        """The step an existing pointer file's content names (None: unreadable)."""
        return None

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        """The root's pointer file as read (key, the checkpoint name it names, its step), for
        stacks whose default resume reads one; None when there is none or it is unreadable."""
        return None

    def assuming_pointer(self, name: str, step: int) -> "StackLayout":
        """This layout as if the root's pointer named ``name`` (a copy about to write it
        checks the copy first, then commits it by writing the pointer)."""
        return self


def whole_torch_file(ckpt: Storage, unfinished: str) -> Examined:
    """The commit rule of a checkpoint that is one ``torch.save`` file (Lightning, Composer):
    complete when it is a whole zip archive (its directory, written last, is at its end);
    ``unfinished`` says why a 0-byte or cut file is that stack's own unfinished save."""
    f = open_file(ckpt, "")
    if f is None:
        return Examined("partial", "removed while it was being read")
    with f:
        if f.size == 0:
            return Examined("partial", f"0 bytes: {unfinished}")
        if not zipfile.is_zipfile(f):
            return Examined("partial", f"not a whole torch.save archive (no zip directory at its end): {unfinished}")
    return Examined("committed")


REMOTE_KEYS_LIMIT = 64 << 20  # largest object downloaded only to read its top-level keys


def top_level_keys(ckpt: Storage, key: str, allowed: Sequence[object] = ()) -> dict[str, bool] | str:
    """The top-level keys of the ``torch.save`` dict ``key``, each with whether its value is
    not None (DeepSpeed saves ``optimizer: None`` under ZeRO), read with
    ``torch.load(weights_only=True)`` and tensors memory-mapped (their bytes are not read);
    a string saying why not when it cannot be read safely (never unpickled beyond ``allowed``)."""
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
    return {k: v is not None for k, v in doc.items() if isinstance(k, str)}


def undetermined(why: str) -> CheckpointKind:
    """A checkpoint whose content could not be read: counted as resumable (verify judges it)."""
    return CheckpointKind("resumable", f"not told apart: {why}; verify judges it")


def finding_in(ckpt: Storage, key: str, e: Exception, hint: str | None = None) -> Finding:
    """A problem a reader raised about the file ``key`` of ``ckpt``, as a ``Finding`` naming
    that file once: the reader's own ``URL: `` prefix is dropped (the report names the file)."""
    text = str(e)
    prefix = f"{ckpt.url_of(key)}: "
    return Finding(text[len(prefix):] if text.startswith(prefix) else text, file=key, hint=hint)
