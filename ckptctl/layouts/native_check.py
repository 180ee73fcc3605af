"""Checking one ckptctl checkpoint against its manifest: ``NativeLayout.check``.

Levels, each including the one before:

- ``quick``: marker, manifest (and that the marker commits this manifest), every listed file
  present with the right size, every shard header parses, agrees with the manifest and is the
  one it committed (the file checksum rebuilt from the header), and every tensor's chunks
  cover it exactly once (from the headers alone: ``coverage``);
- ``checksums`` (default): every byte of every shard read once and checked against the file
  checksum and each tensor chunk's checksum, so a flipped bit is reported by tensor name;
- ``load``: also decodes every chunk as its dtype, and checks that safetensors itself accepts
  each local shard.

One file's checks are ``shard_scan``'s: files stream through in fixed-size pieces (memory:
pieces in flight, never a whole file) and are checked in parallel. Every problem found is
reported, not just the first. Under a split (a torchrun ``verify``) each process checks its
share of the files, balanced by bytes, and every process gets the whole result.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptctl.errors import CoordinationError
from ckptctl.format.geometry import box, coverage_problems
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.shard import Chunk, ShardHeader
from ckptctl.layouts.checked import ALONE, LEVELS, Checked, Level, Problem, Share, Split
from ckptctl.layouts.node_part import NodePart
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.progress import Progress, expect_bytes
from ckptctl.settings import VERIFY_THREADS
from ckptctl.storage.base import Reader, Storage


@dataclass
class _Part:
    """One process's checks of its share of the files, each problem keyed by its file so that
    the result lists them in the manifest's order whichever process found them."""

    quick: dict[str, list[Problem]] = field(default_factory=dict)
    headers: dict[str, ShardHeader] = field(default_factory=dict)
    data: dict[str, list[Problem]] = field(default_factory=dict)
    loaded: list[Problem] = field(default_factory=list)
    files: int = 0
    bytes_read: int = 0


def check_manifest(ckpt: Storage, level: Level, manifest: Manifest | None, identity: str | None,
                   problem: Problem | None = None, *, split: Split = ALONE,
                   progress: Progress | None = None, part: NodePart | None = None) -> Checked:
    """Check the checkpoint ``ckpt`` at ``level`` against ``manifest``, the one its marker
    commits (``identity``: the manifest checksum the marker records), or report ``problem``
    (why there is none: not committed, corrupt); ``part``: a node's part of it, whose files
    elsewhere are named, not checked. Never raises for a problem in the checkpoint, only for
    storage that cannot be read."""
    t0 = time.perf_counter()
    out = Checked(level)
    if problem is not None:
        out.problems.append(problem)
    away = {f.name for f in part.elsewhere} if part is not None else set()
    files = [f for f in manifest.files if f.name not in away] if manifest is not None else []
    mine = split.mine([f.size for f in files])

    def work() -> tuple[str, str | None, _Part, float, Level]:
        part = _check_part(ckpt, manifest, [files[i] for i in mine], level, progress) if manifest else _Part()
        return ckpt.url, identity, part, time.perf_counter() - t0, level

    gathered = split.each(work)
    out.level = min((g[4] for g in gathered), key=LEVELS.index)  # what every process checked, at least
    if len({(g[0], g[1]) for g in gathered}) > 1:
        raise CoordinationError(f"{ckpt.url}: the processes of this job read different checkpoints here "
                                "(it changed while being verified)", hint="verify it again once nothing writes to it")
    parts = [g[2] for g in gathered]
    if split is not ALONE:
        out.shares = [Share(g[2].files, g[2].bytes_read, g[3]) for g in gathered]
    if manifest is None:
        return out
    out.step, out.files, out.tensors = manifest.step, len(files), len(manifest.tensors)
    quick = {k: v for p in parts for k, v in p.quick.items()}
    headers = {k: v for p in parts for k, v in p.headers.items()}
    data = {k: v for p in parts for k, v in p.data.items()}
    for f in files:
        out.problems.extend(quick.get(f.name, []))
    # Coverage needs every shard's header: a node's part is checked file by file only.
    if len(headers) == len(manifest.files):  # else a file is already reported missing or bad
        out.problems.extend(coverage(manifest, headers))
    if part is not None:
        out.notes.append(part.note(len(files)))
    for f in files:
        out.problems.extend(data.get(f.name, []))
    out.problems.extend(p for part in parts for p in part.loaded)
    out.bytes_read = sum(p.bytes_read for p in parts)
    return out


def _check_part(ckpt: Storage, manifest: Manifest, files: list[FileEntry], level: Level,
                progress: Progress | None) -> _Part:
    """The checks of ``files`` (all of them, or one rank's share) at ``level``."""
    part = _Part(files=len(files))
    # On object storage each file's reader stays open from its header's check to its stream:
    # one HEAD per file, not one per range read (locally a descriptor per file would be held).
    kept: dict[str, Reader] | None = {} if level != "quick" and ckpt.local_path() is None else None
    try:
        for f in files:
            found: list[Problem] = []
            h = check_file(ckpt, f, manifest, found, keep=kept)
            part.quick[f.name] = found
            if h is not None:
                part.headers[f.name] = h
        if level != "quick":
            _stream_part(ckpt, part, files, level, progress, kept or {})
    finally:
        for reader in (kept or {}).values():
            reader.close()
    if level == "load":
        part.loaded = safetensors_accepts(ckpt, part.headers)
    return part


def _stream_part(ckpt: Storage, part: _Part, files: list[FileEntry], level: Level, progress: Progress | None,
                 kept: dict[str, Reader]) -> None:
    """Every byte of the files of ``part`` whose headers passed, hashed (``stream_file``)."""
    good = [f for f in files if f.name in part.headers]
    expect_bytes(progress, sum(f.size for f in good))  # a bar's total, %, ETA
    # VERIFY_THREADS readers in all: over files when there are many, within files when few.
    parts = max(1, VERIFY_THREADS // max(len(good), 1))
    with ThreadPoolExecutor(min(VERIFY_THREADS, max(len(good), 1))) as pool:
        results = pool.map(lambda f: stream_file(ckpt, f, part.headers[f.name], progress, decode=level == "load",
                                                 parts=parts, reader=kept.get(f.name)), good)
        for f, (problems, nbytes) in zip(good, results):
            part.data[f.name] = problems
            part.bytes_read += nbytes


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


def safetensors_accepts(ckpt: Storage, headers: dict[str, ShardHeader]) -> list[Problem]:
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
