"""The verbs that judge checkpoints, by path or URL, as the CLI names them: ``verify`` (one
checkpoint, a root's ``--latest`` or ``--all``, a step across tiers' roots with ``--tier``),
``latest`` and ``repoint``. Each opens the storage, says what the path is (``ops.targets``) and
calls the engine of ``ops.verify`` (``ops.repoint`` for the pointers); ``ops.verbs`` holds the
other verbs by path.

May import: ``ops.verify``, ``ops.repoint``, ``ops.listing``, ``ops.targets``, ``ops.rollcall``,
``ops.torchrun``, ``layouts``, ``storage`` and the leaves; the verbs that import torch or walk a
whole root are imported when called (``ckptctl latest`` starts without torch).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Literal, Sequence

from ckptctl.errors import UsageError
from ckptctl.layouts.checked import LEVELS, Level
from ckptctl.ops.targets import one_checkpoint, open_root
from ckptctl.progress import Progress
from ckptctl.storage import Storage

if TYPE_CHECKING:  # only for annotations
    from ckptctl.ops.repoint import PointerCheck, RepointResult
    from ckptctl.ops.verify.latest import Latest
    from ckptctl.ops.verify.report import VerifyReport
    from ckptctl.ops.verify.whole import WholeOutcome


@dataclass
class VerifyOutcome:
    """The reports of one ``verify`` run and whether it passed as a whole: for ``latest``, the
    first report (the newest checkpoint: one that fails fails the run, even when an older one
    verifies) and the pointers; otherwise all of them."""

    ok: bool
    level: str
    reports: list["VerifyReport"]
    note: str | None = None  # what the format could not check (another tool's checkpoint)
    # ``latest``: what each stack's pointer (DeepSpeed ``latest``, Megatron's tracker) names
    # and whether it verifies: what the stack's default resume would load.
    pointers: "list[PointerCheck]" = field(default_factory=list)
    exports: list[dict] = field(default_factory=list)  # ``latest``: model-only exports skipped
    # ``latest``: when the newest checkpoint failed, what a resume would take instead (a sentence)
    fallback: str | None = None

    def to_dict(self) -> dict:
        doc = {"ok": self.ok, "level": self.level, "checkpoints": [r.to_dict() for r in self.reports]}
        if self.fallback is not None:
            doc["fallback"] = self.fallback
        if self.exports:
            doc["skipped_exports"] = self.exports
        if self.pointers:
            doc["pointers"] = [p.to_dict() for p in self.pointers]
        return doc


def verify_path(path: str, level: str = "checksums", *, which: Literal["one", "latest", "all"] = "one",
                progress: Progress | None = None, any_: bool = False) -> VerifyOutcome:
    """Verify the checkpoint at ``path`` (``one``), or the checkpoints of the root at ``path``:
    newest first until one passes (``latest``: the reports in that order), or all of them
    (``all``: the reports oldest first, newest last, the order ``ls`` lists them in)."""
    from ckptctl.ops.rollcall import Command, resolved
    from ckptctl.ops.torchrun import torchrun_job

    if level not in LEVELS:
        raise UsageError(f"--level {level!r} is not one of {', '.join(LEVELS)}", hint="use --level checksums")
    # Under torchrun every rank runs the same walk; each checkpoint's files are split over the
    # ranks (``ops.verify.engine``) and every rank gets the whole report, so every rank
    # makes the same decisions and exits with the same status.
    with torchrun_job(Command("verify", {"path": resolved(path), "level": level, "which": which, "any": str(any_)})):
        return _verify_path(path, level, which, progress, any_)  # type: ignore[arg-type]


def _verify_path(path: str, level: Level, which: Literal["one", "latest", "all"], progress: Progress | None,
                 any_: bool) -> VerifyOutcome:
    from ckptctl.ops.verify.latest import verify_root

    if which != "one":
        root = open_root(path)
        exports: list = []  # model-only exports --latest passed over (unless any_)
        with _one_level_off(root, path, f"ckptctl verify {{}} --{which}"):
            reports = verify_root(root, which=which, level=level, progress=progress, any_=any_, exports=exports)
        if which == "latest":
            outcome = _with_pointers(root, level, reports, progress)
            outcome.exports = [e.to_dict() for e in exports]
            outcome.note = "; ".join(str(e) for e in exports) or None
            return outcome
        return VerifyOutcome(all(r.ok for r in reports), level, reports[::-1])
    from ckptctl.ops.verify.engine import verify

    found = one_checkpoint(path, verb="verify")  # one checkpoint of a layout (as under a root) or a file
    report = verify(found.storage, found.handler, level, progress)
    return VerifyOutcome(report.ok, level, [report], report.note)


def verify_tiers(paths: Sequence[str], level: str = "checksums", *, which: Literal["latest", "all"] = "latest",
                 progress: Progress | None = None) -> "WholeOutcome":
    """``ops.verify.whole.verify_whole`` over the roots at ``paths``: every node's root of a
    node-local tier, and any tier the job promotes to."""
    from ckptctl.ops.verify.whole import verify_whole

    if level not in LEVELS:
        raise UsageError(f"--level {level!r} is not one of {', '.join(LEVELS)}", hint="use --level checksums")
    if len(set(paths)) != len(paths):
        raise UsageError(f"a root is named twice: {', '.join(paths)}", hint="give each root once")
    return verify_whole([open_root(p) for p in paths], which=which, level=level, progress=progress)  # type: ignore[arg-type]


def _with_pointers(root: Storage, level: str, reports: "list[VerifyReport]", progress: Progress | None) -> VerifyOutcome:
    """``verify --latest``: the newest checkpoint that verifies, and what each stack's pointer
    names, which is what that stack's default resume loads: a pointer whose target does not
    verify fails the run, whatever else verified."""
    from ckptctl.ops.repoint import check_pointers

    # The newest committed resumable checkpoint must verify: an older one that does is what a
    # resume falls back to, named in the note, but a launcher testing the exit code must learn
    # that its newest save is bad (whatever the layout, pointer or not).
    walk_ok = reports[0].ok
    known = {r.url: r for r in reports}
    pointers = check_pointers(root, level, progress=progress, known=known)  # type: ignore[arg-type]
    for p in pointers:  # the target's report joins the others (once), so every verdict is shown
        if p.report is not None and all(r.url != p.report.url for r in reports):
            reports.append(p.report)
    return VerifyOutcome(walk_ok and all(p.ok for p in pointers), level, reports, pointers=pointers,
                         fallback=None if walk_ok else _fallback(reports))


def _fallback(walked: "list[VerifyReport]") -> str:
    """What ``verify --latest`` says when the newest checkpoint failed: which one a resume by
    ``ckptctl latest`` (and ``load_latest``) would take instead, if any."""
    newest, good = walked[0], next((r for r in walked if r.ok), None)
    if good is None:
        return f"the newest checkpoint {newest.url} does not verify, and no older one does: nothing to resume from"
    return (f"the newest checkpoint {newest.url} does not verify; `ckptctl latest` would resume {good.url} "
            f"({good.label}), the newest that does")


def repoint_root(root: str, level: str = "checksums", formats: Sequence[str] | None = None, *,
                 dry_run: bool = False, progress: Progress | None = None) -> "RepointResult":
    """``ops.repoint.repoint`` of the root at ``root``."""
    from ckptctl.ops.repoint import repoint

    if level not in LEVELS:
        raise UsageError(f"--level {level!r} is not one of {', '.join(LEVELS)}", hint="use --level checksums")
    return repoint(open_root(root), level, formats=formats, dry_run=dry_run, progress=progress)  # type: ignore[arg-type]


def latest_for(root: str, level: str = "checksums", formats: Sequence[str] | None = None,
               progress: Progress | None = None, *, any_: bool = False) -> "Latest":
    """``ops.verify.latest.latest_checkpoint`` of the root at ``root``: the newest complete
    checkpoint of any layout (or of ``formats``) that verifies, and what its stack's resume
    option takes."""
    from ckptctl.ops.verify.latest import latest_checkpoint

    if level not in LEVELS:
        raise UsageError(f"--level {level!r} is not one of {', '.join(LEVELS)}", hint="use --level checksums")
    st = open_root(root)
    with _one_level_off(st, root, "ckptctl latest {}"):
        return latest_checkpoint(st, level, formats=formats, progress=progress, any_=any_)  # type: ignore[arg-type]


@contextmanager
def _one_level_off(root: Storage, path: str, command: str) -> Iterator[None]:
    """A root-level verb that found nothing valid at ``path``: when the path lists no
    checkpoint and is one checkpoint, or the parent of a root, the UsageError that says so and
    names the path to give (``command`` formatted with it), as ``ls`` hints. (Listed again on
    this failure only: the answer that succeeds costs nothing more.)"""
    from ckptctl.errors import NoValidCheckpoint
    from ckptctl.layouts.catalog import list_checkpoints
    from ckptctl.ops.listing import wrong_level_error

    try:
        yield
    except NoValidCheckpoint as e:
        wrong = wrong_level_error(root, path, command) if not list_checkpoints(root) else None
        if wrong is not None:
            raise wrong from e
        raise


__all__ = ["VerifyOutcome", "latest_for", "repoint_root", "verify_path", "verify_tiers"]
