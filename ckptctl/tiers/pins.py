"""The retention rule that keeps checkpoints awaiting promotion to the next tier.

A tier's retention never deletes a checkpoint its promoter has chosen until that one, or a
newer one, is promoted: the promoter reports the steps it holds (``Promoter.pins``), and each
prune of the tier adds this rule, built afresh from them, to the tier's own rules.

May import: ``ops.retention.policies`` (the rule base types), leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl.ops.retention.policies import Candidate, Policy, RetentionPolicy


@dataclass(frozen=True)
class AwaitingPromotion(Policy):
    """Keep ``steps``: chosen for promotion to ``to`` and not promoted yet.

    >>> AwaitingPromotion(frozenset({30}), "s3://b/p").reasons([Candidate(20, 0.0), Candidate(30, 0.0)])
    {30: 'awaiting promotion to s3://b/p'}
    """

    steps: frozenset[int]
    to: str

    @property
    def label(self) -> str:
        return f"awaiting promotion to {self.to}"

    def reasons(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: self.label for c in candidates if c.step in self.steps}


def guarded(rules: RetentionPolicy, pinned: frozenset[int], to: str) -> RetentionPolicy:
    """``rules`` plus the pins (unchanged when nothing is pinned)."""
    return rules | AwaitingPromotion(pinned, to) if pinned else rules
