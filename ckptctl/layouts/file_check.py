"""Checking another tool's checkpoint file by file, at the three levels: the ``check`` of every
``StackLayout``, and what a plugin layout's ``check`` calls (``check_files``, docs/extending.md).

Each file is checked by what it is (``kind_of``): a ``torch.save`` file by its zip directory or
legacy pickles (quick), each record's CRC-32 (checksums) and a test-load with
``torch.load(weights_only=True)`` and the layout's allow-list (load; decoded structurally where
torch refuses it, never unpickled: ``safe_load``); a ``.safetensors`` file by its header, then
read whole; a JSON sidecar through the bounded parser; a pickle of a class by its structural
decode at load; DCP records by DCP's ``.metadata``; anything else as a regular file only. The
layout's commit rule (``examine``) and its own extra checks (``extra``) come first and last.

A sealed checkpoint (``ckptctl seal``: ``.ckptctl-seal.json``) is also checked against its
seal: files added, removed or resized at every level, every byte at ``checksums`` and
``load``, where the seal replaces the tool's weaker checks (the CRC-32 of ``torch.save``
records), so each byte is read once. At ``load`` a seal made by an honest load level (every
file it did not test-load was decoded structurally: ``decoded_when_sealed``) stands for the
test-load: the checkpoint was test-loaded when sealed and not one byte differs since.

What the tool reads on resume (``layout.reads_on_resume``) must pass every check. What is wrong
with any other file (the Trainer's ``training_args.bin``, a model card) goes to
``Checked.unread``: reported, never a reason to call the checkpoint broken. A file that is not
a regular file (a link, a FIFO), or a directory under a file's name (``model.safetensors/``: by
``kind_of``), is a problem wherever it is: the directory was altered.

Every file is read through the checkpoint's ``Storage`` (``storage.stored_file``), so a
check works the same on a local directory and under an ``s3://`` prefix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from ckptctl.errors import NotFound
from ckptctl.format.seal import SEAL, Seal, is_seal_file
from ckptctl.layouts import safe_load
from ckptctl.layouts.checked import ALONE, Checked, Level, Problem, Split, by_one
from ckptctl.layouts.seal_check import check_against_seal, decoded_when_sealed, seal_note, seal_problem
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.storage.stored_file import StoredFile, open_file

if TYPE_CHECKING:
    from ckptctl.layouts.base import Layout

FileKind = Literal["torch", "safetensors", "json", "pickle", "distcp", "other"]
Extra = Callable[[Storage, Sequence[str], Level, Checked], None]

NO_CHECKSUMS = "{what} record no checksums: corruption that still decodes cannot be detected there"
NOT_READ = "not read on resume, so reported only, never a reason to call it broken"


def files_below(ckpt: Storage) -> tuple[list[ObjectInfo], list[str]]:
    """Every file below the checkpoint ``ckpt``, recursively, symlinks included (kind "link")
    but never followed, and every directory; keys relative to ``ckpt``, sorted. Walked one
    directory at a time so that an empty directory is seen too: one under a file's name
    (``model.safetensors/``) stands where the stack reads a file."""
    files: list[ObjectInfo] = []
    dirs: list[str] = []
    todo = [""]
    while todo:
        for info in ckpt.children(todo.pop()):
            if info.kind == "dir":
                dirs.append(info.key)
                todo.append(info.key)
            else:
                files.append(info)
    return sorted(files, key=lambda info: info.key), sorted(dirs)


def name_of(ckpt: Storage) -> str:
    """The checkpoint's directory (or file) name: the last component of its path, whatever
    the path was spelt as (``.``, a trailing slash), or of its URL."""
    path = ckpt.local_path()
    if path is not None:
        return os.path.basename(os.path.abspath(path))
    return ckpt.url.rstrip("/").rsplit("/", 1)[-1]


def kind_by_suffix(rel: str) -> FileKind:
    """What the file ``rel`` is by its suffix (a layout's ``kind_of`` refines it)."""
    if rel.endswith(".safetensors"):
        return "safetensors"
    if rel.endswith(".json"):
        return "json"
    if rel.endswith((".pt", ".pth", ".bin")):
        return "torch"
    if rel.endswith(".distcp"):
        return "distcp"
    return "other"


def sealed_as_another(layout: str, seal: Seal) -> str | None:
    """Why ``seal`` is not the layout ``layout``'s: it was made when the directory read as
    another layout's checkpoint (its files changed since); None when it is this layout's."""
    return None if seal.layout == layout else f"sealed as a {seal.layout} checkpoint, now read as {layout}"


def check_files(layout: "Layout", ckpt: Storage, level: Level, *, kind_of: Callable[[str], FileKind] = kind_by_suffix,
                allowed: Sequence[object] = (), extra: Extra | None = None, split: Split = ALONE) -> Checked:
    """Check the checkpoint ``ckpt`` of ``layout`` (bound to its root) file by file at
    ``level``: its commit rule, each file by ``kind_of``, ``extra`` (the layout's own checks:
    required files, sidecars, checksums) and its seal. ``allowed``: extra globals the test-load
    lets torch build. Under a split one process checks it all and tells the others."""
    return by_one(split, lambda: _checked(layout, ckpt, level, kind_of, allowed, extra))


def _checked(layout: "Layout", ckpt: Storage, level: Level, kind_of: Callable[[str], FileKind],
             allowed: Sequence[object], extra: Extra | None) -> Checked:
    out = Checked(level)
    out.step = layout.step_of(ObjectInfo(name_of(ckpt), 0, 0.0, "file" if layout.files_are_checkpoints else "dir"))
    try:
        _check_sealed(layout, ckpt, level, out, kind_of, allowed, extra)
    except NotFound as e:
        out.problems.append(Problem(f"removed while it was being verified ({e})",
                                    hint="another process is deleting it; do not resume from it"))
    return out


def _check_sealed(layout: "Layout", ckpt: Storage, level: Level, out: Checked, kind_of: Callable[[str], FileKind],
                  allowed: Sequence[object], extra: Extra | None) -> None:
    # A checkpoint that is one file has no directory for a seal.
    seal, bad_seal = (None, None) if layout.files_are_checkpoints else seal_problem(ckpt)
    own_level: Level = level
    if seal is not None and (level == "checksums" or (level == "load" and decoded_when_sealed(seal))):
        own_level = "quick"  # the seal vouches for the bytes; the commit rule and the files still checked
    notes = [f"{layout.name} checkpoint"]
    _check_dir(layout, ckpt, own_level, out, kind_of, allowed, extra)
    if bad_seal is not None:
        out.problems.append(bad_seal)
    if seal is not None:
        mismatch = sealed_as_another(layout.name, seal)
        if mismatch is not None:
            out.problems.append(Problem(mismatch, file=SEAL, hint="the directory changed after sealing; do not trust it"))
        found, n = check_against_seal(ckpt, seal, "quick" if level == "quick" else "checksums")
        for p in found:
            _found(layout, out, p.file or "", p)
        out.bytes_read += n
        out.notes.append(seal_note(seal, "quick" if level == "quick" else "checksums"))
        if own_level == "quick" and level == "load":
            out.notes.append("test-loaded when sealed; the seal's checksums stand for the load level")
    if out.structural:
        out.notes.append(f"{len(out.structural)} decoded structurally only: " + "; ".join(out.structural))
    if out.not_loaded and own_level == "load":
        # What the load level could not decode is not verified at that level: never an anchor,
        # never `latest --level load`'s answer, never sealed as test-loaded.
        out.problems.append(Problem(
            f"unverified at load ({len(out.not_loaded)} records not decoded: " + "; ".join(out.not_loaded) + ")",
            hint="ckptctl never unpickles a checkpoint's records; use a checkpoint that decodes, "
                 "or verify at the default level (checksums) if that is enough for you"))
    elif out.not_loaded:
        out.notes.append(f"{len(out.not_loaded)} file(s) not test-loaded: " + "; ".join(out.not_loaded))
    if out.unread:
        out.notes.append(f"{len(out.unread)} in files the stack does not read on resume ({NOT_READ}): "
                         + "; ".join(out.unread))
    out.notes[:0] = notes


def directory_problem(rel: str) -> Problem:
    """A directory under the name of a file the stack writes (``model.safetensors/``): its
    resume fails on it, or skips it as it skips a missing file (the Trainer's ``optimizer.pt``),
    so it is a problem wherever it is, as a link is."""
    return Problem("is a directory, expected a file", file=rel,
                   hint="the checkpoint layout was altered; treat it as untrusted")


def _found(layout: "Layout", out: Checked, rel: str, problem: Problem) -> None:
    """A problem of the file ``rel``: the checkpoint's when the stack reads it on resume."""
    if rel and not layout.reads_on_resume(rel):
        out.unread.append(str(problem))
    else:
        out.problems.append(problem)


def _check_dir(layout: "Layout", ckpt: Storage, level: Level, out: Checked, kind_of: Callable[[str], FileKind],
               allowed: Sequence[object], extra: Extra | None) -> None:
    seen = layout.examine(ckpt)
    if seen.status != "committed":
        out.problems.append(Problem(seen.reason or seen.status, hint="it is not a complete checkpoint; use an older one"))
    # The seal is ckptctl's sidecar, not one of the stack's files. A checkpoint that is one file is key "".
    listed, dirs = ([ObjectInfo("", 0, 0.0)], []) if layout.files_are_checkpoints else files_below(ckpt)
    listed = [f for f in listed if not is_seal_file(f.key)]
    out.problems += [directory_problem(rel) for rel in dirs if kind_of(rel) != "other"]
    files = [f.key for f in listed]
    out.files = len(files)
    unchecksummed: set[str] = set()
    for info in listed:
        rel = info.key
        # Opened once for every check of this file: on object storage each open is a request.
        f = open_file(ckpt, rel) if info.kind == "file" else None
        if f is None:
            out.problems.append(Problem("not a regular file (a symlink, FIFO or device); never followed", file=rel,
                                        hint="the checkpoint layout was altered; treat it as untrusted"))
            continue
        with f:
            kind = kind_of(rel)
            shown = rel or name_of(ckpt)
            if f.size == 0 and kind != "other":
                _found(layout, out, rel, Problem("0 bytes: the write never finished", file=shown,
                                                 hint="the save was cut short (power loss?); use an older checkpoint"))
                continue
            _check_file(layout, f, rel, shown, kind, level, allowed, out, unchecksummed)
    if extra is not None:
        extra(ckpt, files, level, out)
    if level != "quick" and unchecksummed:
        out.notes.append(NO_CHECKSUMS.format(what=", ".join(sorted(unchecksummed))))
        out.unsummed = sorted(unchecksummed)


def _check_file(layout: "Layout", f: StoredFile, rel: str, shown: str, kind: FileKind, level: Level,
                allowed: Sequence[object], out: Checked, unsummed: set[str]) -> None:
    """The checks of one open file at ``level``; ``shown`` names it in the report."""
    read = not rel or layout.reads_on_resume(rel)
    not_decoded = structural = problem = None
    if kind == "pickle":
        if level != "load":
            out.not_loaded.append(f"{shown}: presence and size only (a pickle of a class; never unpickled)")
            return
        not_decoded, structural = safe_load.pickle_file_of(f)
    elif kind == "torch":
        problem = safe_load.zip_structure_of(f)
        legacy = problem is None and safe_load.is_legacy(f)
        if legacy and level != "quick":
            unsummed.add("legacy (pre-zip) torch.save files")
        elif problem is None and level != "quick":
            problem, n = safe_load.zip_crc_of(f)
            out.bytes_read += n
        if problem is None and level == "load":
            problem, not_decoded, structural = safe_load.torch_file_of(f, allowed)
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
    if structural is not None:
        out.structural.append(f"{shown}: {structural}")
    if not_decoded is not None:
        (out.not_loaded if read else out.unread).append(f"{shown}: {not_decoded}")
    if problem is not None:
        _found(layout, out, rel, Problem(problem, file=shown))
