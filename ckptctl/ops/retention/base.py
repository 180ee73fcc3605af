"""What every retention rule shares: the candidates it judges, the decision it returns, the
rule's base class and the one error a rule raises for a bad parameter.

The rules themselves are in ``ops.retention.policies`` (and ``ops.retention.best``); import them from
there or from ``ckptctl``. This module exists so that a rule in its own module can subclass
``Policy`` without importing the module that composes every rule.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ckptctl.format.manifest import MAX_METRIC_NAME, MAX_METRICS  # the manifest's bounds on metrics

__all__ = ["AnyOf", "Candidate", "Decision", "InvalidPolicy", "MAX_METRICS", "MAX_METRIC_NAME", "Policy", "check_int"]


class InvalidPolicy(ValueError):
    """A retention rule built with a bad parameter. ``str()`` names the rule and the
    parameter (``KeepLast: n must be at least 1, got 0``); the CLI uses ``requirement`` and
    ``value`` to name its own option instead (``--keep-last must be at least 1, got 0``)."""

    def __init__(self, rule: str, param: str, requirement: str, value: object) -> None:
        self.rule, self.param, self.requirement, self.value = rule, param, requirement, value
        super().__init__(f"{rule}: {param} must be {requirement}, got {value!r}")


def check_int(value: object, rule: str, param: str, minimum: int) -> int:
    """``value`` if it is a whole number (never a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidPolicy(rule, param, "a whole number", value)
    if value < minimum:
        raise InvalidPolicy(rule, param, f"at least {minimum}", value)
    return value


def _metrics(value: object, step: int) -> tuple[tuple[str, float], ...]:
    """``value`` (a mapping of name to finite number) as sorted pairs, so a Candidate stays
    hashable and its metrics compare equal whatever order they were given in."""
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[str, float] = {}
    for name, v in items:  # type: ignore[union-attr]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME:
            raise ValueError(f"Candidate.metrics: name {name!r} (step {step}) is not 1..{MAX_METRIC_NAME} characters")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"Candidate.metrics[{name!r}] must be a finite number, got {v!r} (step {step})")
        out[name] = float(v)
    if len(out) > MAX_METRICS:
        raise ValueError(f"Candidate.metrics: {len(out)} metrics, more than {MAX_METRICS} (step {step})")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint that retention may keep or delete.

    ``step`` is the training step (an int, never a directory name: "10000" < "9000" as strings);
    ``time`` its creation time in epoch seconds; ``metrics`` what the save recorded
    (``Checkpointer.save(step, state, metrics=...)``, or a Trainer's evaluation), given as a
    mapping and kept as sorted pairs.

    >>> Candidate(step=3000, time=1_700_000_000.0, metrics={"val_loss": 0.21})
    Candidate(step=3000, time=1700000000.0, metrics=(('val_loss', 0.21),))
    >>> Candidate(3000, 0.0, metrics={"val_loss": 0.21}).metric("val_loss")
    0.21
    """

    step: int
    time: float
    metrics: tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self) -> None:
        # bool is an int subclass; True as a step is a bug upstream, not step 1.
        if not isinstance(self.step, int) or isinstance(self.step, bool):
            raise TypeError(f"Candidate.step must be an int, got {self.step!r}")
        if self.step < 0:
            raise ValueError(f"Candidate.step must be >= 0, got {self.step}")
        # NaN compares false with everything and would make KeepWithin keep or drop at random.
        if not math.isfinite(self.time):
            raise ValueError(f"Candidate.time must be finite, got {self.time!r} (step {self.step})")
        object.__setattr__(self, "metrics", _metrics(self.metrics, self.step))

    def metric(self, name: str) -> float | None:
        """The value recorded for ``name``, or None when this checkpoint has none."""
        return dict(self.metrics).get(name)


@dataclass(frozen=True)
class Decision:
    """What retention decided for one step, and every reason it is kept (empty when deleted).

    >>> Decision(keep=True, reasons=("keep-last 3",))
    Decision(keep=True, reasons=('keep-last 3',), implausible=None)
    """

    keep: bool
    reasons: tuple[str, ...]
    implausible: str | None = None  # why its commit time was not trusted (time rules skip it)


def sorted_unique(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates sorted by step; duplicate steps are an error, not a tie to break silently."""
    ordered = sorted(candidates, key=lambda c: c.step)
    for before, after in zip(ordered, ordered[1:]):
        if before.step == after.step:
            raise ValueError(f"duplicate checkpoint step {after.step} among retention candidates")
    return ordered


class Policy(abc.ABC):
    """One retention rule. ``reasons`` maps each step it keeps to a short reason string.

    Implementations must be pure and order-independent: same candidates in any order, same
    answer. Duplicate steps raise ``ValueError``. ``time_based`` rules read ``Candidate.time``;
    ``step_option`` rules read ``Candidate.step`` as a training step;
    :class:`~ckptctl.ops.retention.policies.RetentionPolicy` hands them only the candidates whose time
    is trustworthy. Rules compose with ``|``: ``KeepLast(3) | KeepEvery(1000)`` keeps what
    either keeps.
    """

    time_based = False
    # How the command line spells a rule that reads checkpoint numbers as training steps
    # (``--keep-every``, ``--keep``): it refuses a root whose layout numbers its checkpoints
    # by anything else (``Layout.numbered_by``: accelerate's save index). None: it reads none.
    step_option: str | None = None

    @abc.abstractmethod
    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        """Steps this policy keeps, each with its reason."""

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """The reason string this policy gives, e.g. ``"keep-last 3"``."""

    def __or__(self, other: "Policy") -> "AnyOf":
        if not isinstance(other, Policy):
            return NotImplemented
        return AnyOf((*_parts(self), *_parts(other)))


def _parts(p: Policy) -> tuple[Policy, ...]:
    return p.policies if isinstance(p, AnyOf) else (p,)


@dataclass(frozen=True)
class AnyOf(Policy):
    """Keep what any of ``policies`` keeps: what ``KeepLast(3) | KeepEvery(1000)`` builds.
    ``RetentionPolicy`` takes it apart, so each rule still reads only the candidates it may
    (time-based ones the trustworthy ones) and every reason is reported.

    >>> from ckptctl.ops.retention.policies import KeepEvery, KeepLast
    >>> (KeepLast(1) | KeepEvery(1000)).label
    'keep-last 1, keep-every 1000'
    """

    policies: tuple[Policy, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.policies)
        if not parts:
            raise InvalidPolicy("AnyOf", "policies", "at least one rule", parts)
        for p in parts:
            if not isinstance(p, Policy):
                raise InvalidPolicy("AnyOf", "policies", "retention rules", p)
        object.__setattr__(self, "policies", tuple(q for p in parts for q in _parts(p)))

    @property
    def time_based(self) -> bool:  # type: ignore[override]
        return any(p.time_based for p in self.policies)

    @property
    def label(self) -> str:
        return ", ".join(p.label for p in self.policies)

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        kept: dict[int, list[str]] = {}
        for p in self.policies:
            for step, why in p.reasons(candidates).items():
                kept.setdefault(step, []).append(why)
        return {step: "; ".join(kept[step]) for step in sorted(kept)}
