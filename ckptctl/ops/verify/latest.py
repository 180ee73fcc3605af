"""``verify ROOT --latest/--all`` and ``latest``, for every layout the catalog knows: each
checkpoint by its own layout's ``check`` (``ops.verify.engine``), at the same three levels.

``verify_root(root, which=...)`` verifies a root's checkpoints of every layout (``verify --latest``
and ``--all``); ``latest_checkpoint(root, level, formats=...)`` is the pre-resume check for every
stack: the newest complete checkpoint that verifies, by the stack's own rule and pointer, with
what that stack's resume option takes.

Both consider resumable checkpoints only (``any_`` for every one): a model-only export (its
layout's ``kind_of_checkpoint``: torchtitan's model-only last step, the Trainer's
``save_only_model``, Lightning's ``save_weights_only``, ckptctl's own without an optimizer)
would make the stack's resume fail or restart its optimizer, so it is skipped, and said so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

from ckptctl.errors import NoValidCheckpoint, UsageError
from ckptctl.layouts.base import NOT_TOLD, Checkpoint, CheckpointKind, Layout, Resume, kind_of_checkpoint
from ckptctl.layouts.catalog import FORMATS, layouts_named, newest_marked
from ckptctl.layouts.checked import Level
from ckptctl.ops.verify.engine import verify_entry
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage


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


def entry_kind(entry: Checkpoint) -> CheckpointKind:
    """Whether the catalog entry ``entry`` is resumable or an export, by its layout."""
    if entry.storage is None or entry.owner is None or entry.status != "committed":
        return NOT_TOLD  # a link, or nothing committed: verify says what it is
    return kind_of_checkpoint(entry.owner, entry.storage, entry.manifest)


def _export(entry: Checkpoint) -> SkippedExport | None:
    kind = entry_kind(entry)
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
        export = _export(entry) if which == "latest" and not any_ else None
        if export is not None:
            skipped.append(export)
            continue
        rep = verify_entry(entry, level, progress)
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
        return {"url": self.report.url, "step": self.step, "numbered_by": self.report.numbered_by,
                "format": self.layout, "level": self.report.level,
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
        kind = entry_kind(entry)  # names and headers only: before any data is read
        if not kind.resumable and not any_:
            exports.append(SkippedExport(entry.url, entry.step, entry.layout, kind.reason))
            continue
        report = verify_entry(entry, level, progress)
        if not report.ok:
            skipped.append(report)
            continue
        assert entry.owner is not None
        resume = entry.owner.resume(entry.url, entry.step)
        return Latest(report, entry.layout, entry.step, resume, skipped, kind, exports)
    what = "committed checkpoint" if formats is None else f"complete {'/'.join(formats)} checkpoint"
    if exports and not skipped:
        raise _none_resumable(root, what, exports, "latest ROOT")
    if skipped:
        also = f" ({len(exports)} model-only export(s) skipped too; --any counts them)" if exports else ""
        raise NoValidCheckpoint(f"{root.url}: none of {len(skipped)} {what}s verifies{also}",
                                hint="run `ckptctl verify ROOT --all` to see what is wrong with each")
    raise NoValidCheckpoint(f"{root.url}: no {what}", hint="nothing has been saved here yet, or every save failed")
