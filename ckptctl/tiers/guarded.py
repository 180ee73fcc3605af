"""Library retention of one tier that never deletes what the next tier still waits for.

The same background retention as a single-root ``Checkpointer`` (``ops.retention.background``:
coalesced prunes on a thread of their own, ``ckptctl prune``'s safety checks), except that
each prune reads the promoter's pins at the moment it plans, so a checkpoint chosen for
promotion survives until it, or a newer one, reached the next tier.

May import: ``ops``, ``tiers.pins``, ``storage``, leaves.
"""

from __future__ import annotations

from typing import Callable

from ckptctl.ops.retention.background import BackgroundRetention
from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.storage.base import Storage
from ckptctl.tiers.pins import guarded

Pins = Callable[[], frozenset[int]]


class GuardedRetention(BackgroundRetention):
    """``BackgroundRetention`` whose policy is the tier's rules plus ``pins()`` read at plan
    time. ``pins``/``to`` may be set after construction (the promoter is built later)."""

    def __init__(self, root: Storage, rules: Policy | RetentionPolicy) -> None:
        self.pins: Pins = frozenset
        self.to = ""
        super().__init__(root, retention=rules)

    # ``BackgroundRetention._run`` reads ``self.policy`` when it plans a prune: a property
    # makes that read see the pins of that moment, with no change to the shared code.
    @property
    def policy(self) -> RetentionPolicy:  # type: ignore[override]
        return guarded(self._rules, self.pins(), self.to)

    @policy.setter
    def policy(self, rules: RetentionPolicy) -> None:
        self._rules = rules
