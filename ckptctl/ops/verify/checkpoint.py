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

from ckptctl.errors import InvalidCheckpoint, NotFound
from ckptctl.format.geometry import box, coverage_problems
from ckptctl.format.manifest import Manifest
from ckptctl.format.shard import Chunk, ShardHeader
from ckptctl.layouts.native import read_committed
from ckptctl.ops.verify.problem import Problem
from ckptctl.ops.verify.shard_scan import check_file, stream_file
from ckptctl.ops.expect import expect_bytes
from ckptctl.progress import Progress
from ckptctl.settings import VERIFY_THREADS
from ckptctl.storage.base import Storage

__all__ = ["LEVELS", "Level", "Problem", "VerifyReport", "coverage", "verify_checkpoint"]

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

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["problems"] = [{**asdict(p), "text": str(p)} for p in self.problems]
        return d


def verify_checkpoint(ckpt: Storage, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Check one checkpoint at ``level``; never raises for a problem in the checkpoint itself
    (those are in the report), only for operational failures (StorageError)."""
    t0 = time.perf_counter()
    report = VerifyReport(ckpt.url, level)
    try:
        manifest, _ = read_committed(ckpt)
    except (NotFound, InvalidCheckpoint) as e:
        report.problems.append(Problem(str(e), hint=e.hint))
        return report
    report.step, report.files, report.tensors = manifest.step, len(manifest.files), len(manifest.tensors)
    headers: dict[str, ShardHeader] = {}
    for f in manifest.files:
        h = check_file(ckpt, f, manifest, report.problems)
        if h is not None:
            headers[f.name] = h
    if len(headers) == len(manifest.files):  # else a file is already reported missing or bad
        report.problems.extend(coverage(manifest, headers))
    if level != "quick":
        files = [f for f in manifest.files if f.name in headers]
        expect_bytes(progress, sum(f.size for f in files))  # a bar's total, %, ETA
        # VERIFY_THREADS readers in all: over files when there are many, within files when few.
        parts = max(1, VERIFY_THREADS // max(len(files), 1))
        with ThreadPoolExecutor(min(VERIFY_THREADS, max(len(files), 1))) as pool:
            results = pool.map(lambda f: stream_file(ckpt, f, headers[f.name], progress, decode=level == "load", parts=parts), files)
            for problems, nbytes in results:
                report.problems.extend(problems)
                report.bytes_read += nbytes
    if level == "load":
        report.problems.extend(_safetensors_accepts(ckpt, headers))
    report.seconds = time.perf_counter() - t0
    return report


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
