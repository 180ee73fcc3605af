"""``verify ROOT --latest --tier URL ...``: a step judged whole across the roots that together
hold it.

A node-local first tier (``Tier(path, node_local=True)``) keeps on each node only that node's
ranks' shards, with the step's manifest and marker (``layouts.node_part``): no one node's root
holds a whole step, and ``verify`` of one such root checks that node's part. Given every
node's root (and, if wanted, the tier the job promotes to), a step is *whole* when

- every root whose marker commits the step commits the same manifest (the manifest checksum
  each marker records: two different saves of one step are never mixed into one);
- every file that manifest lists is present on some root, and every copy present verifies at
  the level asked (a bad copy is a problem even where another root holds a good one: what
  ckptctl calls good is good on every disk);
- the shards' headers together cover every tensor exactly once (``native_check.coverage``).

A root where the step is not committed (no marker: still being written or promoted) lends it
nothing and is named in a note; one where it claims to be committed and is not (corrupt) is a
problem. Only ckptctl's own checkpoints are judged: the other stacks write no node-local part.
``verify_whole`` walks the steps newest first as ``verify --latest`` does: ``latest`` stops at
the first whole step, ``all`` judges every one. It runs in one process (under torchrun every
rank checks everything).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

from ckptctl.errors import NoValidCheckpoint
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.format.shard import ShardHeader
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, list_checkpoints
from ckptctl.layouts.checked import Level, Problem
from ckptctl.layouts.file_check import name_of
from ckptctl.layouts.native_check import coverage, safetensors_accepts
from ckptctl.layouts.native_read import Committed, read_state
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.progress import Progress, expect_bytes
from ckptctl.settings import VERIFY_THREADS
from ckptctl.storage.base import Storage


@dataclass
class WholeStep:
    """What the roots together hold of one step."""

    step: int
    level: Level
    roots: list[str] = field(default_factory=list)  # the roots whose marker commits this step
    manifest_checksum: str | None = None  # what those markers record (None when they disagree)
    problems: list[Problem] = field(default_factory=list)
    files: int = 0  # the files the manifest lists
    tensors: int = 0
    copies: int = 0  # file copies checked, over every root
    bytes_read: int = 0
    seconds: float = 0.0
    held: dict[str, list[str]] = field(default_factory=dict)  # file -> the roots holding a copy
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def checked(self) -> str:
        """What was established (as ``VerifyReport.checked``): the level asked for, since every
        shard of ckptctl's format records its checksums."""
        return self.level

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["checked"] = self.ok, self.checked
        d["problems"] = [{**asdict(p), "text": str(p)} for p in self.problems]
        return d


@dataclass
class WholeOutcome:
    """``verify_whole``'s answer: the steps judged, newest first."""

    roots: list[str]
    level: Level
    steps: list[WholeStep]
    which: Literal["latest", "all"]

    @property
    def ok(self) -> bool:
        """``latest``: the newest step is whole; ``all``: every one is."""
        return self.steps[0].ok if self.which == "latest" else all(s.ok for s in self.steps)

    @property
    def fallback(self) -> str | None:
        """When the newest step is not whole: the newest one that is, or that none is."""
        if self.steps[0].ok:
            return None
        good = next((s for s in self.steps if s.ok), None)
        if good is None:
            return f"step {self.steps[0].step} is not whole across these roots, and no older step is: nothing to resume from"
        return f"step {self.steps[0].step} is not whole across these roots; step {good.step} is, the newest that is"

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "level": self.level, "roots": list(self.roots), "fallback": self.fallback,
                "steps": [s.to_dict() for s in self.steps]}


def verify_whole(roots: Sequence[Storage], *, which: Literal["latest", "all"] = "latest",
                 level: Level = "checksums", progress: Progress | None = None) -> WholeOutcome:
    """The steps of ckptctl's own format committed on any of ``roots``, newest first, each
    judged whole across all of them (the module's rules): ``latest`` stops at the first whole
    one. Raises NoValidCheckpoint when no root commits any step; problems go in the steps."""
    steps: dict[int, list[Storage]] = {}  # step -> its checkpoint directory on each root holding one
    for root in roots:
        for e in list_checkpoints(root, layouts=CHECKPOINTER_LAYOUTS):
            if e.storage is not None and e.owner is not None:  # a directory of ours (links are never followed)
                steps.setdefault(e.step, []).append(e.storage)
    judged = []
    for step in sorted(steps, reverse=True):
        s = _judge(step, steps[step], level, progress)
        if s is None:  # committed on no root: not a step yet
            continue
        judged.append(s)
        if which == "latest" and s.ok:
            break
    if not judged:
        raise NoValidCheckpoint(f"no committed ckptctl checkpoint on any of {', '.join(r.url for r in roots)}",
                                hint="nothing has been saved here yet, or every save failed")
    return WholeOutcome([r.url for r in roots], level, judged, which)


def _judge(step: int, copies: list[Storage], level: Level, progress: Progress | None) -> WholeStep | None:
    t0 = time.perf_counter()
    out = WholeStep(step, level)
    committed: list[tuple[Storage, Committed]] = []
    for ckpt in copies:
        state = read_state(ckpt)
        if state.status == "committed":
            assert state.committed is not None
            committed.append((ckpt, state.committed))
        elif state.status == "partial":
            out.notes.append(f"{ckpt.url}: not committed there (no marker: still being written or promoted); not counted")
        else:  # claims to be committed and is not: this root's copy of the step is damaged
            assert state.error is not None
            out.problems.append(Problem(str(state.error), hint=state.error.hint))
    if not committed:
        return None if not out.problems else out
    out.roots = [c.url for c, _ in committed]
    sums = {m.marker.manifest_checksum for _, m in committed}
    if len(sums) > 1:
        which = "; ".join(f"{c.url}: {m.marker.manifest_checksum}" for c, m in committed)
        out.problems.append(Problem(f"the roots commit different manifests for step {step} ({which})",
                                    hint="these are not the tiers of one job, or the step was saved twice; "
                                         "verify each root alone"))
        out.seconds = time.perf_counter() - t0
        return out
    out.manifest_checksum = sums.pop()
    manifest = committed[0][1].manifest
    out.files, out.tensors = len(manifest.files), len(manifest.tensors)
    _check_files(out, manifest, [c for c, _ in committed], level, progress)
    out.seconds = time.perf_counter() - t0
    return out


def _check_files(out: WholeStep, manifest: Manifest, ckpts: list[Storage], level: Level,
                 progress: Progress | None) -> None:
    """Every copy of every file the manifest lists, on every root that holds one."""
    todo: list[tuple[Storage, FileEntry, ShardHeader]] = []
    headers: dict[str, ShardHeader] = {}  # one good header per file: the coverage check
    for f in manifest.files:
        holders = [c for c in ckpts if c.stat(f.name) is not None]
        out.held[f.name] = [c.url for c in holders]
        if not holders:  # named as under any root: the step's directory and the file
            out.problems.append(Problem(
                f"missing from every root (rank {f.rank}'s shard)", file=f"{name_of(ckpts[0])}/{f.name}",
                hint="give the root of the node that ran this rank too, or the tier the job promotes to "
                     "(`ckptctl ls ROOT --tier URL` shows which roots hold this step)"))
        for ckpt in holders:
            found: list[Problem] = []
            h = check_file(ckpt, f, manifest, found)
            out.problems.extend(_on(ckpt, p) for p in found)
            if h is not None:
                todo.append((ckpt, f, h))
                headers.setdefault(f.name, h)
    out.copies = sum(len(v) for v in out.held.values())
    if len(headers) == len(manifest.files):  # else a file is already reported missing or bad
        out.problems.extend(coverage(manifest, headers))
    if level == "quick":
        return
    expect_bytes(progress, sum(f.size for _, f, _ in todo))
    with ThreadPoolExecutor(min(VERIFY_THREADS, max(len(todo), 1))) as pool:
        results = list(pool.map(lambda t: stream_file(t[0], t[1], t[2], progress, decode=level == "load"), todo))
    for (ckpt, _, _), (problems, nbytes) in zip(todo, results):
        out.problems.extend(_on(ckpt, p) for p in problems)
        out.bytes_read += nbytes
    if level == "load":
        for ckpt in ckpts:
            mine = {f.name: h for c, f, h in todo if c is ckpt}
            out.problems.extend(_on(ckpt, p) for p in safetensors_accepts(ckpt, mine))


def _on(ckpt: Storage, p: Problem) -> Problem:
    """``p``, a problem of a file of ``ckpt``, naming the file by its URL: which root's copy."""
    return Problem(p.message, ckpt.url_of(p.file) if p.file else ckpt.url, p.tensor, p.byte_range, p.hint)
