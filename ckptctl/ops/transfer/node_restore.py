"""``restore`` under torchrun: each node gets only the shards its ranks will read, plus the
manifest and marker; no node copies the whole checkpoint.

``ckptctl restore s3://lab/run7 /nvme/ckpt`` started by torchrun on every node of a job warms
each node's local disk before a relaunch. The node (``ops.distributed.Job``: torchrun's
``GROUP_RANK``) holds the shards of the ranks that will run on it: its own ranks when the
restore job has as many ranks as the checkpoint will be loaded by (``--world-size``, default
the saved world size), else an equal block per node (``Job.node_targets``).

* Saved with that many ranks: the node's ranks share the node's shard files (balanced by
  bytes) and each copies its share from the source, checked on the fly, published only where
  nothing has its name (``ops.transfer.files.copy_files``).
* Saved with another number: every rank writes its share of its node's target shards,
  re-sharded straight from the source (``ops.transfer.node_reshard``).
* A checkpoint whose layout does not say which rank reads which file (another tool's: no
  ``CopySource.world_size``): each node's leader copies it whole to its node
  (``ops.transfer.engine.copy_in_layout``).

Once every rank of the job reports its files durable and checked (the all-ok collective),
each node's leader (its lowest rank) writes the manifest, then the marker, into its node's
copy: the same bytes on every node. That is the node-local commit rule (``tiers.node_commit``):
the node-local tier of ``Checkpointer(tiers=[Tier(DST, node_local=True), ...])`` takes the
copy as committed, and a relaunch resumes from it, each rank reading its own node's disk.
``ckptctl verify`` of one node's copy reports the other nodes' shards missing, by design.

A corrupt newest checkpoint is skipped together by every rank (rank 0 names the candidates,
one at a time), as a plain restore skips it; any other failure on any rank fails every rank,
and a leader that had committed removes its marker again, so no node is left with a copy the
others lack.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

from ckptctl.errors import CheckpointError, CkptError, InvalidCheckpoint, RefusedForSafety, UsageError
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.layouts.base import Layout
from ckptctl.layouts.catalog import layout_named
from ckptctl.layouts.native import files_to_copy
from ckptctl.layouts.native_commit import commit_copy, uncommit
from ckptctl.layouts.native_read import Committed, read_committed_raw
from ckptctl.ops.distributed import Job, agree, alone, attempt, everyone, gathered, mine, on_root
from ckptctl.ops.seal.leftovers import remove_temporaries
from ckptctl.ops.transfer.copy import RestoreResult, Skipped, candidates, restore_first
from ckptctl.ops.transfer.engine import CopyResult, copy_in_layout
from ckptctl.ops.transfer.files import Ends, at_destination, copy_files, describe_problems
from ckptctl.ops.transfer.uploads import before_copy
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.progress import Progress
from ckptctl.settings import COPY_THREADS
from ckptctl.storage.base import Storage


@dataclass
class _NodeDone:
    """What one rank did for its node, gathered on every rank."""

    files: list[FileEntry]  # the files this rank wrote (or found in place)
    bytes_copied: int
    reused: int


def restore_to_nodes(src_root: Storage, dst_root: Storage, job: Job, step: int | None = None,
                     progress: Progress | None = None, *, world_size: int | None = None,
                     on_skip: Callable[[Skipped], None] | None = None, threads: int = COPY_THREADS) -> RestoreResult:
    """``copy.restore_latest`` split by node (see the module docstring); every rank returns the
    same result (its ``copy.ranks``: one entry per node), ``path`` being rank 0's node's copy."""
    if world_size is not None:
        from ckptctl.ops.transform.reshard import check_world_size

        check_world_size(world_size)
    return restore_first(_job_candidates(src_root, step, job),
                         lambda layout, src: _restore_one(layout, src, dst_root, job, world_size, progress, threads),
                         src_root, dst_root, step, on_skip)


def _job_candidates(src_root: Storage, step: int | None, job: Job) -> Iterator[tuple[Layout, Storage, int]]:
    """``copy.candidates`` on every rank as rank 0 lists them (lazily: a look per candidate
    tried), so that every rank tries the same checkpoints in the same order."""
    found = candidates(src_root, step) if job.rank == 0 else None

    def next_candidate() -> tuple[str, int, str] | None:
        assert found is not None
        cand = next(found, None)
        return None if cand is None else (cand[0].name, cand[2], cand[1].url)

    while True:
        cand = on_root(job, next_candidate)
        if cand is None:
            return
        layout_name, cand_step, url = cand
        src = src_root if url == src_root.url else src_root.sub(url.rstrip("/").rsplit("/", 1)[-1])
        yield layout_named(layout_name, src_root), src, cand_step


def _restore_one(layout: Layout, src: Storage, dst_root: Storage, job: Job, world_size: int | None,
                 progress: Progress | None, threads: int) -> CopyResult:
    source = on_root(job, lambda: layout.copy_source(src))  # one read of the record, sent to every rank
    if source.world_size is None:  # no rank reads a file of its own: each node's leader copies it whole
        if world_size is not None:
            raise UsageError(f"--world-size re-shards ckptctl checkpoints only; {src.url} is a {layout.name} checkpoint",
                             hint="restore without it, or `ckptctl convert --to ckptctl` first")
        done, failure = None, None
        if job.leader:
            with alone():
                done, failure = attempt(lambda: copy_in_layout(layout, src, dst_root, progress=progress, threads=threads))
        agree(job, failure)
        return everyone(job, done)[0]  # type: ignore[return-value]
    t0 = time.perf_counter()
    committed = source.record
    assert isinstance(committed, Committed)
    return _restore_split(committed, src, dst_root.sub(step_dir(source.step)), job, world_size, progress, threads, t0)


def _restore_split(source: Committed, src: Storage, dst: Storage, job: Job, world_size: int | None,
                   progress: Progress | None, threads: int, t0: float) -> CopyResult:
    """A checkpoint whose shards say which rank reads them: each node gets its ranks' shards."""
    saved = source.manifest.world_size
    target_ws = saved if world_size is None else world_size
    targets = job.node_targets(target_ws)
    result = CopyResult(src.url, dst.url, source.manifest.step, "copied")
    failure, present = None, False
    if job.leader:
        present, failure = attempt(lambda: at_destination(dst, lambda: _node_present(dst, source, target_ws, targets)))
    agree(job, failure)
    leaders = everyone(job, present if job.leader else None)
    if all(leaders[r] for r in range(job.world_size) if job.nodes.index(job.nodes[r]) == r):
        result.status = "already present"  # every node holds this checkpoint, verified
        result.files = target_ws
        result.seconds = time.perf_counter() - t0
        return result
    if target_ws == saved:
        done = _copy_node_files(src, dst, source, targets, job, bool(leaders[job.node_ranks[0]]), progress, threads)
        committed = source
    else:
        from ckptctl.ops.transfer.node_reshard import reshard_to_node

        if job.leader and present:  # re-sharded again with the other nodes: one manifest for all
            _, failure = attempt(lambda: at_destination(dst, lambda: uncommit(dst)))
        agree(job, failure)
        try:
            resharded = reshard_to_node(src, dst, target_ws, targets, job, progress)
        except CkptError:  # raised on every rank alike, each having taken back its shards
            agree(job, None)
            if job.leader:
                attempt(lambda: dst.remove_dir(""))  # only if now empty; a no-op on S3
            raise
        committed = resharded.committed
        done = _NodeDone(resharded.written, sum(f.size for f in resharded.written), 0)
    parts = everyone(job, done)
    published = [f.name for r, p in enumerate(parts) if job.nodes[r] == job.node for f in p.files]
    _commit_nodes(dst, committed, targets, job, published)
    result.files = len(committed.manifest.files)
    result.bytes_copied = sum(p.bytes_copied for p in parts)
    result.files_reused = sum(p.reused for p in parts)
    result.ranks = [{"node": node, "ranks": [r for r in range(job.world_size) if job.nodes[r] == node],
                     "files": sum(len(parts[r].files) for r in range(job.world_size) if job.nodes[r] == node),
                     "bytes": sum(parts[r].bytes_copied for r in range(job.world_size) if job.nodes[r] == node)}
                    for node in job.node_order]
    result.seconds = time.perf_counter() - t0
    return result


def _copy_node_files(src: Storage, dst: Storage, source: Committed, targets: list[int], job: Job, present: bool,
                     progress: Progress | None, threads: int) -> _NodeDone:
    """Saved with as many ranks as will load it: the node's files, shared by the node's ranks,
    copied and checked on the way (nothing, when the node's copy is ``present`` already). A
    corrupt source commits nothing, and each rank takes back the files it published."""
    node_files = [] if present else [f for f in files_to_copy(source.manifest) if f.ranks and f.ranks & set(targets)]
    failure = None
    if job.leader and node_files:  # a killed earlier run's uploads
        _, failure = attempt(lambda: at_destination(dst, lambda: before_copy(dst, [f.name for f in node_files])))
    agree(job, failure)
    files = [node_files[i] for i in mine(job, [f.size for f in node_files], job.node_ranks)]
    done, failure = attempt(lambda: copy_files(Ends(src, dst), files, progress, threads=threads))
    parts = gathered(job, done, failure)
    assert done is not None
    problems = [p for d in parts if d is not None for found in d.problems.values() for p in found]
    if problems:  # a corrupt source: each rank takes back what it published
        _, failure = attempt(lambda: at_destination(dst, lambda: [dst.delete(name) for name in done.published]))
        agree(job, failure)  # every rank's files are gone before the directory is removed
        if job.leader:
            at_destination(dst, lambda: dst.remove_dir(""))  # only if now empty; a no-op on S3
        raise InvalidCheckpoint(describe_problems(problems, src.url), hint=problems[0].hint or
                                "the source was modified after it was written; restore an older checkpoint")
    by_name = {f.name: f for f in source.manifest.files}
    return _NodeDone([by_name[n] for n in done.published], done.bytes_copied, done.reused)


def _node_present(dst: Storage, source: Committed, world_size: int, targets: list[int]) -> bool:
    """The node leader's look at its node's copy: True when it commits this checkpoint (for
    ``world_size`` ranks) and every byte of the node's files verifies. Another checkpoint
    committed there is refused (RefusedForSafety); this one damaged is uncommitted (marker
    first), and its damaged files removed, to be copied again (a file at the destination is
    never replaced: ``ops.transfer.engine``)."""
    if dst.stat(MARKER) is None:
        return False
    try:
        existing = read_committed_raw(dst)
    except CheckpointError as e:
        raise RefusedForSafety(f"{dst.url} already has a {MARKER} marker but is not a valid checkpoint ({e})",
                               hint=f"inspect it with `ckptctl verify {dst.url}`; remove it (marker first) to replace it") from None
    if world_size == source.manifest.world_size:
        same = existing.manifest_raw == source.manifest_raw
    else:
        same = _layout_free(existing.manifest, world_size) == _layout_free(source.manifest, world_size)
    if not same:
        raise RefusedForSafety(f"{dst.url} already holds a different committed checkpoint (step {existing.manifest.step}, "
                               f"{existing.manifest.world_size} ranks)",
                               hint="choose another destination, or delete that checkpoint first")
    problems: list[Problem] = []
    for f in existing.manifest.files:
        if f.rank in targets:
            h = check_file(dst, f, existing.manifest, problems)
            if h is not None:
                problems.extend(stream_file(dst, f, h)[0])
    if not problems:
        return True
    uncommit(dst)
    for name in {p.file for p in problems if p.file is not None}:
        dst.delete(name)
    return False


def _layout_free(m: Manifest, world_size: int) -> tuple:
    """What a re-sharded copy keeps of its source: the chunk counts change with the world size."""
    return (m.step, world_size, {n: (t.dtype, t.shape, t.group) for n, t in m.tensors.items()}, m.state)


def _commit_nodes(dst: Storage, committed: Committed, targets: list[int], job: Job, published: list[str]) -> None:
    """Every rank's files are durable and checked: each node's leader commits its copy (the
    manifest, then the marker, the same bytes on every node, each written only if absent;
    ``published``: the files this node's ranks published, deleted by a leader that lost the
    step to another writer unless the winner names them). When any leader fails, the others
    take their marker back, so that no node holds a copy the others lack."""
    wrote = False
    failure = None
    if job.leader:
        def commit() -> None:
            nonlocal wrote
            if dst.stat(MARKER) is not None and read_committed_raw(dst).manifest_raw == committed.manifest_raw:
                return  # this node's copy was committed and verified already (a rerun)
            at_destination(dst, lambda: commit_copy(dst, committed, published))
            wrote = True
            # A killed earlier run's temporaries (never a running writer's: their process is alive).
            at_destination(dst, lambda: remove_temporaries(dst))

        _, failure = attempt(commit)
    if any(f is not None for f in everyone(job, failure)):
        if wrote:
            attempt(lambda: uncommit(dst))
    agree(job, failure)
