"""What rank 0 decides in a save's round, from what the ranks reported alone.

Pure bookkeeping, no collective: the ``Coordinator`` gathers the reports and sums the coverage
vectors over its group, then asks this module what to do and broadcasts the answer. An answer
is ``(action, message)``: ``fail`` (naming the ranks and why), ``replicas`` (their digests
differ: find out which tensors), ``plan`` (a layout changed: sum the coverage first) or
``commit``. Rank 0's work here grows with ranks + tensors, never ranks x tensors
(``scripts/sim_scale.py`` measures it).
"""

from __future__ import annotations

import torch

from ckptctl.format.geometry import numel
from ckptctl.format.manifest import FileEntry, TensorEntry
from ckptctl.save.messages import RankReport
from ckptctl.save.replicas import ranks_text as _ranks
from ckptctl.save.shard_layout import ShardLayout, placement_hints

Answer = tuple[str, str]


def decide(gathered: list | None, structure: str, checked: str | None, *, replicas_checked: bool = False) -> Answer:
    """Fail, compare replicas, plan, or commit. ``structure``: rank 0's layout's;
    ``checked``: the structure whose coverage was last checked (None: none yet)."""
    reports = [RankReport(**{**r, "file": FileEntry(**r["file"]) if r["file"] else None}) for r in gathered or []]
    failed = [r for r in reports if r.error is not None]
    if failed:
        return "fail", f"step {reports[0].step}: {_ranks([r.rank for r in failed])} failed: " + "; ".join(
            f"rank {r.rank}: {r.error}" for r in failed[:8]
        ) + (f"; and {len(failed) - 8} more" if len(failed) > 8 else "")
    steps = sorted({r.step for r in reports})
    if len(steps) > 1:  # saves out of step: never mix shards of different saves
        return "fail", f"ranks are saving different steps {steps}; every rank must call save() with the same step"
    odd = [r.rank for r in reports if r.structure != reports[0].structure]
    if odd:
        return "fail", (
            f"step {steps[0]}: the state's tensors (names, dtypes or global shapes) differ between "
            f"rank 0 and {_ranks(odd)}; every rank must save the same state structure"
        )
    if not replicas_checked and len({r.replicas for r in reports}) > 1:
        return "replicas", ""
    if any(r.replanned for r in reports) or checked != structure:
        return "plan", ""
    return "commit", ""


def covered(step: int, layout: ShardLayout, cov: torch.Tensor, world_size: int) -> tuple[dict[str, TensorEntry] | None, str]:
    """The manifest's tensor table from every rank's (chunks, elements, regular, owner + 1)
    per tensor, summed over the ranks; None and the failure when the shards do not cover
    every tensor exactly once."""
    tensors: dict[str, TensorEntry] = {}
    bad: list[str] = []
    for meta, (chunks, elements, regular, owner1) in zip(layout.table, cov.tolist()):
        if elements != numel(meta.shape):
            bad.append(f"{meta.name!r} ({elements} of {numel(meta.shape)} elements)")
        owner, split = placement_hints(meta.shape, chunks, regular, owner1, world_size)
        tensors[meta.name] = TensorEntry(meta.dtype, meta.shape, meta.group, int(chunks), owner, split)
    if bad:
        return None, (
            f"step {step}: the ranks' shards do not cover {len(bad)} tensors exactly once, e.g. "
            + ", ".join(bad[:3])
            + "; a tensor assumed replicated may have a different shape on some rank"
        )
    return tensors, ""


def merged_stats(gathered: list[dict]) -> dict[str, float]:
    """The save's statistics for its manifest: the slowest rank bounds the save, so each
    timing is the maximum over the ranks, and ``bytes`` the total."""
    stats: dict[str, float] = {}
    for r in gathered:
        for k, v in r["stats"].items():
            stats[k] = stats.get(k, 0.0) + v if k == "bytes" else max(stats.get(k, 0.0), v)
    stats["ranks"] = float(len(gathered))
    return stats
