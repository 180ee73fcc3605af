"""``KeepBest``: keep the checkpoints with the best value of a recorded metric.

The metric is what the save recorded (``Checkpointer.save(step, state, metrics={"val_loss":
...})``, the manifest's ``metrics``) or, under a Hugging Face Trainer root, what the Trainer
logged for that step (``eval_loss``, ...) and its own ``best_metric``
(each layout's ``recorded_metrics``, gathered by ``layouts.catalog.recorded_metrics``).

What it decides, and why:

* It only ever *keeps*. It never replaces the anchor rule: the newest checkpoint that passes
  full verification is kept whatever its metric.
* A checkpoint without the metric (saved between evaluations) is neither among the best nor
  deleted for lacking it: this rule says nothing about it, and the other rules decide (with
  ``KeepBest`` alone, that is deleted unless it is the anchor, as with any rule).
* When no candidate records the metric at all, the name is most likely misspelt (or no
  evaluation has run yet): the rule then keeps every candidate, with a reason that says so,
  rather than let a typo delete the history.
* Ties go to the newer checkpoint (the higher step).
* What it ranks: the candidates prune hands every rule, the committed checkpoints up to the
  anchor (a newer one failed full verification and is reported as broken, never ranked). A
  best checkpoint is kept as it is, not re-read at every prune: ``ckptctl verify ROOT --all``
  checks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ckptctl.ops.retention.base import MAX_METRIC_NAME, Candidate, InvalidPolicy, Policy, check_int, sorted_unique

__all__ = ["KeepBest"]

Mode = Literal["min", "max"]


@dataclass(frozen=True)
class KeepBest(Policy):
    """Keep the ``n`` checkpoints with the lowest (``mode="min"``) or highest (``"max"``)
    value of ``metric``.

    >>> cands = [Candidate(1, 0.0, {"val_loss": 0.5}), Candidate(2, 0.0, {"val_loss": 0.213}),
    ...          Candidate(3, 0.0), Candidate(4, 0.0, {"val_loss": 0.3})]
    >>> KeepBest(2, "val_loss").reasons(cands)
    {2: 'best 2 of val_loss (0.213)', 4: 'best 2 of val_loss (0.3)'}
    >>> KeepBest(0, "val_loss")
    Traceback (most recent call last):
    ...
    ckptctl.ops.retention.base.InvalidPolicy: KeepBest: n must be at least 1, got 0
    """

    n: int
    metric: str
    mode: Mode = "min"

    def __post_init__(self) -> None:
        check_int(self.n, "KeepBest", "n", 1)
        if not isinstance(self.metric, str) or not 0 < len(self.metric) <= MAX_METRIC_NAME \
                or not self.metric.isprintable():
            raise InvalidPolicy("KeepBest", "metric", f"a printable name of 1..{MAX_METRIC_NAME} characters",
                                self.metric)
        if self.mode not in ("min", "max"):
            raise InvalidPolicy("KeepBest", "mode", '"min" or "max"', self.mode)

    @property
    def label(self) -> str:
        return f"best {self.n} of {self.metric} ({'lowest' if self.mode == 'min' else 'highest'})"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        ordered = sorted_unique(candidates)
        scored = [(v, c.step) for c in ordered if (v := c.metric(self.metric)) is not None]
        if not scored:
            # Nothing records it: a misspelt name must not make every checkpoint deletable.
            why = f"best {self.n} of {self.metric}: no checkpoint records {self.metric}, so all are kept"
            return {c.step: why for c in ordered}
        sign = 1.0 if self.mode == "min" else -1.0
        best = sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))[: self.n]
        return {step: f"best {self.n} of {self.metric} ({value:.6g})" for value, step in sorted(best, key=lambda vs: vs[1])}
