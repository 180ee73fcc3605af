"""A re-sharding ``restore`` under torchrun: each rank writes its own target shards, re-sharded
straight from the source, into its node's destination.

``ops.transform.reshard`` rewrites a checkpoint into one destination that every rank shares,
and rank 0 verifies the whole result there. Here each node has a destination of its own
(node-local disk) and holds only the target shards of its ranks, so the same steps are split
by node:

1. the source's structure is checked (``quick``: marker, manifest, every header), its header
   reads shared by the ranks (``ops.verify.engine`` splits them);
2. every rank plans the same target layout (``reshard.plan_layout``), takes its share of its
   node's target shards (``own_targets``) and writes each one with reshard's two passes,
   reading from the source only the chunks those shards need, each checked against its
   checksum as it is read (``reshard_source.checked_source_checksums``, ``stream_shard``);
3. rank 0 builds the manifest from every rank's file entries; every rank reads back the files
   it wrote against it (every byte, as reshard reads back its result), and the caller's node
   leaders commit it (``ops.transfer.node_restore``).

A failure on any rank fails every rank (``ops.distributed.agree``), and each rank deletes the
target shards it wrote: nothing is committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ckptctl.errors import InvalidCheckpoint, StorageError
from ckptctl.format.layout import MANIFEST, shard_name
from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry
from ckptctl.format.marker import Marker
from ckptctl.layouts.native_read import Committed
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.ops.distributed import Job, agree, attempt, everyone, on_root
from ckptctl.ops.transform.reshard import (
    SPLIT_BYTES,
    check_source_files,
    plan_layout,
    require_verified,
    sharded_dims,
)
from ckptctl.ops.transform.reshard_source import checked_source_checksums
from ckptctl.ops.transform.stream_shard import ChunkSpec, write_shard_streaming
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.shard_scan import check_file, stream_file
from ckptctl.progress import Progress
from ckptctl.state.buffers import TensorBuffer
from ckptctl.storage.base import Storage


@dataclass
class NodeResharded:
    """What the job wrote: the committed bytes every node leader writes, and what this rank did."""

    committed: Committed
    written: list[FileEntry] = field(default_factory=list)  # this rank's target shards
    bytes_read: int = 0  # source bytes this rank read (both passes)


def reshard_to_node(src: Storage, dst: Storage, world_size: int, targets: list[int], job: Job,
                    progress: Progress | None = None) -> NodeResharded:
    """Write this rank's share of ``targets`` (its node's target ranks) re-sharded for
    ``world_size`` ranks from the committed checkpoint ``src`` into ``dst``; every rank
    returns the same ``committed`` (manifest and marker bytes), not yet written anywhere."""
    t0 = time.perf_counter()
    require_verified(src, level="quick")  # collective: each rank reads its share of the headers
    written: list[FileEntry] = []
    with CheckpointReader(src) as reader:
        m = reader.manifest
        known = {(c.name, tuple(c.offsets), tuple(c.shape)): c.checksum
                 for h in reader.headers.values() for c in h.chunks if c.checksum}
        plan = plan_layout(m, world_size, known, SPLIT_BYTES, sharded_dims(reader))
        mine_ = own_targets(job, targets)
        done, failure = attempt(lambda: _write_targets(reader, dst, plan, mine_, world_size, written, progress))
    nread = done or 0
    parts = everyone(job, (written, failure))
    if any(f is not None for _, f in parts):
        _take_back(dst, written)
        agree(job, failure)
    files = sorted((f for w, _ in parts for f in w), key=lambda f: (f.rank, f.name))
    committed = on_root(job, lambda: _committed(m, plan, files, world_size, src.url, time.perf_counter() - t0))
    # Read back what this rank wrote, every byte, against the manifest the leaders will commit:
    # the pass-2 check covered the bytes in memory, this covers them as stored.
    problems, failure = attempt(lambda: _read_back(dst, committed.manifest, written))
    parts2 = everyone(job, (problems or [], failure))
    found = [p for ps, _ in parts2 for p in ps]
    if found or any(f is not None for _, f in parts2):
        _take_back(dst, written)
        agree(job, failure)
        raise InvalidCheckpoint(f"{dst.url}: the re-sharded result failed verification after it was written: {found[0]}",
                                hint="nothing was committed; check the destination's disk and run restore again")
    return NodeResharded(committed, written, nread)


def own_targets(job: Job, targets: list[int]) -> list[int]:
    """The node's target shards this rank writes: its own rank's when the job has as many ranks
    as the target (each rank re-shards the shard it will load), else a contiguous run of them
    (the plan gives target ranks about equal bytes). Contiguous, not interleaved: neighbouring
    target shards read the same source chunks, and pass 1 reads each source chunk it needs
    once per rank (interleaving doubled the node's reads from the source)."""
    if targets == list(job.node_ranks):
        return [job.rank]
    k, n = job.node_ranks.index(job.rank), len(job.node_ranks)
    per = -(-len(targets) // n)
    return targets[k * per:(k + 1) * per]


def _write_targets(reader: CheckpointReader, dst: Storage, plan: list[list[ChunkSpec]], targets: list[int],
                   world_size: int, written: list[FileEntry], progress: Progress | None) -> int:
    """Reshard's two passes for the target shards ``targets``; returns the source bytes read."""
    check_source_files(reader)  # the committed headers are the ones in use
    specs = [s for r in targets for s in plan[r]]
    hashed_specs, nread = checked_source_checksums(reader, specs, progress=progress)
    hashed = iter(hashed_specs)
    rank_states = reader.rank_states()
    buf = TensorBuffer()

    def fill(spec: ChunkSpec, out, row: int) -> None:  # noqa: ANN001 (a torch.Tensor: torch is imported by the reader)
        offsets = (spec.offsets[0] + row, *spec.offsets[1:]) if spec.offsets else spec.offsets
        # Unverified region reads: pass 2 checks every chunk it writes against pass 1's digest,
        # hashed from source chunks checked whole (as ``ops.transform.reshard`` does).
        reader.read_into_unverified(ReadJob(spec.name, out, offsets))
        if progress:
            progress(out.numel() * out.element_size())

    for r in targets:
        shard = [next(hashed) for _ in plan[r]]
        w = write_shard_streaming(dst, shard_name(r, world_size), shard, fill, rank=r, rank_state=rank_states.get(r), buffer=buf)
        written.append(w.file)
        nread += w.bytes_read
    return nread


def _committed(m: Manifest, plan: list[list[ChunkSpec]], files: list[FileEntry], world_size: int, src_url: str,
               seconds: float) -> Committed:
    """The manifest of the re-sharded checkpoint (as ``ops.transform.reshard`` writes it) and
    its marker, as the bytes every node leader commits."""
    counts: dict[str, int] = {}
    for specs in plan:
        for s in specs:
            counts[s.name] = counts.get(s.name, 0) + 1
    manifest = Manifest.new(
        m.step, world_size, files,
        {name: TensorEntry(t.dtype, t.shape, t.group, counts.get(name, 0)) for name, t in m.tensors.items()},
        m.state,
        {"bytes": float(sum(f.size for f in files)), "reshard_s": seconds},
        extra={**m.extra, "resharded_from": {"url": src_url, "world_size": m.world_size}},
    )
    raw = manifest.to_json()
    marker = Marker.for_manifest(m.step, raw, MANIFEST)
    return Committed(manifest, marker, raw, marker.to_json())


def _read_back(dst: Storage, manifest: Manifest, written: list[FileEntry]) -> list[Problem]:
    problems: list[Problem] = []
    for f in written:
        h = check_file(dst, f, manifest, problems)
        if h is not None:
            problems.extend(stream_file(dst, f, h)[0])
    return problems


def _take_back(dst: Storage, written: list[FileEntry]) -> None:
    """Delete the target shards this rank wrote (nothing was committed). A file that cannot be
    deleted stays: no marker names it, and a rerun replaces it."""
    for f in written:
        try:
            dst.delete(f.name)
        except (StorageError, OSError):
            return
