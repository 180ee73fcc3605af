"""``seal``: give another tool's checkpoint the checksums it never had.

A checkpoint of the Hugging Face Trainer, torchtitan/DCP, Megatron-LM, DeepSpeed or any other
layout that seals (``seal_note`` None) is checked by its layout's commit rule and test-loaded
fully once (the ``load`` level of ``verify``, the one engine: every file the stack reads on
resume loaded with ``torch.load(weights_only=True)`` and the layout's allow-list, nothing
unpickled; what torch refuses decoded structurally and listed in the seal's ``not_loaded``, and
a checkpoint with anything not decoded refused), then every file is hashed (XXH3-64, and per
64 MiB chunk for larger files) and the sidecar ``.ckptctl-seal.json`` (``format.seal``) is created with
write-if-absent semantics: an existing seal is never replaced, a concurrent sealer cannot
clobber another's seal, and the checkpoint's own files are never modified.

The files are listed before the test-load and again after hashing: a checkpoint that changed
meanwhile (a save still writing, a rotation deleting) is refused rather than sealed with bytes
that were never test-loaded. ckptctl's own checkpoints carry checksums in their manifest and
need no seal (a no-op that says so); an incomplete or corrupt checkpoint is refused.

The seal records the checkpoint's commit time (``commit_time``): the catalog reads a sealed
checkpoint's age from it, so sealing a root never changes what an age or calendar rule keeps.

The same sidecar is written by ``ckptctl.integrations`` inside a stack's own save, from
checksums taken as the files were written (``seal_as_written``: DCP's writer) or read back as
each was closed (``seal_just_written``: the Trainer, accelerate); nothing is test-loaded there, and the
seal says so (``test_loaded: "written"``), so prune test-loads such a checkpoint itself.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Sequence

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.format.seal import CHUNK_SIZE, SEAL, Seal, SealedFile, encode_seal
from ckptctl.layouts.base import Layout
from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.layouts.classify import classify
from ckptctl.layouts.seal_check import hash_object, is_temporary, read_seal
from ckptctl.ops.seal.leftovers import remove_temporaries
from ckptctl.ops.verify.engine import verify
from ckptctl.ops.verify.report import VerifyReport
from ckptctl.progress import Progress
from ckptctl.storage.base import ObjectInfo, Storage
from ckptctl.version import tool_info

SealStatus = Literal["sealed", "already sealed", "not needed", "skipped", "failed"]
# A file's seal entry (key, chunk size) taken during its save, or None: read it back.
Written = Callable[[str, int], SealedFile | None]
WRITTEN = "written"  # ``test_loaded`` of a seal whose checksums were taken as the files were written
WRITTEN_NOTE = "every file: checksums taken as it was written, not test-loaded"


@dataclass
class SealResult:
    """What ``seal`` did with one checkpoint."""

    url: str
    name: str
    layout: str
    step: int | None
    status: SealStatus
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None  # why skipped or failed
    not_loaded: list[str] = field(default_factory=list)  # files the seal covers but nobody test-loaded

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SealOutcome:
    """The results of one ``seal`` run (one checkpoint, or every checkpoint of a root)."""

    target: str
    results: list[SealResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(r.status == "failed" for r in self.results)

    def to_dict(self) -> dict[str, object]:
        return {"target": self.target, "ok": self.ok, "checkpoints": [r.to_dict() for r in self.results]}


def _snapshot(ckpt: Storage) -> tuple[tuple[str, int, float, str], ...]:
    return tuple(sorted((i.key, i.size, i.mtime, i.kind) for i in ckpt.list() if i.key != SEAL))


def commit_time(snapshot: tuple[tuple[str, int, float, str], ...]) -> float:
    """The checkpoint's own commit time as ``ls`` and ``prune`` read it before sealing: the
    newest modification among its files (the stacks write their commit file last). The seal
    records it so that its own file, written now, never makes the checkpoint younger."""
    return max((mtime for key, _size, mtime, kind in snapshot if key != SEAL and not is_temporary(key)), default=0.0)


def unsealed(layout: Layout) -> SealStatus:
    """What ``seal`` says of a checkpoint of a layout it leaves alone (its ``seal_note``):
    "skipped" for one that is a file (no directory for a seal), else "not needed" (its own
    checksums cover every byte)."""
    return "skipped" if layout.files_are_checkpoints else "not needed"


def write_seal(ckpt: Storage, layout: Layout, report: VerifyReport, *,
               progress: Progress | None = None,
               expected: tuple[tuple[str, int, float, str], ...] | None = None,
               chunk_size: int = CHUNK_SIZE) -> SealResult:
    """Hash every file of ``ckpt`` and create its seal, given a passing ``load``-level
    ``report`` of it (``seal_checkpoint``, or prune's anchor verification), whose ``untested``
    files the seal lists as such. ``expected`` is the listing the report was made on: a
    checkpoint that differs from it now is refused (InvalidCheckpoint). Returns status
    "already sealed" when a seal appeared meanwhile."""
    t0 = time.perf_counter()
    name = ckpt.url.rstrip("/").rsplit("/", 1)[-1]
    assert report.ok and report.level == "load", "only a checkpoint that test-loaded is sealed"
    # ``untested`` holds only files decoded structurally: the load level fails on the others.
    not_loaded = list(report.untested)
    before = _snapshot(ckpt) if expected is None else expected
    files = hash_listing(ckpt, before, chunk_size, progress)
    if _snapshot(ckpt) != before:
        raise InvalidCheckpoint(f"{ckpt.url}: changed while it was being sealed; not sealed",
                                hint="a save or a rotation is still at work on it; seal it once it is finished")
    now = time.time()
    seal = Seal(layout=layout.name, name=name, step=report.step, created=now, tool=tool_info(),
                files=tuple(files), chunk_size=chunk_size, test_loaded="load", not_loaded=tuple(not_loaded),
                committed=min(now, commit_time(before)))
    result = SealResult(ckpt.url, name, layout.name, report.step, "sealed", files=len(files),
                        bytes=seal.total_bytes, not_loaded=not_loaded)
    if not ckpt.write_if_absent(SEAL, encode_seal(seal)):
        result.status, result.reason = "already sealed", "another run sealed it meanwhile; its seal was kept"
    result.seconds = time.perf_counter() - t0
    return result


def hash_listing(ckpt: Storage, listing: tuple[tuple[str, int, float, str], ...], chunk_size: int = CHUNK_SIZE,
                 progress: Progress | None = None, written: Written | None = None) -> list[SealedFile]:
    """The seal's entry of every file of ``listing`` (``_snapshot``): the one ``written`` gives
    for it (taken during its save), else hashed from one read. Raises InvalidCheckpoint for a
    leftover temporary or anything but a regular file: never vouched for."""
    files: list[SealedFile] = []
    for key, _size, _mtime, kind in listing:
        if is_temporary(key):  # never vouched for: it is not one of the checkpoint's files
            raise InvalidCheckpoint(f"{ckpt.url_of(key)}: a temporary an interrupted ckptctl write left; not sealed",
                                    hint=f"run `ckptctl seal {ckpt.url}`: it removes the leftover first")
        if kind != "file":
            raise InvalidCheckpoint(f"{ckpt.url_of(key)}: a {kind}, not a regular file; not sealed",
                                    hint="the checkpoint layout was altered; treat it as untrusted")
        entry = written(key, chunk_size) if written is not None else None
        if entry is not None:
            files.append(SealedFile(key, entry.size, entry.xxh3, entry.chunks))
            continue
        got = hash_object(ckpt, key, chunk_size, progress=progress)
        assert got is not None
        files.append(SealedFile(key, got.size, got.xxh3, got.chunks))
    return files


def seal_as_written(ckpt: Storage, layout: str, step: int | None, files: Sequence[SealedFile], *,
                    chunk_size: int = CHUNK_SIZE, committed: float | None = None) -> SealResult:
    """Create the seal of a checkpoint from checksums taken as its files were written
    (``ckptctl.integrations``: DCP's writer, the Trainer's callback), the same sidecar
    ``seal_checkpoint`` writes but for two fields: nothing was test-loaded, so ``test_loaded`` is
    "written" and ``not_loaded`` says so (prune then test-loads such an anchor itself rather than
    take the seal for the load level). ``committed`` defaults to now: the caller seals what it
    is committing or has just committed. Write-if-absent: an existing seal is kept and "already sealed" returned."""
    t0 = time.perf_counter()
    name = ckpt.url.rstrip("/").rsplit("/", 1)[-1]
    now = time.time()
    seal = Seal(layout=layout, name=name, step=step, created=now, tool=tool_info(), files=tuple(files),
                chunk_size=chunk_size, test_loaded=WRITTEN, not_loaded=(WRITTEN_NOTE,),
                committed=now if committed is None else min(now, committed))
    result = SealResult(ckpt.url, name, layout, step, "sealed", files=len(files), bytes=seal.total_bytes,
                        not_loaded=[WRITTEN_NOTE])
    if not ckpt.write_if_absent(SEAL, encode_seal(seal)):
        result.status, result.reason = "already sealed", "a seal was there already; it was kept"
    result.seconds = time.perf_counter() - t0
    return result


def seal_just_written(path: str, progress: Progress | None = None, *, written: Written | None = None) -> SealResult:
    """Seal the checkpoint another tool has just finished writing at ``path`` (the Trainer's
    ``checkpoint-N``, accelerate's ``checkpoint_N``), right after its save, without the test-load
    of ``seal_checkpoint``: each file's entry is the one ``written`` gives (hashed during the
    save, ``integrations.savehooks``), else the file is read back once (the page cache still
    holds it), and the seal records ``test_loaded: "written"`` (``seal_as_written``).
    Raises InvalidCheckpoint when ``path`` is not a complete checkpoint of a layout that takes
    seals, or changed while it was hashed (a rotation deleting it)."""
    found = classify(path)
    if found.what != "checkpoint" or found.in_layout.files_are_checkpoints:
        raise InvalidCheckpoint(f"{path}: not a checkpoint directory ({found.what}); not sealed",
                                hint="seal the directory the save wrote (checkpoint-N, checkpoint_N, step-N)")
    layout = found.in_layout
    if layout.seal_note is not None:  # its own checksums cover every byte (ckptctl's manifest)
        raise InvalidCheckpoint(f"{path}: {layout.seal_note}; not sealed", hint="nothing to do for this layout")
    ckpt = found.storage
    seen = layout.examine(ckpt)
    if seen.status != "committed":
        raise InvalidCheckpoint(f"{ckpt.url}: not a complete {layout.name} checkpoint ({seen.reason or seen.status}); "
                                "not sealed", hint="seal a checkpoint once its save has finished")
    before = _snapshot(ckpt)
    files = hash_listing(ckpt, before, progress=progress, written=written)
    if _snapshot(ckpt) != before:
        raise InvalidCheckpoint(f"{ckpt.url}: changed while it was being sealed; not sealed",
                                hint="a save or a rotation is still at work on it; seal it once it is finished")
    return seal_as_written(ckpt, layout.name, layout.step_of(ObjectInfo(found.name, 0, 0.0, "dir")), files, committed=commit_time(before))


def seal_checkpoint(ckpt: Storage, layout: Layout, progress: Progress | None = None, *,
                    chunk_size: int = CHUNK_SIZE) -> SealResult:
    """Seal one checkpoint of another tool (``layout`` bound to its root): test-load every
    file, then hash and write the seal. An existing seal is left as is ("already sealed").
    Raises InvalidCheckpoint for an incomplete or corrupt checkpoint (nothing is written)."""
    t0 = time.perf_counter()
    name = ckpt.url.rstrip("/").rsplit("/", 1)[-1]
    if layout.seal_note is not None:
        return SealResult(ckpt.url, name, layout.name, None, unsealed(layout), reason=layout.seal_note)
    # A seal killed between writing its temporary and linking or unlinking it left that
    # temporary: removed first, so it is neither sealed as a file of the checkpoint nor mistaken
    # for one added after sealing (a seal linked into place is complete: written, then linked).
    remove_temporaries(ckpt)
    existing = read_seal(ckpt)  # a damaged seal raises: never replaced silently
    if existing is not None:
        return SealResult(ckpt.url, name, layout.name, existing.step, "already sealed", files=len(existing.files),
                          bytes=existing.total_bytes, reason="a seal exists; it is never replaced (delete it to re-seal)")
    seen = layout.examine(ckpt)
    if seen.status != "committed":
        raise InvalidCheckpoint(f"{ckpt.url}: not a complete {layout.name} checkpoint ({seen.reason or seen.status}); not sealed",
                                hint="only a checkpoint its stack has finished writing is sealed; seal an older one")
    before = _snapshot(ckpt)
    report = verify(ckpt, layout, "load")
    if not report.ok:
        first = report.problems[0]
        more = f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise InvalidCheckpoint(f"{ckpt.url}: fails `verify --load`, not sealed: {first}{more}",
                                hint=first.hint or "a seal would vouch for damaged bytes; use an older checkpoint")
    result = write_seal(ckpt, layout, report, progress=progress, expected=before, chunk_size=chunk_size)
    result.seconds = time.perf_counter() - t0
    return result


def seal_root(root: Storage, progress: Progress | None = None) -> list[SealResult]:
    """Seal every complete checkpoint of another tool under ``root`` not sealed yet. Partial
    ones are skipped (they may still be written), ckptctl's own need no seal; one that fails
    its test-load is reported "failed" and the others are still sealed."""
    results: list[SealResult] = []
    for entry in list_checkpoints(root):
        layout = entry.owner
        if entry.status in ("link", "unknown") or entry.storage is None or layout is None:
            results.append(SealResult(entry.url, entry.name, entry.layout, entry.step, "skipped",
                                      reason=entry.reason or entry.status))
            continue
        if layout.seal_note is not None:  # its own checksums cover every byte, or it is one file
            results.append(SealResult(entry.url, entry.name, entry.layout, entry.step, unsealed(layout),
                                      reason=layout.seal_note))
            continue
        if entry.status != "committed":
            results.append(SealResult(entry.url, entry.name, entry.layout, entry.step, "skipped",
                                      reason=f"{entry.status}: {entry.reason}"))
            continue
        try:
            results.append(seal_checkpoint(entry.storage, layout, progress))
        except InvalidCheckpoint as e:
            results.append(SealResult(entry.url, entry.name, entry.layout, entry.step, "failed", reason=str(e)))
    return results


def seal_path(path: str, progress: Progress | None = None) -> SealOutcome:
    """``seal`` by path or URL, as the CLI names it: one checkpoint of another tool (sealed, or
    InvalidCheckpoint when incomplete), one of ckptctl's own (a no-op that says so), or a root
    (every complete checkpoint not sealed yet). Works on every backend: on object storage the
    test-load streams each file to a temporary local file, so sealing where the checkpoint was
    written (``cp`` carries the seal) reads less."""
    found = classify(path)
    if found.missing:
        raise UsageError(f"no such file or directory: {path}", hint="check the path for a typo")
    st, local = found.storage, found.local
    outcome = SealOutcome(path)
    layout = found.layout if found.what == "checkpoint" and found.claimed else None
    if layout is not None and layout.seal_note is not None:  # its own checksums cover every byte, or a file
        outcome.results.append(SealResult(st.url, found.name, layout.name, None, unsealed(layout),
                                          reason=layout.seal_note))
        return outcome
    if layout is not None and found.by_name:
        outcome.results.append(seal_checkpoint(st, layout, progress))
        return outcome
    if local is not None and not found.is_dir:
        raise InvalidCheckpoint(f"not a checkpoint of another tool: {path}",
                                hint="give a checkpoint directory (checkpoint-N, step-N, iter_N, global_stepN) or its root")
    outcome.results = seal_root(st, progress)
    if not outcome.results:
        raise InvalidCheckpoint(f"no checkpoint to seal under {path}",
                                hint="give a checkpoint directory of another tool, or the root holding them")
    return outcome
