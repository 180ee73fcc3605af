"""``verify`` and ``latest`` for every layout the catalog knows: checkpoints whose layout is
``verified_by_manifest`` (ckptctl's own) go to ``ops.verify.checkpoint.verify_checkpoint``; other tools'
(torchtitan/DCP, Hugging Face Trainer, Megatron-LM, DeepSpeed) to their layout's ``check``
(``layouts.stack``), at the same three levels: quick (the stack's commit rule, every file
present, regular, non-empty, headers and sizes), checksums (+ the checksums that exist: CRC-32
of every ``torch.save`` record, Megatron ``integrity.json``), load (+ every file test-loaded
without unpickling anything).

``verify_root(root, which=...)`` verifies a root's checkpoints of every layout (``verify --latest``
and ``--all``); ``latest_checkpoint(root, level, formats=...)`` is the pre-resume check for every stack: the
newest complete checkpoint that verifies, by the stack's own rule and pointer, with what that
stack's resume option takes.

Both consider resumable checkpoints only (``any_`` for every one): a model-only export (its
layout's ``kind_of_checkpoint``: torchtitan's model-only last step, the Trainer's
``save_only_model``, Lightning's ``save_weights_only``, ckptctl's own without an optimizer)
would make the stack's resume fail or restart its optimizer, so it is skipped, and said so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence, cast

from ckptctl.errors import NoValidCheckpoint, UsageError
from ckptctl.layouts.base import NOT_TOLD, Checkpoint, CheckpointKind, Layout, kind_of_checkpoint
from ckptctl.layouts.catalog import FORMATS, layout_named, layouts_named, newest_marked
from ckptctl.layouts.classify import checkpoint_below
from ckptctl.layouts.stack import Resume, StackLayout
from ckptctl.format.seal import SEAL, Seal
from ckptctl.layouts.safe_load import STRUCTURAL_MARK
from ckptctl.ops.distributed import current, on_root
from ckptctl.ops.verify.problem import Problem
from ckptctl.ops.seal.check import SealLevel, check_against_seal, seal_note, seal_problem
from ckptctl.ops.verify.checkpoint import Level, VerifyReport, verify_checkpoint
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage


def verify_stack(ckpt: Storage, layout: StackLayout, level: Level = "checksums", *,
                 trust_seal: bool = False) -> VerifyReport:
    """``verify_stack_detail`` without the list of files not test-loaded."""
    return verify_stack_detail(ckpt, layout, level, trust_seal=trust_seal)[0]


def verify_stack_detail(ckpt: Storage, layout: StackLayout, level: Level = "checksums", *,
                        trust_seal: bool = False) -> tuple[VerifyReport, list[str]]:
    """Check one checkpoint of another tool's layout (``layout`` bound to its root); problems go
    in the report, nothing raises for them. The note says what could not be checked and which
    files were not test-loaded (and why); so does the returned list, one entry per file.

    A sealed checkpoint (``ckptctl seal``: ``.ckptctl-seal.json``) is also checked against its
    seal: files added, removed or resized at every level, every byte at ``checksums`` and
    ``load``. At ``checksums`` the seal replaces the stack's own weaker checks (the CRC-32 of
    ``torch.save`` records), so each byte is read once. With ``trust_seal`` (prune's anchor) a
    seal that matches stands for ``load`` too: the checkpoint was test-loaded when sealed and
    not one byte differs since."""
    t0 = time.perf_counter()
    seal, bad_seal = (None, None) if _single_file(ckpt, layout) else seal_problem(ckpt)
    stack_level: Level = level
    if seal is not None and (level == "checksums" or (trust_seal and level == "load" and decoded_when_sealed(seal))):
        stack_level = "quick"  # the seal vouches for the bytes; the stack's rule and files still checked
    checked = layout.check(ckpt, stack_level)
    report = VerifyReport(ckpt.url, level, step=checked.step, files=checked.files, bytes_read=checked.bytes_read)
    report.problems = [Problem(f.message, file=f.file, hint=f.hint) for f in checked.problems]
    notes = [f"{layout.name} checkpoint"] + checked.notes
    if bad_seal is not None:
        report.problems.append(bad_seal)
    if seal is not None:
        seal_level: SealLevel = "quick" if level == "quick" else "checksums"
        mismatch = layout.sealed_as_another(seal)
        if mismatch is not None:
            report.problems.append(Problem(mismatch, file=SEAL, hint="the directory changed after sealing; do not trust it"))
        found, n = check_against_seal(ckpt, seal, seal_level)
        report.problems.extend(found)
        report.bytes_read += n
        notes.append(seal_note(seal, seal_level))
        if stack_level == "quick" and level == "load":
            notes.append("test-loaded when sealed; the seal's checksums stand for the load level")
    if checked.structural:
        notes.append(f"{len(checked.structural)} decoded structurally only: " + "; ".join(checked.structural))
    if checked.not_loaded and stack_level == "load":
        # What the load level could not decode is not verified at that level: never an anchor,
        # never `latest --level load`'s answer, never sealed as test-loaded.
        report.problems.append(Problem(
            f"unverified at load ({len(checked.not_loaded)} records not decoded: " + "; ".join(checked.not_loaded) + ")",
            hint="ckptctl never unpickles a class outside its allow-list; use a checkpoint that decodes, "
                 "or verify at the default level (checksums) if that is enough for you"))
    elif checked.not_loaded:
        notes.append(f"{len(checked.not_loaded)} file(s) not test-loaded: " + "; ".join(checked.not_loaded))
    report.note = "; ".join(notes)
    report.seconds = time.perf_counter() - t0
    return report, list(checked.structural) + list(checked.not_loaded)


def decoded_when_sealed(seal: Seal) -> bool:
    """Whether the seal was made by an honest load level: every file it lists as not
    test-loaded was decoded structurally. An older seal may list files nothing decoded
    ("presence and size only", "not test-loaded"): its checksums then do not stand for load."""
    return all(STRUCTURAL_MARK in entry for entry in seal.not_loaded)


def _single_file(ckpt: Storage, layout: StackLayout) -> bool:
    """A checkpoint that is one file (Lightning's ``*.ckpt``): it has no directory for a seal."""
    return layout.files_are_checkpoints


def verify_in_layout(ckpt: Storage, layout: Layout, level: Level = "checksums",
                     progress: Progress | None = None) -> VerifyReport:
    """Verify the checkpoint ``ckpt`` by the rules of ``layout`` (bound to its root): the one
    engine for a checkpoint named alone (``layouts.classify``) and one listed under a root."""
    if layout.verified_by_manifest:
        return verify_checkpoint(ckpt, level, progress)  # under torchrun: split over the ranks
    # Another tool's checkpoint has no manifest to split by: rank 0 of a torchrun job checks it
    # and tells the others (each reading it all would only multiply the reads).
    return on_root(current(), lambda: verify_stack(ckpt, cast(StackLayout, layout), level))


def verify_entry(entry: Checkpoint, root: Storage, level: Level = "checksums",
                 progress: Progress | None = None) -> VerifyReport:
    """Verify one catalog entry of ``root`` by its own layout's rules."""
    assert entry.storage is not None, "a symlink is never verified"
    return verify_in_layout(entry.storage, layout_named(entry.layout, root), level, progress)


@dataclass(frozen=True)
class SkippedExport:
    """A checkpoint ``latest`` / ``verify --latest`` passed over: a model-only export."""

    url: str
    step: int
    layout: str
    reason: str  # what its layout saw (the file or key that shows it holds the weights only)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def __str__(self) -> str:
        return f"skipped {self.url}: an export, not resumable ({self.reason}); --any counts it"


def entry_kind(entry: Checkpoint, root: Storage) -> CheckpointKind:
    """Whether the catalog entry ``entry`` of ``root`` is resumable or an export, by its layout."""
    if entry.storage is None or entry.status != "committed":
        return NOT_TOLD  # a link, or nothing committed: verify says what it is
    return kind_of_checkpoint(layout_named(entry.layout, root), entry.storage, entry.manifest)


def _export(entry: Checkpoint, root: Storage) -> SkippedExport | None:
    kind = entry_kind(entry, root)
    return None if kind.resumable else SkippedExport(entry.url, entry.step, entry.layout, kind.reason)


def _none_resumable(root: Storage, what: str, exports: Sequence[SkippedExport], verb: str) -> NoValidCheckpoint:
    return NoValidCheckpoint(
        f"{root.url}: no resumable {what}: {len(exports)} model-only export(s) skipped, the newest "
        f"{exports[0].url} ({exports[0].reason})",
        hint=f"an export resumes the weights only (the optimizer restarts); to take one anyway: `ckptctl {verb} --any`")


def verify_root(root: Storage, *, which: Literal["latest", "all"], level: Level = "checksums",
                progress: Progress | None = None, any_: bool = False,
                exports: list[SkippedExport] | None = None) -> list[VerifyReport]:
    """Every checkpoint that claims to be committed, newest first (``all``), or newest first
    until one verifies (``latest``: the reports of the newer ones that failed come first), each
    by its own layout's rules. Directories without their layout's commit mark are not
    checkpoints yet and are skipped. ``latest`` also skips model-only exports unless ``any_``,
    appending each to ``exports``."""
    reports = []
    skipped: list[SkippedExport] = []
    for entry in newest_marked(root):  # lazily: --latest stops at the first that verifies
        assert entry.storage is not None  # a directory: symlinks are never listed as marked
        export = _export(entry, root) if which == "latest" and not any_ else None
        if export is not None:
            skipped.append(export)
            continue
        rep = verify_entry(entry, root, level, progress)
        reports.append(rep)
        if which == "latest" and rep.ok:
            break
    if exports is not None:
        exports.extend(skipped)
    if not reports and skipped:
        raise _none_resumable(root, "checkpoint", skipped, "verify ROOT --latest")
    if not reports:
        raise NoValidCheckpoint(f"{root.url}: no committed checkpoint", hint="nothing has been saved here yet, or every save failed")
    return reports


def bound_layout(name: str, root: Storage) -> StackLayout:
    """The stack layout called ``name``, bound to ``root`` (its pointer file read)."""
    for layout in layouts_named([name]):
        bound = layout.for_root(root)
        # Callers ask its ``check``; a checkpoint verified by its manifest has none (verify_entry).
        assert not bound.verified_by_manifest, f"{name} checkpoints are verified by their manifest"
        return cast(StackLayout, bound)
    raise KeyError(name)


@dataclass
class Latest:
    """The newest checkpoint that verifies, what its stack's resume option takes, and the
    reports of newer ones that did not verify."""

    report: VerifyReport
    layout: str
    step: int
    resume: Resume
    skipped: list[VerifyReport] = field(default_factory=list)
    kind: CheckpointKind = NOT_TOLD  # resumable, or (with ``any_``) possibly an export
    exports: list[SkippedExport] = field(default_factory=list)  # newer exports passed over

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.report.url, "step": self.step, "format": self.layout, "level": self.report.level,
                "resume": self.resume.to_dict(), "note": self.report.note,
                "skipped": [r.to_dict() for r in self.skipped], **self.kind.to_dict(),
                "skipped_exports": [e.to_dict() for e in self.exports]}


def latest_checkpoint(root: Storage, level: Level = "checksums", *, formats: Sequence[str] | None = None,
                      progress: Progress | None = None, any_: bool = False) -> Latest:
    """The newest complete resumable checkpoint under ``root`` that verifies at ``level``, of
    any known layout or only of ``formats`` (``any_``: exports count too). Raises
    NoValidCheckpoint when none verifies and UsageError for an unknown format."""
    try:
        layouts: Sequence[Layout] = layouts_named(formats)
    except ValueError as e:
        raise UsageError(f"--format: {e}", hint=f"use one of {', '.join(FORMATS)}") from None
    skipped: list[VerifyReport] = []
    exports: list[SkippedExport] = []
    for entry in newest_marked(root, layouts=layouts):
        assert entry.storage is not None
        kind = entry_kind(entry, root)  # names and headers only: before any data is read
        if not kind.resumable and not any_:
            exports.append(SkippedExport(entry.url, entry.step, entry.layout, kind.reason))
            continue
        report = verify_entry(entry, root, level, progress)
        if not report.ok:
            skipped.append(report)
            continue
        resume = layout_named(entry.layout, root).resume(entry.url, entry.step)
        return Latest(report, entry.layout, entry.step, resume, skipped, kind, exports)
    what = "committed checkpoint" if formats is None else f"complete {'/'.join(formats)} checkpoint"
    if exports and not skipped:
        raise _none_resumable(root, what, exports, "latest ROOT")
    if skipped:
        also = f" ({len(exports)} model-only export(s) skipped too; --any counts them)" if exports else ""
        raise NoValidCheckpoint(f"{root.url}: none of {len(skipped)} {what}s verifies{also}",
                                hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
    raise NoValidCheckpoint(f"{root.url}: no {what}", hint="nothing has been saved here yet, or every save failed")


def stack_checkpoint_at(path: str) -> tuple[StackLayout, Storage] | None:
    """When ``path`` (a local path or a URL) is one checkpoint of another stack's layout,
    recognised by its name under its root (``layouts.classify``), that layout bound to the
    root and the checkpoint's storage; None otherwise (ckptctl's own, a file format, a DCP
    directory named alone, nothing). For the callers that take this pair (seal, ls hints)."""
    found = checkpoint_below(path)
    if found is None or found.verified_by_manifest:
        return None
    return cast(StackLayout, found.in_layout), found.storage
