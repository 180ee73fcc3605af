"""Save statistics recorded in a root's manifests, and the interval advice they imply.

Every committed manifest records ``stats.stall_s`` (how long ``save()`` blocked training: the
host copy) and ``stats.write_s`` (the background write). ``ckptctl interval ROOT`` takes the
checkpoint cost C from the recent stalls, not from the write: with asynchronous saves the job
only loses the stall; the write bounds the interval from below instead.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ckptctl.errors import UsageError
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, newest_committed
from ckptctl.ops.interval import IntervalAdvice, advise, cost_from_stalls
from ckptctl.storage.base import Storage

RECENT = 20  # the cost changes with the model and the hardware: look at recent saves only


@dataclass(frozen=True)
class SaveStats:
    """Stalls and writes (seconds) of the most recent committed checkpoints, newest first."""

    steps: tuple[int, ...]
    stalls: tuple[float, ...]
    writes: tuple[float, ...]

    def to_dict(self) -> dict[str, object]:
        return {"steps": list(self.steps), "stall_s": list(self.stalls), "write_s": list(self.writes)}


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def recent_save_stats(root: Storage, limit: int = RECENT) -> SaveStats:
    """Read the manifests of up to ``limit`` newest committed checkpoints (no shard data)."""
    steps: list[int] = []
    stalls: list[float] = []
    writes: list[float] = []
    # Committed ones only: a partial or damaged checkpoint says nothing reliable about saving.
    for e in newest_committed(root, layouts=CHECKPOINTER_LAYOUTS):
        if len(steps) >= limit:
            break
        manifest = e.manifest
        if manifest is None:
            continue
        steps.append(manifest.step)
        stall, write = _seconds(manifest.stats.get("stall_s")), _seconds(manifest.stats.get("write_s"))
        if stall is not None:
            stalls.append(stall)
        if write is not None:
            writes.append(write)
    return SaveStats(tuple(steps), tuple(stalls), tuple(writes))


def advise_from_root(root: Storage, mtbf_s: float, *, cost_s: float | None = None, limit: int = RECENT) -> tuple[IntervalAdvice, SaveStats]:
    """Interval advice with C = the median recent stall (unless ``cost_s`` is given) and the
    median recent background write as the lower bound to warn about."""
    stats = recent_save_stats(root, limit)
    if cost_s is None and not stats.stalls:
        raise UsageError(
            f"{root.url}: no committed checkpoint records a stall time to take the cost from",
            hint="pass --cost DURATION, the time training is blocked per save (e.g. --cost 30s)",
        )
    cost = cost_s if cost_s is not None else cost_from_stalls(stats.stalls)
    write = statistics.median(stats.writes) if stats.writes else None
    return advise(cost, mtbf_s, write if write else None), stats
