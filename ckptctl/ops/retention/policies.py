"""Retention policies: which checkpoints to keep, and why.

Modelled on Orbax's composable preservation policies, with three differences that matter for a
tool that deletes things:

* every policy says *why* it keeps a checkpoint, so ``prune --dry-run`` can print a reason next
  to each kept step;
* results never depend on the order of the input (Orbax's ``LatestN`` assumes a sorted list);
  candidates are sorted by step as integers, so step 10000 is newer than step 9000;
* there is no "keep nothing" policy: a :class:`RetentionPolicy` needs at least one rule, and the
  anchor (the newest checkpoint that verified, chosen by the caller) is always kept.

Everything here is pure: no I/O and no clock (``now`` is passed in). ``KeepWithin`` measures
from the newest candidate's creation time, like restic's ``--keep-within``, so a job that has
been down for a week does not have every checkpoint age out of the window. The calendar rules
(``--keep-hourly/-daily/-weekly/-monthly N``) keep the newest checkpoint of each of the N most
recent UTC hours, days, ISO weeks or months that have one, as restic's ``forget`` does.

Time-based rules use only *trustworthy* commit times (:func:`implausible_times`): a time in the
future, or before the root's first checkpoint, comes from a host with a wrong clock. Such a
checkpoint is kept (the rules cannot place it, and deleting on a wrong clock is how a prune
loses recent work) and flagged; windows are measured from the newest trustworthy time, so one
checkpoint dated 10 years ahead cannot make ``--keep-within 7d`` drop everything else.

>>> cands = [Candidate(step=s, time=1000.0 + s) for s in (1000, 2000, 3000, 4000)]
>>> policy = from_options(keep_last=2, keep_every=2000, keep_within=None, keep=())
>>> {step: d.keep for step, d in policy.decide(cands, anchor_step=3000).items()}
{1000: False, 2000: True, 3000: True, 4000: True}
>>> policy.decide(cands, anchor_step=3000)[3000].reasons
('anchor: newest verified checkpoint', 'keep-last 2')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ckptctl.durations import format_duration
from ckptctl.errors import UsageError
from ckptctl.ops.retention.base import AnyOf, Candidate, Decision, InvalidPolicy, Policy, check_int
from ckptctl.ops.retention.base import sorted_unique as _sorted_unique
from ckptctl.ops.retention.best import KeepBest

__all__ = [
    "ANCHOR_REASON",
    "AnyOf",
    "Candidate",
    "Decision",
    "InvalidPolicy",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepSteps",
    "KeepCalendar",
    "KeepWithin",
    "Policy",
    "RetentionPolicy",
    "from_options",
    "implausible_times",
]

ANCHOR_REASON = "anchor: newest verified checkpoint"
NO_POLICY_MESSAGE = (
    "no retention policy given; pass --keep-last, --keep-every, --keep-within, "
    "--keep-hourly/-daily/-weekly/-monthly, --keep-best or --keep"
)
# A commit time this far ahead of ``now`` is a wrong clock, not skew between hosts.
FUTURE_TOLERANCE_S = 600.0


@dataclass(frozen=True)
class KeepLast(Policy):
    """Keep the ``n`` highest steps.

    >>> KeepLast(2).reasons([Candidate(5, 0.0), Candidate(30, 0.0), Candidate(4, 0.0)])
    {5: 'keep-last 2', 30: 'keep-last 2'}
    """

    n: int

    def __post_init__(self) -> None:
        check_int(self.n, "KeepLast", "n", 1)

    @property
    def label(self) -> str:
        return f"keep-last {self.n}"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        ordered = _sorted_unique(candidates)
        return {c.step: self.label for c in ordered[-self.n :]}


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Keep steps that are multiples of ``steps`` (step 0 included).

    >>> KeepEvery(1000).reasons([Candidate(1500, 0.0), Candidate(2000, 0.0)])
    {2000: 'keep-every 1000'}
    """

    steps: int
    step_option = "--keep-every"

    def __post_init__(self) -> None:
        check_int(self.steps, "KeepEvery", "steps", 1)

    @property
    def label(self) -> str:
        return f"keep-every {self.steps}"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: self.label for c in _sorted_unique(candidates) if c.step % self.steps == 0}


@dataclass(frozen=True)
class KeepWithin(Policy):
    """Keep checkpoints created within ``seconds`` of the newest candidate (inclusive).

    Measured from the newest candidate's ``time`` (the largest), not from now: a paused job
    keeps its recent history however long it has been down (restic's ``--keep-within``).

    >>> KeepWithin(3600).reasons([Candidate(1, 0.0), Candidate(2, 5000.0), Candidate(3, 8000.0)])
    {2: 'within 1h of newest', 3: 'within 1h of newest'}
    """

    seconds: float
    time_based = True

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or not math.isfinite(self.seconds) or self.seconds < 0:
            raise InvalidPolicy("KeepWithin", "seconds", "a finite duration >= 0", self.seconds)

    @property
    def label(self) -> str:
        return f"within {format_duration(self.seconds)} of newest"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        ordered = _sorted_unique(candidates)
        if not ordered:
            return {}
        newest = max(c.time for c in ordered)
        return {c.step: self.label for c in ordered if newest - c.time <= self.seconds}


_CALENDAR_UNITS = ("hourly", "daily", "weekly", "monthly")


def _bucket(unit: str, t: float) -> str:
    """The UTC hour, day, ISO week or month of epoch time ``t``, as a printable label."""
    d = datetime.fromtimestamp(t, tz=timezone.utc)
    if unit == "hourly":
        return d.strftime("%Y-%m-%d %H:00Z")
    if unit == "daily":
        return d.strftime("%Y-%m-%d")
    if unit == "weekly":
        year, week, _ = d.isocalendar()
        return f"{year}-W{week:02d}"
    return d.strftime("%Y-%m")


@dataclass(frozen=True)
class KeepCalendar(Policy):
    """Keep the newest checkpoint (by commit time) of each of the ``n`` most recent UTC hours,
    days, ISO weeks or months that have one: restic's ``forget --keep-daily`` and friends.

    >>> day = 86400.0
    >>> KeepCalendar("daily", 2).reasons([Candidate(1, 0.0), Candidate(2, 10.0), Candidate(3, day + 5)])
    {2: 'keep-daily 2 (1970-01-01)', 3: 'keep-daily 2 (1970-01-02)'}
    """

    unit: str
    n: int
    time_based = True

    def __post_init__(self) -> None:
        if self.unit not in _CALENDAR_UNITS:
            raise InvalidPolicy("KeepCalendar", "unit", f"one of {', '.join(_CALENDAR_UNITS)}", self.unit)
        check_int(self.n, "KeepCalendar", "n", 1)

    @property
    def label(self) -> str:
        return f"keep-{self.unit} {self.n}"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        # Newest first by time; a tie in time goes to the higher step (the later save).
        ordered = sorted(_sorted_unique(candidates), key=lambda c: (c.time, c.step), reverse=True)
        kept: dict[int, str] = {}
        seen: set[str] = set()
        for c in ordered:
            bucket = _bucket(self.unit, c.time)
            if bucket in seen:
                continue
            if len(seen) == self.n:
                break
            seen.add(bucket)
            kept[c.step] = f"{self.label} ({bucket})"
        return dict(sorted(kept.items()))


def implausible_times(
    candidates: Sequence[Candidate], now: float | None, *, tolerance_s: float = FUTURE_TOLERANCE_S
) -> dict[int, str]:
    """Steps whose commit time cannot be trusted, each with why: later than ``now`` (plus
    ``tolerance_s`` of clock skew between hosts), or earlier than the first checkpoint's (the
    lowest step whose time is not in the future). ``now=None`` checks only the second rule.

    >>> now = 10_000.0
    >>> implausible_times([Candidate(1, 5000.0), Candidate(2, 4000.0), Candidate(3, 9e9)], now)
    {2: 'commit time before the first checkpoint (step 1)', 3: 'commit time in the future (2255-03-14 16:00:00Z)'}
    """
    out: dict[int, str] = {}
    ordered = _sorted_unique(candidates)
    for c in ordered:
        if now is not None and c.time > now + tolerance_s:
            out[c.step] = f"commit time in the future ({_stamp(c.time)})"
    rest = [c for c in ordered if c.step not in out]
    if rest:
        first = rest[0]
        for c in rest[1:]:
            if c.time < first.time:
                out[c.step] = f"commit time before the first checkpoint (step {first.step})"
    return dict(sorted(out.items()))


def _stamp(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # beyond what datetime can show
        return f"{t:.0f} s after the epoch"


@dataclass(frozen=True)
class KeepSteps(Policy):
    """Keep pinned steps (``--keep STEP``). Pinned steps that do not exist are ignored here;
    :meth:`missing` lists them so a caller can warn.

    >>> KeepSteps(frozenset({2000, 7})).reasons([Candidate(2000, 0.0), Candidate(3000, 0.0)])
    {2000: 'pinned'}
    """

    steps: frozenset[int] = field(default_factory=frozenset)
    step_option = "--keep"

    def __post_init__(self) -> None:
        # Accept any iterable of ints but store a frozenset, so the policy stays hashable.
        steps = frozenset(check_int(s, "KeepSteps", "steps", 0) for s in self.steps)
        if not steps:
            raise InvalidPolicy("KeepSteps", "steps", "at least one step", set())
        object.__setattr__(self, "steps", steps)

    @property
    def label(self) -> str:
        return "pinned"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: self.label for c in _sorted_unique(candidates) if c.step in self.steps}

    def missing(self, candidates: Sequence[Candidate]) -> frozenset[int]:
        """Pinned steps with no candidate (a typo, or already deleted)."""
        return self.steps - {c.step for c in _sorted_unique(candidates)}


@dataclass(frozen=True, init=False)
class RetentionPolicy:
    """Keep a checkpoint if ANY policy keeps it; the anchor is always kept. ``AnyOf`` rules
    (``KeepLast(3) | KeepEvery(1000)``) are taken apart into their rules.

    >>> RetentionPolicy([])
    Traceback (most recent call last):
    ...
    ckptctl.ops.retention.base.InvalidPolicy: RetentionPolicy: policies must be at least one rule, got ()
    >>> RetentionPolicy.of(KeepLast(3) | KeepEvery(1000)).describe()
    'keep-last 3, keep-every 1000'
    """

    policies: tuple[Policy, ...]

    def __init__(self, policies: Iterable[Policy]) -> None:
        policies = tuple(policies)
        for p in policies:
            if not isinstance(p, Policy):
                raise TypeError(f"not a retention policy: {p!r}")
        # An empty policy must never mean "delete everything but the anchor".
        if not policies:
            raise InvalidPolicy("RetentionPolicy", "policies", "at least one rule", ())
        flat = tuple(q for p in policies for q in (p.policies if isinstance(p, AnyOf) else (p,)))
        object.__setattr__(self, "policies", flat)

    @classmethod
    def of(cls, rules: "Policy | RetentionPolicy") -> "RetentionPolicy":
        """``rules`` as a RetentionPolicy (what ``Checkpointer(retention=...)`` accepts)."""
        if isinstance(rules, RetentionPolicy):
            return rules
        return cls([rules])

    def __or__(self, other: "Policy | RetentionPolicy") -> "RetentionPolicy":
        if isinstance(other, RetentionPolicy):
            return RetentionPolicy(self.policies + other.policies)
        if isinstance(other, Policy):
            return RetentionPolicy(self.policies + (other,))
        return NotImplemented

    def __ror__(self, other: Policy) -> "RetentionPolicy":
        if isinstance(other, Policy):
            return RetentionPolicy((other,) + self.policies)
        return NotImplemented

    def describe(self) -> str:
        """The rules in one line, e.g. ``"keep-last 3, keep-every 1000"``."""
        return ", ".join(p.label for p in self.policies)

    def decide(
        self, candidates: Sequence[Candidate], anchor_step: int | None, *, now: float | None = None
    ) -> dict[int, Decision]:
        """Decide every candidate, keyed by step in ascending order.

        ``anchor_step`` is the newest checkpoint that passed verification; it is kept whatever
        the policies say and must be one of the candidates. ``None`` means nothing verified:
        the decisions then follow the policies alone, for display, and a caller must refuse to
        delete anything (``man/ckptctl-prune.1``: nothing is deleted if no checkpoint passes
        full verification).

        ``now`` (epoch seconds) turns on the trust check: with time-based rules, checkpoints
        dated in the future or before the first one are kept and carry
        ``Decision.implausible`` (see :func:`implausible_times`); ``None`` takes every time as
        given.
        """
        ordered = _sorted_unique(candidates)
        steps = [c.step for c in ordered]
        if anchor_step is not None and anchor_step not in steps:
            raise ValueError(f"anchor step {anchor_step} is not among the retention candidates")

        timed = any(p.time_based for p in self.policies)
        # Only with ``now`` (prune's plan passes it): without it, times are taken as given.
        untrusted = implausible_times(ordered, now) if timed and now is not None else {}
        trusted = [c for c in ordered if c.step not in untrusted]
        collected: dict[int, list[str]] = {step: [] for step in steps}
        if anchor_step is not None:
            collected[anchor_step].append(ANCHOR_REASON)
        for policy in self.policies:
            for step, reason in policy.reasons(trusted if policy.time_based else ordered).items():
                # Two identical rules (keep-last 3 twice) should not print the reason twice.
                if reason not in collected[step]:
                    collected[step].append(reason)
        for step, why in untrusted.items():
            collected[step].append(f"implausible {why}: kept, time-based rules cannot place it")
        return {step: Decision(bool(why), tuple(why), untrusted.get(step)) for step, why in collected.items()}


def _built(option: str, rule: type[Policy], *args: object) -> Policy:
    """``rule(*args)``; its ValueError becomes a usage error naming the option the user typed."""
    try:
        return rule(*args)
    except InvalidPolicy as e:
        if (e.rule, e.param) == ("KeepBest", "metric"):
            option = "--metric"
        elif (e.rule, e.param) == ("KeepBest", "mode"):
            option = "--mode"
        shown = e.value if isinstance(e.value, (int, float, str)) else repr(e.value)
        raise UsageError(f"{option} must be {e.requirement}, got {shown}",
                         hint=f"pass a valid {option}, or leave it out") from None


def from_options(
    keep_last: int | None,
    keep_every: int | None,
    keep_within: float | None,
    keep: Iterable[int] = (),
    *,
    keep_hourly: int | None = None,
    keep_daily: int | None = None,
    keep_weekly: int | None = None,
    keep_monthly: int | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str | None = None,
) -> RetentionPolicy:
    """Build the policy from CLI-style options (``None`` / empty means "not given"). A bad
    value is a ``UsageError`` naming the option (exit 2).

    >>> from_options(keep_last=3, keep_every=None, keep_within=6 * 3600, keep=[500]).describe()
    'keep-last 3, within 6h of newest, pinned'
    >>> from_options(None, None, None, keep_daily=7, keep_monthly=12).describe()
    'keep-daily 7, keep-monthly 12'
    >>> from_options(1, None, None, keep_best=2, metric="val_loss").describe()
    'keep-last 1, best 2 of val_loss (lowest)'
    >>> from_options(0, None, None)
    Traceback (most recent call last):
    ...
    ckptctl.errors.UsageError: --keep-last must be at least 1, got 0
    >>> from_options(None, None, None, ())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ckptctl.errors.UsageError: no retention policy given; pass --keep-last, ... or --keep
    """
    if keep_best is None and (metric is not None or mode is not None):
        given = "--metric" if metric is not None else "--mode"
        raise UsageError(f"{given} is used only with --keep-best", hint="e.g. --keep-best 3 --metric val_loss")
    if keep_best is not None and metric is None:
        raise UsageError("--keep-best needs --metric NAME (the metric the saves recorded)",
                         hint="e.g. --keep-best 3 --metric val_loss [--mode max]")
    policies: list[Policy] = []
    if keep_last is not None:
        policies.append(_built("--keep-last", KeepLast, keep_last))
    if keep_every is not None:
        policies.append(_built("--keep-every", KeepEvery, keep_every))
    if keep_within is not None:
        policies.append(_built("--keep-within", KeepWithin, keep_within))
    for unit, n in zip(_CALENDAR_UNITS, (keep_hourly, keep_daily, keep_weekly, keep_monthly)):
        if n is not None:
            policies.append(_built(f"--keep-{unit}", KeepCalendar, unit, n))
    if keep_best is not None:
        policies.append(_built("--keep-best", KeepBest, keep_best, metric, mode or "min"))
    pinned = tuple(keep)
    if pinned:
        policies.append(_built("--keep", KeepSteps, frozenset(pinned)))
    if not policies:
        raise UsageError(NO_POLICY_MESSAGE, hint="e.g. ckptctl prune ROOT --keep-last 3 --dry-run")
    return RetentionPolicy(policies)
