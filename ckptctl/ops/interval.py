"""How often to checkpoint: Young's and Daly's optimum intervals, and the time each one loses.

Notation (Daly 2006): ``C`` (delta) is the time the job is blocked per checkpoint — for an
asynchronous save the stall while ranks copy to host memory, not the background write; ``M`` the
mean time between failures of the whole job; ``T`` (tau) the compute time between two
checkpoints, i.e. the interval *excluding* the stall.

References:

* J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9):530-531, 1974.  ``T = sqrt(2 C M)``.
* J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3):303-312, 2006, doi:10.1016/j.future.2004.11.016.
  For ``C < 2M``: ``T = sqrt(2 C M) * [1 + (1/3) sqrt(C/(2M)) + (1/9) (C/(2M))] - C``;
  otherwise ``T = M``.  Checked against the paper's own worked examples (delta = 5 min:
  M = 24 h -> 117 min, M = 6 h -> 57 min, M = 15 min -> 9.1 min); see tests/test_interval.py.

>>> a = advise(cost_s=60, mtbf_s=86400)
>>> round(a.young_s, 1), round(a.daly_s, 1)
(3219.9, 3180.1)
>>> a.warnings
()
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl.durations import format_duration
from ckptctl.errors import UsageError

__all__ = [
    "IntervalAdvice",
    "advise",
    "cost_from_stalls",
    "daly_interval",
    "waste_fraction",
    "young_interval",
]


@dataclass(frozen=True)
class IntervalAdvice:
    """The intervals for one (cost, MTBF) pair and what each is expected to lose.

    ``young_s`` and ``daly_s`` are compute time between checkpoints (excluding the stall);
    ``waste_fraction_*`` the expected fraction of wall-clock time lost (see
    :func:`waste_fraction`); ``write_s`` the background write time if known.

    >>> advise(60, 86400).recommended_s == advise(60, 86400).daly_s
    True
    """

    cost_s: float
    mtbf_s: float
    young_s: float
    daly_s: float
    waste_fraction_young: float
    waste_fraction_daly: float
    write_s: float | None
    warnings: tuple[str, ...]

    @property
    def recommended_s(self) -> float:
        """Daly's interval, raised to the background write time: a save cannot start before
        the previous write has finished without waiting for it."""
        return max(self.daly_s, self.write_s or 0.0)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: ``sqrt(2 C M)``.

    >>> young_interval(60, 86400)  # doctest: +ELLIPSIS
    3219.93...
    """
    _check_positive(cost_s, "--cost")
    _check_positive(mtbf_s, "--mtbf")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (Daly 2006; formula in the module docstring).

    Daly's perturbation series is only valid for ``C < 2M``; beyond it the paper's advice is
    ``T = M``. Note the published piecewise form is not continuous at ``C = 2M`` (it gives
    ``8M/9`` just below and ``M`` at the boundary); we keep it as published.

    >>> round(daly_interval(300, 86400) / 60)  # Daly's Fig. 3: delta = 5 min, M = 24 h
    117
    """
    _check_positive(cost_s, "--cost")
    _check_positive(mtbf_s, "--mtbf")
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    xi = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(xi) / 3.0 + xi / 9.0) - cost_s


def waste_fraction(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """Expected fraction of wall-clock time lost when checkpointing every ``interval_s``.

    Daly's complete model (Daly 2006) with the restart time ``R`` set to 0, because ckptctl
    does not know it: expected wall time ``T_w = M e^(R/M) (e^((T+C)/M) - 1) T_s / T`` for
    ``T_s`` seconds of useful work, so the fraction lost is ``1 - T_s / T_w``::

        waste = 1 - (T / M) / (e^((T + C) / M) - 1)

    It counts checkpoint stalls and recomputed work. It assumes failures arrive as a Poisson
    process (exponential inter-arrival times, mean M) that can strike at any moment, including
    during a stall; that a failure loses everything since the last checkpoint; and that a
    checkpoint is usable as soon as the stall ends. For asynchronous saves the last assumption
    is optimistic: a failure during the background write falls back one checkpoint further.
    Unlike the first-order ``C/T + (T + C)/(2M)``, it stays below 1 however large ``C`` is.

    >>> round(waste_fraction(3180.0, 60, 86400), 4)
    0.0368
    """
    _check_positive(interval_s, "interval")
    _check_positive(cost_s, "--cost")
    _check_positive(mtbf_s, "--mtbf")
    x = (interval_s + cost_s) / mtbf_s
    # e^x overflows a float past ~709; by then the useful fraction is below 1e-300 anyway.
    if x > 700.0:
        return 1.0
    # expm1 keeps precision when (T + C) is tiny next to M, the usual case.
    return 1.0 - (interval_s / mtbf_s) / math.expm1(x)


def advise(cost_s: float, mtbf_s: float, write_s: float | None = None) -> IntervalAdvice:
    """Compute Young's and Daly's intervals, their expected waste, and warnings.

    Warns when the background write takes longer than Daly's interval (saves would queue behind
    each other, so the real interval is the write time) and when the cost reaches the MTBF.

    >>> advise(cost_s=10, mtbf_s=86400, write_s=3600).warnings[0]  # doctest: +ELLIPSIS
    'the background write (1h) is longer than the interval (21m 48s): ...'
    """
    _check_positive(cost_s, "--cost")
    _check_positive(mtbf_s, "--mtbf")
    if write_s is not None:
        _check_positive(write_s, "write time")

    young = young_interval(cost_s, mtbf_s)
    daly = daly_interval(cost_s, mtbf_s)
    waste_daly = waste_fraction(daly, cost_s, mtbf_s)
    warnings: list[str] = []
    if write_s is not None and write_s > daly:
        warnings.append(
            f"the background write ({format_duration(write_s)}) is longer than the interval "
            f"({format_duration(daly)}): each save would wait for the previous one; "
            f"checkpoint every {format_duration(write_s)} instead, or make the "
            f"write faster"
        )
    if cost_s >= mtbf_s:
        warnings.append(
            f"the checkpoint cost ({format_duration(cost_s)}) is at least the MTBF "
            f"({format_duration(mtbf_s)}): about {waste_daly:.0%} of the time would be lost "
            f"to saving and redoing work; make saves cheaper (async save) or failures rarer"
        )
    return IntervalAdvice(
        cost_s=float(cost_s),
        mtbf_s=float(mtbf_s),
        young_s=young,
        daly_s=daly,
        waste_fraction_young=waste_fraction(young, cost_s, mtbf_s),
        waste_fraction_daly=waste_daly,
        write_s=None if write_s is None else float(write_s),
        warnings=tuple(warnings),
    )


def cost_from_stalls(stalls: Sequence[float]) -> float:
    """The checkpoint cost ``C`` to use, from measured stalls (seconds): their median.

    Why the median: stall times are skewed by one-off outliers — the first save allocates
    pinned host buffers, a save can coincide with a filesystem hiccup or a GC pause — and the
    optimum interval needs the *typical* cost. One 10-minute outlier among twenty 5-second
    stalls moves the mean to ~33 s (and the interval by ~2.6x); the median stays at 5 s. Pass
    recent stalls only, since the cost changes when the model or the hardware does.

    >>> cost_from_stalls([5.0, 5.2, 4.9, 600.0])
    5.1
    """
    values = [float(s) for s in stalls]
    if not values:
        raise UsageError(
            "no checkpoint stall times to estimate the cost from",
            hint="pass --cost DURATION, the time training is blocked per save (e.g. --cost 30s)",
        )
    for s in values:
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"a stall time must be a finite number of seconds >= 0, got {s!r}")
    cost = statistics.median(values)
    if cost <= 0:
        raise UsageError(
            "the recorded checkpoint stalls are zero; cannot derive an interval from them",
            hint="pass --cost DURATION, the time training is blocked per save (e.g. --cost 30s)",
        )
    return cost


def _check_positive(value: float, name: str) -> None:
    # Options get an example in the hint; internal values (interval, write time) name what.
    example = f"e.g. {name} 30s" if name.startswith("--") else "a number of seconds > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{name} must be a duration, got {value!r}", hint=example)
    if not math.isfinite(value) or value <= 0:
        raise UsageError(
            f"{name} must be a positive duration, got {value!r}",
            hint=f"pass a duration greater than zero, {example}",
        )
