"""Chunk geometry: boxes inside a global tensor, their intersections, and coverage.

A *box* is a region of a global tensor given by where it starts (``offsets``) and its extent
(``shape``), one entry per dimension; a 0-d tensor's only box is ``Box((), ())``, holding its
single element. Every chunk of a checkpoint, every region a loader asks for, and every chunk a
re-shard writes is a box. This module is the one place that computes with them: pure integer
arithmetic, no torch and no I/O, so the verifier can use it without importing torch.

The coverage check (``coverage_problems``) is what proves that the chunks of a tensor hold
every element exactly once: every box lies inside the tensor, no two boxes share an element,
and the volumes add up to the tensor's element count. The first two imply the boxes are
disjoint subsets of the tensor, so with the third they partition it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

MAX_REPORTED = 5  # overlapping pairs named per tensor; the count says how many there were


@dataclass(frozen=True)
class Box:
    """A region of a global tensor: ``shape`` elements from ``offsets`` on, per dimension."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        """One past the last index, per dimension."""
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def relative_to(self, outer: "Box") -> "Box":
        """This box with offsets counted from ``outer``'s start (for indexing into ``outer``)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Index this box out of a tensor whose origin is the global origin."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def __str__(self) -> str:
        return f"{list(self.shape)} at {list(self.offsets)}"


def box(offsets: Iterable[int], shape: Iterable[int]) -> Box:
    """A ``Box`` from any integer sequences (JSON lists, ``torch.Size``)."""
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in shape))


def numel(shape: Sequence[int]) -> int:
    """Elements in a tensor of ``shape`` (1 for a 0-d tensor)."""
    return math.prod(shape)


def intersection(a: Box, b: Box) -> Box | None:
    """The elements ``a`` and ``b`` share, as a box, or None when they share none (boxes of
    different rank never intersect; two 0-d boxes are the same single element)."""
    if a.ndim != b.ndim:
        return None
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x, y) for x, y in zip(a.end, b.end))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return Box(lo, tuple(h - l for l, h in zip(lo, hi)))


def fits(b: Box, shape: Sequence[int]) -> bool:
    """Whether ``b`` lies inside a tensor of ``shape``: same rank, offsets and extents not
    negative, and it ends within the tensor on every dimension."""
    return (
        b.ndim == len(shape) == len(b.offsets)
        and all(o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(b.offsets, b.shape, shape))
    )


def contiguous_in(inner: Box, outer: Box) -> bool:
    """Whether ``inner`` (inside ``outer``) is one contiguous run of ``outer``'s row-major
    elements: it spans ``outer`` fully on every dimension after the first one it does not
    span fully, and covers one index of each dimension before that one. Such a region can be
    read or written in place through a flat view of ``outer``."""
    if inner.numel == 0:
        return True
    d = 0  # leading dimensions where inner is a single index
    while d < inner.ndim and inner.shape[d] == 1:
        d += 1
    # From the first dimension not of size 1 on, only that dimension may be partial.
    return all(inner.offsets[k] == outer.offsets[k] and inner.shape[k] == outer.shape[k] for k in range(d + 1, inner.ndim))


@dataclass(frozen=True)
class CoverageProblem:
    """One way a tensor's boxes fail to cover it exactly once."""

    kind: str  # "outside", "overlap" or "volume"
    message: str


def coverage_problems(shape: Sequence[int], boxes: Sequence[Box]) -> list[CoverageProblem]:
    """What keeps ``boxes`` from covering a tensor of ``shape`` exactly once; empty when they do.

    Checks, in this order: every box fits the tensor (``outside``), no two boxes with elements
    share one (``overlap``, at most ``MAX_REPORTED`` pairs named), and the volumes add up to
    the tensor's element count (``volume``: a gap, when nothing overlaps).

    Cost: a sort of the boxes, then a sweep along one dimension, the one whose start offsets
    take the most distinct values (dim 0 for row sharding, dim 1 for column sharding), that
    compares a box only with the boxes whose range on that dimension overlaps its own. For
    tilings split along one dimension that is O(n log n); for a p x q grid tiling it is
    O(n log n + n * q) where q is the number of boxes in a band across the sweep dimension;
    the worst case (boxes that overlap on the sweep dimension but nowhere else) is O(n^2),
    no worse than comparing every pair.
    """
    shape = tuple(shape)
    problems: list[CoverageProblem] = []
    inside: list[Box] = []
    for b in boxes:
        if fits(b, shape):
            inside.append(b)
        else:
            problems.append(CoverageProblem("outside", f"chunk {b} does not fit the tensor's shape {list(shape)}"))
    overlaps = _overlapping_pairs(inside)
    for a, b in overlaps[:MAX_REPORTED]:
        problems.append(CoverageProblem("overlap", f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap"))
    if len(overlaps) > MAX_REPORTED:
        problems.append(CoverageProblem("overlap", f"{len(overlaps) - MAX_REPORTED} more overlapping pairs of chunks"))
    total, want = sum(b.numel for b in boxes), numel(shape)
    if total != want:
        problems.append(CoverageProblem("volume", f"chunks cover {total} of {want} elements"))
    return problems


def _overlapping_pairs(boxes: Sequence[Box]) -> list[tuple[Box, Box]]:
    """Every pair of boxes (same rank, inside one tensor) that share an element."""
    full = [b for b in boxes if b.numel > 0]  # an empty box shares nothing
    if len(full) < 2:
        return []
    if full[0].ndim == 0:  # every 0-d box is the tensor's one element
        return [(full[0], b) for b in full[1:]]
    dim = max(range(full[0].ndim), key=lambda d: len({b.offsets[d] for b in full}))
    order = sorted(full, key=lambda b: b.offsets[dim])
    pairs: list[tuple[Box, Box]] = []
    active: dict[int, Box] = {}  # boxes whose range on ``dim`` may still meet a later box
    ends: list[tuple[int, int]] = []  # (end on dim, key in active): a heap, to retire boxes
    for key, b in enumerate(order):
        start = b.offsets[dim]
        while ends and ends[0][0] <= start:  # ranges are half-open: ending at start is no overlap
            active.pop(heapq.heappop(ends)[1], None)
        for other in active.values():
            if intersection(other, b) is not None:
                pairs.append((other, b))
        active[key] = b
        heapq.heappush(ends, (start + b.shape[dim], key))
    return pairs
