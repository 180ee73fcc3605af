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

Only local roots are read: on object storage no directory is claimed, so other tools'
checkpoints there are listed as ``unknown`` and never touched.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from ckptctl.errors import StorageError
from ckptctl.format.seal import SEAL
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import Checked, Examined, Finding
from ckptctl.storage.base import ObjectInfo, Storage

Level = Literal["quick", "checksums", "load"]
FileKind = Literal["torch", "safetensors", "json", "pickle", "distcp", "other"]

NO_CHECKSUMS = ("{what} record no checksums: corruption that still decodes cannot be detected there")


@dataclass(frozen=True)
class Resume:
    """What a stack's resume takes for one checkpoint: the path its default resume takes, and
    the arguments that resume exactly this checkpoint (``latest --resume-args``)."""

    path: str  # the path to hand over (a checkpoint directory, or the root for pointer stacks)
    option: str  # how the stack takes it, in words, e.g. "--resume_from_checkpoint PATH"
    argv: tuple[str, ...] = ()  # argv-ready arguments naming exactly this checkpoint
    # Whether ``path`` with the stack's default resume loads exactly this checkpoint: False
    # when the root's pointer (Megatron's tracker, DeepSpeed's ``latest``) names another one.
    exact: bool = True
    pointer: str | None = None  # the pointer file that makes ``path`` inexact, and what it names

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "option": self.option, "argv": list(self.argv), "exact": self.exact,
                "pointer": self.pointer}


def local_dir(ckpt: Storage) -> str | None:
    """The local directory ``ckpt`` is rooted at, or None on object storage."""
    return ckpt.local_path()


def files_below(path: str) -> list[str]:
    """Every entry below ``path`` (relative, ``/``-separated), symlinks included as names but
    never followed."""
    out = []
    for dirpath, dirs, files in os.walk(path, followlinks=False):
        rel = os.path.relpath(dirpath, path)
        for name in sorted(files) + sorted(d for d in dirs if os.path.islink(os.path.join(dirpath, d))):
            out.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(out)


class StackLayout:
    """Base of the layouts of other tools; subclasses set the class attributes and override
    ``commit_state`` and ``kind_of`` (and ``extra_checks``, ``protected``, ``resume``)."""

    name = "?"
    title = "?"  # the stack, as the man page names it
    pattern: re.Pattern[str] = re.compile(r"(?!)")  # a directory name -> step (group 1)
    own_files: re.Pattern[str] = re.compile(r"(?!)")  # names that make a directory this stack's
    claims_empty = False  # an empty directory under our name is our dead save
    files_are_checkpoints = False  # one file per checkpoint (Lightning), not a directory
    commit_files: tuple[str, ...] = ()  # deleted first: what the commit rule reads
    pointer_file: str | None = None  # the root-level file the stack's default resume reads
    allowed: tuple[object, ...] = ()  # extra globals for torch.load(weights_only=True)

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
        if local_dir(ckpt) is None:
            return False
        if not names:
            return self.claims_empty
        return any(self.own_files.match(n) for n in names)

    def is_marked(self, ckpt: Storage) -> bool:
        return local_dir(ckpt) is not None and self.examine(ckpt).status != "partial"

    def examine(self, ckpt: Storage) -> Examined:
        path = local_dir(ckpt)
        if path is None:
            return Examined("corrupt", "only local directories are read for this layout")
        try:
            return self.commit_state(path, _step_of_path(self, path))
        except FileNotFoundError:
            # Deleted while read (a prune, the tool's own rotation): nothing to trust or keep.
            return Examined("partial", "removed while it was being read")
        except OSError as e:
            raise StorageError(f"{path}: cannot read the checkpoint directory ({e.strerror or e})",
                               hint="check its permissions and that its filesystem is mounted") from None

    # --- what subclasses say -------------------------------------------------------------

    def commit_state(self, path: str, step: int | None) -> Examined:
        """The stack's commit rule for the checkpoint directory ``path``."""
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

    def extra_checks(self, path: str, files: Sequence[str], level: Level, out: Checked) -> None:
        """Stack-specific checks (required files, sidecars, checksums)."""

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        """Names under the root that prune must keep, with why: pointer targets and the like.
        ``entries`` are (name, status) of this layout's checkpoints under the root."""
        return {}

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"{ckpt_path}", (ckpt_path,))

    # --- checking -------------------------------------------------------------------------

    def check(self, ckpt: Storage, level: Level = "checksums") -> Checked:
        """Every file of the checkpoint at ``level``; problems go in the result, nothing
        raises for them. Each level includes the ones before."""
        out = Checked()
        path = local_dir(ckpt)
        if path is None:
            out.problems.append(Finding(f"{ckpt.url}: only local directories are read for the {self.name} layout",
                                        hint="copy it to a local directory first"))
            return out
        out.step = _step_of_path(self, path)
        try:
            self._check_dir(path, level, out)
        except FileNotFoundError as e:
            out.problems.append(Finding(f"removed while it was being verified ({e.filename})",
                                        hint="another process is deleting it; do not resume from it"))
        except OSError as e:
            raise StorageError(f"{path}: cannot read ({e.strerror or e})",
                               hint="check its permissions and that its filesystem is mounted") from None
        return out

    def _check_dir(self, path: str, level: Level, out: Checked) -> None:
        seen = self.commit_state(path, out.step)
        if seen.status != "committed":
            out.problems.append(Finding(seen.reason or seen.status,
                                        hint="it is not a complete checkpoint; use an older one"))
        single = self.files_are_checkpoints and os.path.isfile(path)
        # The seal (``ckptctl seal``) is ckptctl's sidecar, not one of the stack's files; it is
        # checked against by ``ops.layout_verify``.
        base, files = ((os.path.dirname(path), [os.path.basename(path)]) if single
                       else (path, [f for f in files_below(path) if f != SEAL]))
        out.files = len(files)
        unchecksummed: set[str] = set()
        for rel in files:
            full = os.path.join(base, rel)
            size = safe_load.regular_size(full)
            if size is None:
                out.problems.append(Finding("not a regular file (a symlink, FIFO or device); never followed", file=rel,
                                            hint="the checkpoint layout was altered; treat it as untrusted"))
                continue
            kind = self.kind_of(rel)
            if size == 0 and kind != "other":
                out.problems.append(Finding("0 bytes: the write never finished", file=rel,
                                            hint="the save was cut short (power loss?); use an older checkpoint"))
                continue
            self._check_file(full, rel, kind, level, out, unchecksummed)
        self.extra_checks(path, files, level, out)
        if level != "quick" and unchecksummed:
            out.notes.append(NO_CHECKSUMS.format(what=", ".join(sorted(unchecksummed))))

    def _check_file(self, full: str, rel: str, kind: FileKind, level: Level, out: Checked, unsummed: set[str]) -> None:
        if kind == "pickle":
            if level != "load":
                out.not_loaded.append(f"{rel}: presence and size only (a pickle of a class; never unpickled)")
                return
            not_decoded, structural = safe_load.pickle_file(full, self.name, self.allowed)
            (out.not_loaded if not_decoded else out.structural).append(f"{rel}: {not_decoded or structural}")
            return
        problem: str | None = None
        if kind == "torch":
            problem = _zip_central_directory(full)
            legacy = problem is None and _legacy_torch(full)
            if legacy and level != "quick":
                unsummed.add("legacy (pre-zip) torch.save files")
            elif problem is None and level != "quick":
                problem, n = safe_load.zip_crc(full)
                out.bytes_read += n
            if problem is None and level == "load":
                problem, not_decoded, structural = safe_load.torch_file(full, self.allowed, self.name)
                if not_decoded:
                    out.not_loaded.append(f"{rel}: {not_decoded}")
                elif structural:
                    out.structural.append(f"{rel}: {structural}")
        elif kind == "safetensors":
            problem = safe_load.safetensors_header(full)
            if problem is None and level != "quick":
                unsummed.add("*.safetensors")
            if problem is None and level == "load":
                problem, n = safe_load.safetensors_file(full)
                out.bytes_read += n
        elif kind == "json":
            _doc, problem = safe_load.json_file(full)
        elif kind == "distcp" and level != "quick":
            unsummed.add("*.distcp")  # their records are checked and loaded from .metadata
        if problem is not None:
            out.problems.append(Finding(problem, file=rel))

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


def _zip_central_directory(path: str) -> str | None:
    """A ``torch.save`` archive's layout checks out from its headers (``safe_load.zip_structure``:
    cheap, no data read); a truncated, padded or unreadable archive fails here."""
    return safe_load.zip_structure(path)


def _legacy_torch(path: str) -> bool:
    f = safe_load.open_plain(path)  # never blocks on a FIFO swapped in meanwhile
    if f is None:
        return False
    with f:
        return f.read(2) == b"\x80\x02"  # a bare pickle: torch.save(_use_new_zipfile_serialization=False)


def _step_of_path(layout: StackLayout, path: str) -> int | None:
    m = layout.pattern.match(os.path.basename(os.path.abspath(path)))
    return int(m.group(1)) if m is not None else None
