"""Checkpoint interval maths: Young, Daly, expected waste, warnings and input checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ckptctl.errors import EXIT_USAGE, UsageError
from ckptctl.ops.interval import (
    IntervalAdvice,
    advise,
    cost_from_stalls,
    daly_interval,
    waste_fraction,
    young_interval,
)

seconds = st.floats(min_value=1e-3, max_value=1e7, allow_nan=False, allow_infinity=False)


def exact_optimum(cost: float, mtbf: float) -> float:
    """The interval minimising Daly's complete cost model, found numerically.

    d/dT of (e^((T+C)/M) - 1) / T = 0 gives e^((T+C)/M) (1 - T/M) = 1; with x = T/M, d = C/M:
    g(x) = x + d + log(1 - x) = 0, g(0) = d > 0, g decreasing on (0, 1): bisect.
    """
    d = cost / mtbf
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid + d + math.log1p(-mid) > 0:
            lo = mid
        else:
            hi = mid
    return mtbf * (lo + hi) / 2


# --- known values ----------------------------------------------------------------------------


def test_young_by_hand() -> None:
    # 2 * 60 * 86400 = 10_368_000; sqrt = 3219.9379
    assert young_interval(60, 86400) == pytest.approx(3219.9379, abs=1e-4)
    assert young_interval(60, 86400) == math.sqrt(2 * 60 * 86400)


def test_daly_by_hand() -> None:
    # xi = 60 / (2 * 86400) = 3.4722e-4, sqrt(xi) = 0.0186339
    # 3219.9379 * (1 + 0.0186339/3 + 3.4722e-4/9) - 60 = 3219.9379 * 1.0062499 - 60 = 3180.0621
    cost, mtbf = 60.0, 86400.0
    xi = cost / (2 * mtbf)
    expected = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(xi) / 3 + xi / 9) - cost
    assert daly_interval(cost, mtbf) == pytest.approx(expected, rel=1e-12)
    assert daly_interval(cost, mtbf) == pytest.approx(3180.0621, abs=1e-3)


@pytest.mark.parametrize(
    ("mtbf_min", "expected_min", "tolerance"),
    [
        (24 * 60, 117, 0.5),  # Daly 2006, Fig. 3: delta = 5 min, M = 24 h -> 117 min
        (6 * 60, 57, 0.5),  # Fig. 4: M = 6 h -> 57 min
        (15, 9.1, 0.05),  # Fig. 5: M = 15 min -> 9.1 min
    ],
)
def test_daly_matches_the_papers_examples(
    mtbf_min: float, expected_min: float, tolerance: float
) -> None:
    assert daly_interval(5 * 60, mtbf_min * 60) / 60 == pytest.approx(expected_min, abs=tolerance)


@pytest.mark.parametrize(("cost", "mtbf"), [(2.0, 1.0), (10.0, 1.0), (7200.0, 3600.0)])
def test_daly_is_mtbf_when_cost_reaches_twice_mtbf(cost: float, mtbf: float) -> None:
    assert daly_interval(cost, mtbf) == mtbf


def test_waste_by_hand() -> None:
    t, cost, mtbf = 3180.0621, 60.0, 86400.0
    expected = 1 - (t / mtbf) / (math.exp((t + cost) / mtbf) - 1)
    assert waste_fraction(t, cost, mtbf) == pytest.approx(expected, rel=1e-9)
    assert waste_fraction(t, cost, mtbf) == pytest.approx(0.03681, abs=1e-5)
    # For C << M the exact model agrees with the first-order C/T + (T+C)/(2M) (0.0376) to ~2%.
    first_order = cost / t + (t + cost) / (2 * mtbf)
    assert waste_fraction(t, cost, mtbf) == pytest.approx(first_order, rel=0.03)


def test_advise_fields() -> None:
    a = advise(60, 86400)
    assert isinstance(a, IntervalAdvice)
    assert (a.cost_s, a.mtbf_s, a.write_s) == (60.0, 86400.0, None)
    assert a.young_s == pytest.approx(3219.9379, abs=1e-4)
    assert a.daly_s == pytest.approx(3180.0621, abs=1e-3)
    assert a.waste_fraction_young == pytest.approx(waste_fraction(a.young_s, 60, 86400))
    assert a.waste_fraction_daly == pytest.approx(waste_fraction(a.daly_s, 60, 86400))
    assert a.waste_fraction_daly < a.waste_fraction_young
    assert a.warnings == ()
    assert a.recommended_s == a.daly_s


# --- properties ------------------------------------------------------------------------------


@given(seconds, seconds, st.floats(1.01, 100))
def test_young_grows_with_cost_and_mtbf(cost: float, mtbf: float, factor: float) -> None:
    assert young_interval(cost * factor, mtbf) > young_interval(cost, mtbf)
    assert young_interval(cost, mtbf * factor) > young_interval(cost, mtbf)


@given(seconds, st.floats(1e-6, 1.9), st.floats(1.01, 100))
def test_daly_grows_with_cost_and_mtbf_below_the_cutoff(
    mtbf: float, ratio: float, factor: float
) -> None:
    # Monotonic inside the series' domain C < 2M; the published piecewise form jumps at C = 2M.
    # The cost is drawn below the cutoff (not filtered with assume(), which starved hypothesis).
    cost = mtbf * ratio / factor
    assume(cost > 0)
    assert daly_interval(cost * factor, mtbf) > daly_interval(cost, mtbf)
    assert daly_interval(cost, mtbf * factor) > daly_interval(cost, mtbf)


@given(seconds, seconds)
def test_daly_is_positive_and_shorter_than_young(cost: float, mtbf: float) -> None:
    assume(cost < 2 * mtbf)
    # Daly - Young = C (sqrt(xi)/9 - 2/3) < 0 for xi < 1.
    assert 0 < daly_interval(cost, mtbf) < young_interval(cost, mtbf)


@given(st.floats(1e-6, 1.0), st.floats(1.0, 1e7))
def test_daly_is_a_higher_order_approximation_of_the_true_optimum(
    ratio: float, mtbf: float
) -> None:
    cost = ratio * mtbf
    truth = exact_optimum(cost, mtbf)
    # The error of Daly's series shrinks like (C/M)^1.5 (~1.8% at C = M, ~1e-5 at C = M/100).
    assert abs(daly_interval(cost, mtbf) / truth - 1) <= 0.02 * ratio**1.5 + 1e-9
    # And neither Young nor Daly does better than the true optimum.
    best = waste_fraction(truth, cost, mtbf)
    assert waste_fraction(daly_interval(cost, mtbf), cost, mtbf) >= best - 1e-12
    assert waste_fraction(young_interval(cost, mtbf), cost, mtbf) >= best - 1e-12


@given(seconds, seconds, seconds)
def test_waste_is_a_fraction(interval: float, cost: float, mtbf: float) -> None:
    assert 0 <= waste_fraction(interval, cost, mtbf) <= 1


@given(seconds, seconds, seconds, st.floats(1.01, 100))
def test_waste_grows_with_cost_and_shrinks_with_mtbf(
    interval: float, cost: float, mtbf: float, factor: float
) -> None:
    base = waste_fraction(interval, cost, mtbf)
    assume(1e-9 < base < 1 - 1e-9)  # away from float saturation at both ends
    assert waste_fraction(interval, cost * factor, mtbf) >= base
    assert waste_fraction(interval, cost, mtbf * factor) <= base


def test_waste_does_not_overflow() -> None:
    assert waste_fraction(1e6, 1e6, 1.0) == 1.0


# --- warnings --------------------------------------------------------------------------------


def test_write_longer_than_interval_warns() -> None:
    a = advise(cost_s=10, mtbf_s=86400, write_s=3600)
    # Daly for C = 10 s, M = 24 h is 1307.9 s = 21m 48s.
    assert a.daly_s == pytest.approx(1307.876, abs=1e-3)
    assert len(a.warnings) == 1
    assert a.warnings[0].startswith(
        "the background write (1h) is longer than the interval (21m 48s): "
        "each save would wait for the previous one; checkpoint every 1h instead"
    )
    assert a.recommended_s == 3600
    assert a.write_s == 3600.0


def test_write_shorter_than_interval_is_fine() -> None:
    a = advise(cost_s=10, mtbf_s=86400, write_s=600)
    assert a.warnings == ()
    assert a.recommended_s == a.daly_s


@given(seconds, seconds, seconds)
def test_write_warning_exactly_when_write_exceeds_daly(
    cost: float, mtbf: float, write: float
) -> None:
    a = advise(cost, mtbf, write)
    warned = any(w.startswith("the background write") for w in a.warnings)
    assert warned == (write > a.daly_s)
    assert a.recommended_s == max(a.daly_s, write)


def test_cost_at_least_mtbf_warns() -> None:
    a = advise(cost_s=3600, mtbf_s=3600)
    assert len(a.warnings) == 1
    assert a.warnings[0].startswith("the checkpoint cost (1h) is at least the MTBF (1h): about ")
    assert f"{a.waste_fraction_daly:.0%}" in a.warnings[0]
    assert advise(cost_s=3599, mtbf_s=3600).warnings == ()


def test_both_warnings() -> None:
    a = advise(cost_s=7200, mtbf_s=3600, write_s=7200)
    assert a.daly_s == 3600
    assert [w.split(" (")[0] for w in a.warnings] == [
        "the background write",
        "the checkpoint cost",
    ]


# --- input checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"cost_s": 0, "mtbf_s": 3600}, "--cost"),
        ({"cost_s": -5, "mtbf_s": 3600}, "--cost"),
        ({"cost_s": float("nan"), "mtbf_s": 3600}, "--cost"),
        ({"cost_s": float("inf"), "mtbf_s": 3600}, "--cost"),
        ({"cost_s": 60, "mtbf_s": 0}, "--mtbf"),
        ({"cost_s": 60, "mtbf_s": -1}, "--mtbf"),
        ({"cost_s": "60", "mtbf_s": 3600}, "--cost"),
        ({"cost_s": 60, "mtbf_s": 3600, "write_s": 0}, "write time"),
        ({"cost_s": 60, "mtbf_s": 3600, "write_s": -1.0}, "write time"),
    ],
)
def test_bad_inputs_are_usage_errors(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(UsageError) as info:
        advise(**kwargs)  # type: ignore[arg-type]
    assert info.value.exit_code == EXIT_USAGE
    assert str(info.value).startswith(name + " must be")
    assert "\n" not in str(info.value)
    assert info.value.hint


def test_bad_interval_for_waste() -> None:
    with pytest.raises(UsageError, match="interval must be a positive duration"):
        waste_fraction(0, 60, 3600)


# --- cost from stalls ------------------------------------------------------------------------


def test_cost_from_stalls_is_the_median() -> None:
    assert cost_from_stalls([3.0, 1.0, 2.0]) == 2.0
    assert cost_from_stalls([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert cost_from_stalls([7.5]) == 7.5


def test_cost_from_stalls_ignores_an_outlier() -> None:
    stalls = [5.0] * 20 + [600.0]
    assert cost_from_stalls(stalls) == 5.0
    assert sum(stalls) / len(stalls) == pytest.approx(33.33, abs=0.01)  # what the mean would say


@given(st.lists(st.floats(0.001, 1e5), min_size=1, max_size=50), st.randoms(use_true_random=False))
def test_cost_from_stalls_is_order_free_and_within_range(
    stalls: list[float], rnd: object
) -> None:
    shuffled = list(stalls)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert cost_from_stalls(shuffled) == cost_from_stalls(stalls)
    assert min(stalls) <= cost_from_stalls(stalls) <= max(stalls)


def test_cost_from_no_stalls_asks_for_cost() -> None:
    with pytest.raises(UsageError) as info:
        cost_from_stalls([])
    assert info.value.hint is not None and "--cost" in info.value.hint


def test_cost_from_zero_stalls_asks_for_cost() -> None:
    with pytest.raises(UsageError, match="zero"):
        cost_from_stalls([0.0, 0.0, 1.0])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_cost_from_bad_stalls(bad: float) -> None:
    with pytest.raises(ValueError):
        cost_from_stalls([1.0, bad])
