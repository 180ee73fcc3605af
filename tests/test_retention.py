"""Retention policies: what is kept, why, and that nothing depends on input order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptctl.errors import EXIT_USAGE, UsageError
from ckptctl.ops.retention.policies import (
    ANCHOR_REASON,
    Candidate,
    Decision,
    InvalidPolicy,
    KeepEvery,
    KeepLast,
    KeepSteps,
    KeepWithin,
    Policy,
    RetentionPolicy,
    from_options,
)

NO_POLICY = ("no retention policy given; pass --keep-last, --keep-every, --keep-within, "
             "--keep-hourly/-daily/-weekly/-monthly, --keep-best or --keep")


# --- strategies ----------------------------------------------------------------------------


@st.composite
def candidate_lists(draw: st.DrawFn, min_size: int = 0) -> list[Candidate]:
    # Small step range so that keep-every and pinned steps actually hit candidates.
    steps = draw(st.lists(st.integers(0, 20_000), unique=True, min_size=min_size, max_size=25))
    times = draw(
        st.lists(
            st.floats(0, 2e9, allow_nan=False), min_size=len(steps), max_size=len(steps)
        )
    )
    return [Candidate(step, time) for step, time in zip(steps, times)]


policies_st = st.one_of(
    st.integers(1, 10).map(KeepLast),
    st.integers(1, 5_000).map(KeepEvery),
    st.floats(0, 1e9, allow_nan=False).map(KeepWithin),
    st.frozensets(st.integers(0, 20_000), min_size=1, max_size=5).map(KeepSteps),
)


@st.composite
def scenario(draw: st.DrawFn) -> tuple[list[Candidate], RetentionPolicy, int | None]:
    cands = draw(candidate_lists(min_size=1))
    policy = RetentionPolicy(draw(st.lists(policies_st, min_size=1, max_size=4)))
    anchor = draw(st.none() | st.sampled_from([c.step for c in cands]))
    return cands, policy, anchor


def c(step: int, time: float = 0.0) -> Candidate:
    return Candidate(step, time)


# --- properties ----------------------------------------------------------------------------


@given(scenario())
def test_anchor_is_always_kept(case: tuple[list[Candidate], RetentionPolicy, int | None]) -> None:
    cands, policy, anchor = case
    decisions = policy.decide(cands, anchor_step=anchor)
    if anchor is not None:
        assert decisions[anchor].keep
        assert decisions[anchor].reasons[0] == ANCHOR_REASON


@given(scenario(), st.randoms(use_true_random=False))
def test_decision_does_not_depend_on_input_order(
    case: tuple[list[Candidate], RetentionPolicy, int | None], rnd: object
) -> None:
    cands, policy, anchor = case
    shuffled = list(cands)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    first = policy.decide(cands, anchor_step=anchor)
    second = policy.decide(shuffled, anchor_step=anchor)
    # Same decisions, and the same (ascending) order of steps.
    assert list(first.items()) == list(second.items())
    assert list(first) == sorted(c.step for c in cands)


@given(scenario())
def test_kept_exactly_when_a_policy_or_the_anchor_keeps(
    case: tuple[list[Candidate], RetentionPolicy, int | None],
) -> None:
    cands, policy, anchor = case
    decisions = policy.decide(cands, anchor_step=anchor)
    assert set(decisions) == {c.step for c in cands}
    by_policy = [p.reasons(cands) for p in policy.policies]
    for step, decision in decisions.items():
        expected = step == anchor or any(step in kept for kept in by_policy)
        assert decision.keep == expected
        # Deleted steps carry no reason; kept ones at least one.
        assert bool(decision.reasons) == decision.keep
    # A step kept by a policy gets that policy's reason.
    for p, kept in zip(policy.policies, by_policy):
        for step, reason in kept.items():
            assert reason == p.label
            assert reason in decisions[step].reasons


@given(candidate_lists(), st.integers(1, 30))
def test_keep_last_keeps_exactly_the_n_highest(cands: list[Candidate], n: int) -> None:
    kept = KeepLast(n).reasons(cands)
    highest = sorted(c.step for c in cands)[-n:] if cands else []
    assert set(kept) == set(highest)
    assert len(kept) == min(n, len(cands))
    assert set(kept.values()) <= {f"keep-last {n}"}


@given(candidate_lists(), st.integers(1, 5_000))
def test_keep_every_keeps_the_multiples(cands: list[Candidate], every: int) -> None:
    kept = KeepEvery(every).reasons(cands)
    assert set(kept) == {c.step for c in cands if c.step % every == 0}


@given(candidate_lists(min_size=1), st.floats(0, 1e9, allow_nan=False))
def test_keep_within_measures_from_the_newest_candidate(
    cands: list[Candidate], window: float
) -> None:
    kept = KeepWithin(window).reasons(cands)
    newest = max(c.time for c in cands)
    assert set(kept) == {c.step for c in cands if newest - c.time <= window}
    # The newest candidate (by time) is always within any window.
    assert any(c.step in kept for c in cands if c.time == newest)


@given(
    st.lists(st.integers(0, 10**6), unique=True, min_size=1, max_size=20).flatmap(
        lambda steps: st.tuples(
            st.just(steps),
            st.lists(st.integers(0, 10**6), min_size=len(steps), max_size=len(steps)),
        )
    ),
    st.integers(0, 10**6),
    st.integers(0, 10**9),
)
def test_keep_within_ignores_the_clock(
    data: tuple[list[int], list[int]], window: int, shift: int
) -> None:
    # Integer times so shifting is exact: moving every checkpoint in time changes nothing.
    steps, times = data
    base = [Candidate(s, float(t)) for s, t in zip(steps, times)]
    moved = [Candidate(s, float(t + shift)) for s, t in zip(steps, times)]
    assert KeepWithin(window).reasons(base) == KeepWithin(window).reasons(moved)


# --- examples ------------------------------------------------------------------------------


def test_keep_within_uses_newest_time_not_highest_step() -> None:
    # Step 500 was written last (e.g. a rerun from an earlier step): the window hangs off it.
    cands = [c(100, 1000.0), c(900, 5000.0), c(500, 10_000.0)]
    kept = KeepWithin(6000).reasons(cands)
    assert kept == {900: "within 1h 40m of newest", 500: "within 1h 40m of newest"}


def test_keep_within_is_inclusive_and_labelled() -> None:
    cands = [c(1, 0.0), c(2, 1.0), c(3, 21600.0)]
    kept = KeepWithin(21600).reasons(cands)
    assert kept == {1: "within 6h of newest", 2: "within 6h of newest", 3: "within 6h of newest"}
    assert KeepWithin(21599.5).reasons(cands) == {
        2: "within 6h of newest",
        3: "within 6h of newest",
    }


def test_steps_compare_as_integers_not_strings() -> None:
    cands = [c(9000), c(10000), c(800)]
    assert KeepLast(1).reasons(cands) == {10000: "keep-last 1"}
    assert KeepLast(2).reasons(cands) == {9000: "keep-last 2", 10000: "keep-last 2"}


def test_product_scenario_newer_checkpoints_broken_anchor_survives() -> None:
    # Keep the last 3 while 4000..6000 exist but only 3000 verifies: the anchor and everything
    # newer survive (man/ckptctl-prune.1: failing newer checkpoints are reported, not deleted).
    cands = [c(s, float(s)) for s in (1000, 2000, 3000, 4000, 5000, 6000)]
    decisions = RetentionPolicy([KeepLast(3)]).decide(cands, anchor_step=3000)
    assert {s for s, d in decisions.items() if d.keep} == {3000, 4000, 5000, 6000}
    assert decisions[3000] == Decision(True, (ANCHOR_REASON,))
    assert decisions[6000] == Decision(True, ("keep-last 3",))
    assert decisions[2000] == Decision(False, ())
    assert decisions[1000] == Decision(False, ())


def test_reasons_are_anchor_first_then_policy_order_without_duplicates() -> None:
    cands = [c(1000, 0.0), c(2000, 100.0), c(3000, 200.0)]
    policy = RetentionPolicy(
        [KeepEvery(1000), KeepLast(1), KeepLast(1), KeepSteps(frozenset({3000}))]
    )
    decisions = policy.decide(cands, anchor_step=3000)
    assert decisions[3000].reasons == (ANCHOR_REASON, "keep-every 1000", "keep-last 1", "pinned")
    assert decisions[1000].reasons == ("keep-every 1000",)


def test_no_anchor_decides_by_policy_alone() -> None:
    cands = [c(1), c(2), c(3)]
    decisions = RetentionPolicy([KeepLast(1)]).decide(cands, anchor_step=None)
    assert [d.keep for d in decisions.values()] == [False, False, True]


def test_empty_candidates() -> None:
    assert RetentionPolicy([KeepLast(3)]).decide([], anchor_step=None) == {}
    assert KeepWithin(10).reasons([]) == {}


def test_pinned_steps_and_missing() -> None:
    cands = [c(1000), c(2000)]
    pinned = KeepSteps(frozenset({2000, 2500}))
    assert pinned.reasons(cands) == {2000: "pinned"}
    assert pinned.missing(cands) == frozenset({2500})
    # Any iterable is accepted and stored as a frozenset.
    assert KeepSteps([5, 5, 6]).steps == frozenset({5, 6})  # type: ignore[arg-type]


def test_describe() -> None:
    policy = from_options(keep_last=3, keep_every=1000, keep_within=6 * 3600.0, keep=[7])
    assert policy.describe() == "keep-last 3, keep-every 1000, within 6h of newest, pinned"
    assert all(isinstance(p, Policy) for p in policy.policies)


# --- refusals ------------------------------------------------------------------------------


def test_no_policies_is_a_value_error_and_no_options_a_usage_error() -> None:
    # The library says what is wrong with its own parameter; the CLI names its options.
    with pytest.raises(InvalidPolicy, match="RetentionPolicy: policies must be at least one rule"):
        RetentionPolicy([])
    # An exhausted iterator is "no policies" too, not an empty-but-valid rule set.
    with pytest.raises(ValueError, match="at least one rule"):
        RetentionPolicy(iter([]))
    with pytest.raises(UsageError) as info:
        from_options(None, None, None, ())
    assert str(info.value) == NO_POLICY
    assert info.value.exit_code == EXIT_USAGE
    assert info.value.hint


@pytest.mark.parametrize("keep", [(), [], iter(())])
def test_from_options_with_nothing_is_a_usage_error(keep: object) -> None:
    with pytest.raises(UsageError, match="no retention policy given"):
        from_options(None, None, None, keep=keep)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KeepLast(0), "KeepLast: n must be at least 1, got 0"),
        (lambda: KeepLast(-3), "KeepLast: n must be at least 1, got -3"),
        (lambda: KeepLast(2.5), "KeepLast: n must be a whole number, got 2.5"),
        (lambda: KeepLast(True), "KeepLast: n must be a whole number, got True"),
        (lambda: KeepEvery(0), "KeepEvery: steps must be at least 1, got 0"),
        (lambda: KeepEvery(-1000), "KeepEvery: steps must be at least 1"),
        (lambda: KeepWithin(-1.0), "KeepWithin: seconds must be a finite duration >= 0, got -1.0"),
        (lambda: KeepWithin(float("nan")), "KeepWithin: seconds must be"),
        (lambda: KeepWithin(float("inf")), "KeepWithin: seconds must be"),
        (lambda: KeepSteps(frozenset()), "KeepSteps: steps must be at least one step"),
        (lambda: KeepSteps(frozenset({-1})), "KeepSteps: steps must be at least 0, got -1"),
    ],
)
def test_a_bad_parameter_is_a_value_error_about_that_parameter(make: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make()  # type: ignore[operator]
    assert not isinstance(info.value, UsageError)
    assert str(info.value).startswith(message)
    assert "--" not in str(info.value)  # a library user typed no option


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: from_options(0, None, None, ()), "--keep-last must be at least 1, got 0"),
        (lambda: from_options(2.5, None, None, ()), "--keep-last must be a whole number, got 2.5"),
        (lambda: from_options(None, 0, None, ()), "--keep-every must be at least 1, got 0"),
        (lambda: from_options(None, None, -5.0, ()), "--keep-within must be a finite duration >= 0, got -5.0"),
        (lambda: from_options(None, None, None, ["3000"]), "--keep must be a whole number, got 3000"),
        (lambda: from_options(None, None, None, keep_weekly=0), "--keep-weekly must be at least 1, got 0"),
        (lambda: from_options(None, None, None, keep_best=0, metric="loss"), "--keep-best must be at least 1, got 0"),
        (lambda: from_options(None, None, None, keep_best=1, metric=""), "--metric must be a printable name"),
        (lambda: from_options(None, None, None, keep_best=1, metric="l", mode="low"),
         '--mode must be "min" or "max", got low'),
        (lambda: from_options(None, None, None, keep_best=1), "--keep-best needs --metric NAME"),
        (lambda: from_options(1, None, None, metric="loss"), "--metric is used only with --keep-best"),
        (lambda: from_options(1, None, None, mode="max"), "--mode is used only with --keep-best"),
    ],
)
def test_invalid_options_are_usage_errors_naming_the_option(make: object, message: str) -> None:
    with pytest.raises(UsageError) as info:
        make()  # type: ignore[operator]
    assert str(info.value).startswith(message)
    assert info.value.exit_code == EXIT_USAGE
    assert "\n" not in str(info.value)
    assert info.value.hint


def test_duplicate_steps_are_rejected() -> None:
    cands = [c(1000, 1.0), c(2000, 2.0), c(1000, 3.0)]
    with pytest.raises(ValueError, match="duplicate checkpoint step 1000"):
        RetentionPolicy([KeepLast(5)]).decide(cands, anchor_step=None)
    for policy in (KeepLast(1), KeepEvery(1), KeepWithin(1), KeepSteps(frozenset({1}))):
        with pytest.raises(ValueError, match="duplicate"):
            policy.reasons(cands)


def test_anchor_must_be_a_candidate() -> None:
    with pytest.raises(ValueError, match="anchor step 5000"):
        RetentionPolicy([KeepLast(1)]).decide([c(1000)], anchor_step=5000)


def test_candidate_validation() -> None:
    with pytest.raises(TypeError):
        Candidate("1000", 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Candidate(True, 0.0)
    with pytest.raises(ValueError):
        Candidate(-1, 0.0)
    with pytest.raises(ValueError):
        Candidate(1, float("nan"))


def test_non_policy_is_rejected() -> None:
    with pytest.raises(TypeError):
        RetentionPolicy([3])  # type: ignore[list-item]
