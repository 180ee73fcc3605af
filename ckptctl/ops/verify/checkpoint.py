"""``verify``: is this checkpoint whole and uncorrupted?

Levels, each including the one before:

- ``quick``: marker, manifest (and that the marker commits this manifest), every listed file
  present with the right size, every shard header parses, agrees with the manifest and is the
  one it committed (the file checksum rebuilt from the header), and every tensor's chunks
  cover it exactly once (from the headers alone: ``coverage``);
- ``checksums`` (default): every byte of every shard read once and checked against the file
  checksum and each tensor chunk's checksum, so a flipped bit is reported by tensor name;
- ``load``: also decodes every chunk as its dtype, and checks that safetensors itself accepts
  each local shard.

One file's checks are ``ops.verify.shard_scan``'s: files stream through in fixed-size pieces (memory:
pieces in flight, never a whole file) and are checked in parallel. Every problem found is
reported, not just the first.

One ckptctl checkpoint only: a root's checkpoints, of every layout, are ``ops.verify.layouts``'s
(``verify_root``), which calls ``verify_checkpoint`` for ckptctl's own.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Literal

from ckptctl.errors import CoordinationError, InvalidCheckpoint, NotFound
from ckptctl.format.geometry import box, coverage_problems
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.shard import Chunk, ShardHeader
from ckptctl.layouts.native import read_committed
from ckptctl.ops.verify.problem import Problem
from ckptctl.ops.verify.shard_scan import check_file, stream_file
from ckptctl.ops.distributed import agree, attempt, current, everyone, mine
from ckptctl.ops.expect import expect_bytes
from ckptctl.progress import Progress
from ckptctl.settings import VERIFY_THREADS
from ckptctl.storage.base import Storage

__all__ = ["LEVELS", "Level", "Problem", "RankShare", "VerifyReport", "coverage", "verify_checkpoint"]

Level = Literal["quick", "checksums", "load"]
LEVELS: tuple[Level, ...] = ("quick", "checksums", "load")


@dataclass
class VerifyReport:
    url: str
    level: Level
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    note: str | None = None
    # Under torchrun: what each rank read (its share of the files), by rank; empty otherwise.
    ranks: list["RankShare"] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["problems"] = [{**asdict(p), "text": str(p)} for p in self.problems]
        if not self.ranks:  # a plain run's document is unchanged
            del d["ranks"]
        return d


@dataclass
class RankShare:
    """What one rank of a torchrun job verified: its share of the files (``ops.distributed.share``)."""

    rank: int
    node: str
    files: int
    bytes_read: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Part:
    """One rank's checks of its share of the files, each problem keyed by its file so that the
    report lists them in the manifest's order whichever rank found them."""

    quick: dict[str, list[Problem]] = field(default_factory=dict)
    headers: dict[str, ShardHeader] = field(default_factory=dict)
    data: dict[str, list[Problem]] = field(default_factory=dict)
    loaded: list[Problem] = field(default_factory=list)
    files: int = 0
    bytes_read: int = 0


def verify_checkpoint(ckpt: Storage, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Check one checkpoint at ``level``; never raises for a problem in the checkpoint itself
    (those are in the report), only for operational failures (StorageError).

    Under a torchrun verb (``ops.distributed.current``) every rank reads the manifest and checks
    its share of the files (balanced by bytes); the parts are gathered, so every rank returns
    the same whole report, with ``ranks`` saying what each one read."""
    t0 = time.perf_counter()
    job = current()
    report = VerifyReport(ckpt.url, level)
    manifest: Manifest | None = None
    identity: str | None = None
    try:
        manifest, marker = read_committed(ckpt)
        identity = marker.manifest_checksum
    except (NotFound, InvalidCheckpoint) as e:
        report.problems.append(Problem(str(e), hint=e.hint))
    files = manifest.files if manifest is not None else []
    part, failure = attempt(lambda: _check_part(ckpt, manifest, [files[i] for i in mine(job, [f.size for f in files])],
                                                level, progress) if manifest is not None else _Part())
    if job is None:
        if failure is not None:
            raise failure
        parts = [part]
    else:
        gathered = everyone(job, (ckpt.url, identity, part, failure, time.perf_counter() - t0, level))
        report.level = min((g[5] for g in gathered), key=LEVELS.index)  # what every rank checked, at least
        if len({(g[0], g[1]) for g in gathered}) > 1:
            raise CoordinationError(f"{ckpt.url}: the ranks of this torchrun job read different checkpoints here "
                                    "(it changed while being verified)",
                                    hint="verify it again once nothing writes to it")
        agree(job, failure)
        parts = [g[2] for g in gathered]
        report.ranks = [RankShare(r, job.nodes[r], g[2].files, g[2].bytes_read, g[4]) for r, g in enumerate(gathered)]
    if manifest is None:
        report.seconds = time.perf_counter() - t0
        return report
    report.step, report.files, report.tensors = manifest.step, len(manifest.files), len(manifest.tensors)
    quick = {k: v for p in parts for k, v in p.quick.items()}
    headers = {k: v for p in parts for k, v in p.headers.items()}
    data = {k: v for p in parts for k, v in p.data.items()}
    for f in manifest.files:
        report.problems.extend(quick.get(f.name, []))
    if len(headers) == len(manifest.files):  # else a file is already reported missing or bad
        report.problems.extend(coverage(manifest, headers))
    for f in manifest.files:
        report.problems.extend(data.get(f.name, []))
    report.problems.extend(p for part_ in parts for p in part_.loaded)
    report.bytes_read = sum(p.bytes_read for p in parts)
    report.seconds = time.perf_counter() - t0
    return report


def _check_part(ckpt: Storage, manifest: Manifest, files: list[FileEntry], level: Level,
                progress: Progress | None) -> _Part:
    """The checks of ``files`` (all of them, or one rank's share) at ``level``."""
    part = _Part(files=len(files))
    for f in files:
        found: list[Problem] = []
        h = check_file(ckpt, f, manifest, found)
        part.quick[f.name] = found
        if h is not None:
            part.headers[f.name] = h
    if level != "quick":
        good = [f for f in files if f.name in part.headers]
        expect_bytes(progress, sum(f.size for f in good))  # a bar's total, %, ETA
        # VERIFY_THREADS readers in all: over files when there are many, within files when few.
        parts = max(1, VERIFY_THREADS // max(len(good), 1))
        with ThreadPoolExecutor(min(VERIFY_THREADS, max(len(good), 1))) as pool:
            results = pool.map(lambda f: stream_file(ckpt, f, part.headers[f.name], progress, decode=level == "load", parts=parts), good)
            for f, (problems, nbytes) in zip(good, results):
                part.data[f.name] = problems
                part.bytes_read += nbytes
    if level == "load":
        part.loaded = _safetensors_accepts(ckpt, part.headers)
    return part


def coverage(manifest: Manifest, headers: dict[str, ShardHeader]) -> list[Problem]:
    """From the manifest and the shard headers alone (no tensor data): every tensor's chunks
    cover it exactly once (each inside the tensor, no two overlapping, volumes adding up to
    its size: ``format.geometry.coverage_problems``), and as many chunks as the manifest says."""
    by_tensor: dict[str, list[Chunk]] = {}
    for h in headers.values():
        for c in h.chunks:
            by_tensor.setdefault(c.name, []).append(c)
    problems = []
    for name, t in manifest.tensors.items():
        chunks = by_tensor.get(name, [])
        if len(chunks) != t.chunks:
            problems.append(Problem(f"{len(chunks)} chunks found, manifest says {t.chunks}", tensor=name,
                                    hint="a rank's shard is missing from this checkpoint"))
        for p in coverage_problems(t.shape, [box(c.offsets, c.shape) for c in chunks]):
            hint = "a rank's shard is missing from this checkpoint" if p.kind == "volume" else None
            problems.append(Problem(p.message, tensor=name, hint=hint))
    return problems


def _safetensors_accepts(ckpt: Storage, headers: dict[str, ShardHeader]) -> list[Problem]:
    from safetensors import SafetensorError, safe_open

    problems = []
    for name in headers:
        path = ckpt.local_path(name)
        if path is None:
            continue  # object store: our own parser above applied the same rules
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            problems.append(Problem(f"safetensors refuses the file: {e}", file=name))
    return problems
