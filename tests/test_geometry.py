"""Chunk geometry (``ckptctl.format.geometry``): intersections, fitting, contiguity, and the
coverage check that proves a tensor's chunks hold every element exactly once."""

from __future__ import annotations

import itertools
import math
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.format.geometry import Box, contiguous_in, coverage_problems, fits, intersection, numel


def kinds(problems) -> set[str]:
    return {p.kind for p in problems}


def test_intersection_of_overlapping_disjoint_touching_and_0d_boxes():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (4, 4))
    assert intersection(a, b) == Box((2, 3), (2, 1))
    assert intersection(a, Box((4, 0), (1, 4))) is None  # touching edges share nothing
    assert intersection(a, Box((0,), (4,))) is None  # different rank
    assert intersection(Box((), ()), Box((), ())) == Box((), ())
    assert intersection(a, Box((1, 1), (0, 2))) is None  # an empty box


def test_fits_checks_rank_sign_and_bounds():
    assert fits(Box((2, 0), (2, 5)), (4, 5))
    assert not fits(Box((3, 0), (2, 5)), (4, 5))
    assert not fits(Box((-1, 0), (1, 5)), (4, 5))
    assert not fits(Box((0,), (4,)), (4, 5))
    assert fits(Box((), ()), ())
    assert numel(()) == 1 and numel((3, 0)) == 0


def test_contiguous_regions_of_a_row_major_tensor():
    outer = Box((0, 0, 0), (4, 3, 2))
    assert contiguous_in(Box((1, 0, 0), (2, 3, 2)), outer)  # whole rows
    assert contiguous_in(Box((1, 1, 0), (1, 2, 2)), outer)  # part of one row, whole below
    assert contiguous_in(Box((1, 1, 1), (1, 1, 1)), outer)  # one element
    assert not contiguous_in(Box((1, 0, 0), (2, 2, 2)), outer)  # two partial rows
    assert not contiguous_in(Box((1, 1, 0), (1, 2, 1)), outer)


def test_exact_cover_gap_overlap_and_outside_are_told_apart():
    rows = [Box((0, 0), (3, 4)), Box((3, 0), (2, 4))]
    assert coverage_problems((5, 4), rows) == []
    assert kinds(coverage_problems((5, 4), rows[:1])) == {"volume"}
    over = coverage_problems((5, 4), [Box((0, 0), (3, 4)), Box((2, 0), (3, 4))])
    assert kinds(over) == {"overlap", "volume"} and "chunks at [0, 0] and [2, 0] overlap" in over[0].message
    out = coverage_problems((5, 4), [Box((0, 0), (3, 4)), Box((3, 0), (3, 4))])
    assert "outside" in kinds(out)
    # A gap and an overlap of equal volume: the sum alone would pass, the overlap does not.
    assert "overlap" in kinds(coverage_problems((4,), [Box((0,), (2,)), Box((1,), (2,))]))
    assert coverage_problems((), [Box((), ())]) == []
    assert kinds(coverage_problems((), [Box((), ()), Box((), ())])) == {"overlap", "volume"}
    assert coverage_problems((0, 3), []) == []  # an empty tensor needs no chunk


def test_empty_chunks_never_overlap_anything():
    assert coverage_problems((2, 3), [Box((0, 0), (2, 3)), Box((1, 0), (0, 3)), Box((2, 0), (0, 3))]) == []


@st.composite
def grid_tilings(draw):
    """A tensor shape and a tiling of it by a grid of cuts on every dimension."""
    ndim = draw(st.integers(1, 3))
    shape, cuts = [], []
    for _ in range(ndim):
        n = draw(st.integers(1, 12))
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3)) if n > 1 else set())
        shape.append(n)
        cuts.append([0, *inner, n])
    boxes = [
        Box(tuple(c[0] for c in cell), tuple(c[1] - c[0] for c in cell))
        for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts])
    ]
    order = draw(st.permutations(boxes))
    return tuple(shape), list(order)


@settings(max_examples=300, deadline=None)
@given(grid_tilings())
def test_random_grid_tilings_cover_exactly(tiling):
    shape, boxes = tiling
    assert coverage_problems(shape, boxes) == []


@settings(max_examples=300, deadline=None)
@given(grid_tilings(), st.data())
def test_removing_a_chunk_is_detected(tiling, data):
    shape, boxes = tiling
    i = data.draw(st.integers(0, len(boxes) - 1))
    assert coverage_problems(shape, boxes[:i] + boxes[i + 1 :]) != []


@settings(max_examples=300, deadline=None)
@given(grid_tilings(), st.data())
def test_duplicating_a_chunk_is_detected(tiling, data):
    shape, boxes = tiling
    i = data.draw(st.integers(0, len(boxes) - 1))
    assert "overlap" in kinds(coverage_problems(shape, boxes + [boxes[i]]))


@settings(max_examples=300, deadline=None)
@given(grid_tilings(), st.data())
def test_shifting_a_chunk_is_detected(tiling, data):
    shape, boxes = tiling
    i = data.draw(st.integers(0, len(boxes) - 1))
    d = data.draw(st.integers(0, len(shape) - 1))
    delta = data.draw(st.sampled_from([-1, 1]))
    b = boxes[i]
    moved = Box(tuple(o + (delta if k == d else 0) for k, o in enumerate(b.offsets)), b.shape)
    found = coverage_problems(shape, boxes[:i] + [moved] + boxes[i + 1 :])
    # Moving a box always uncovers an element: it lands outside or on a neighbour.
    assert kinds(found) & {"outside", "overlap"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4)), max_size=8))
def test_overlaps_found_by_the_sweep_are_exactly_the_pairwise_ones(raw):
    boxes = [Box((a, c), (b, d)) for a, b, c, d in raw]
    pairwise = sum(1 for x, y in itertools.combinations(boxes, 2) if intersection(x, y) is not None)
    found = [p for p in coverage_problems((10, 10), boxes) if p.kind == "overlap"]
    if pairwise <= 5:
        assert len(found) == pairwise
    else:
        assert found[-1].message.startswith(f"{pairwise - 5} more")


def test_coverage_of_many_chunks_is_not_quadratic():
    # 20,000 row chunks and 20,000 column chunks: a pairwise check makes 2 x 2e8 comparisons.
    rows = [Box((i, 0), (1, 8)) for i in range(20_000)]
    cols = [Box((0, i), (8, 1)) for i in range(20_000)]
    t0 = time.perf_counter()
    assert coverage_problems((20_000, 8), rows) == []
    assert coverage_problems((8, 20_000), cols) == []
    assert time.perf_counter() - t0 < 5.0
    assert math.prod((20_000, 8)) == sum(b.numel for b in rows)
