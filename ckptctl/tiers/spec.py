"""What a user writes to describe tiers: ``Tier`` and the promotion cadences.

``Steps(1000) | Minutes(30)`` promotes a checkpoint when either is due (Python's ``or`` would
silently keep only the first, so cadences compose with ``|``, like retention rules).

May import: ``ops.retention.policies`` (the retention rules a tier keeps), ``storage``, leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckptctl.ops.retention.policies import Policy, RetentionPolicy
from ckptctl.storage import Storage, open_storage

# An outage is retried with exponential backoff from RETRY_FIRST_S up to a tier's retry_max_s.
RETRY_FIRST_S = 0.5
DEFAULT_RETRY_MAX_S = 60.0
DEFAULT_LAG_WARNING_S = 3600.0


class Cadence:
    """When a checkpoint committed on the tier before is due on this one. ``due`` is pure:
    ``step``/``now`` of the candidate, ``last_step``/``last_time`` of the last checkpoint
    chosen for this tier (None before the first, which is always due)."""

    def due(self, step: int, now: float, last_step: int | None, last_time: float | None) -> bool:
        raise NotImplementedError

    def __or__(self, other: "Cadence") -> "Cadence":
        if not isinstance(other, Cadence):
            return NotImplemented
        return _Either((*_parts(self), *_parts(other)))


@dataclass(frozen=True)
class Steps(Cadence):
    """Due when the step reached the next multiple of ``n`` after the last checkpoint chosen
    for the tier: ``Steps(10)`` with a save every 5 steps chooses 10, 20, 30 (and the first
    save of the run, whatever its step), not 15, 25, 35 as "n steps since the last" would;
    with saves that skip multiples (every 15) it chooses the first save at or past each one
    (15, 30, 45, 60). A resumed run counts from the multiples too, so every run of a job
    promotes the same steps.

    >>> [s for s, last in [(5, None), (10, 5), (15, 10), (20, 10)] if Steps(10).due(s, 0.0, last, 0.0)]
    [5, 10, 20]
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"Steps: n must be a whole number of at least 1, got {self.n!r}")

    def due(self, step: int, now: float, last_step: int | None, last_time: float | None) -> bool:
        return last_step is None or step // self.n > last_step // self.n


@dataclass(frozen=True)
class Minutes(Cadence):
    """Due when at least ``m`` minutes (a float; 0.5 is 30 s) passed since the last checkpoint
    chosen for the tier, by this process's monotonic clock."""

    m: float

    def __post_init__(self) -> None:
        if isinstance(self.m, bool) or not isinstance(self.m, (int, float)) or not math.isfinite(self.m) or self.m <= 0:
            raise ValueError(f"Minutes: m must be a positive number, got {self.m!r}")

    def due(self, step: int, now: float, last_step: int | None, last_time: float | None) -> bool:
        return last_time is None or now - last_time >= 60.0 * self.m


@dataclass(frozen=True)
class _Either(Cadence):
    parts: tuple[Cadence, ...]

    def due(self, step: int, now: float, last_step: int | None, last_time: float | None) -> bool:
        return any(p.due(step, now, last_step, last_time) for p in self.parts)


def _parts(c: Cadence) -> tuple[Cadence, ...]:
    return c.parts if isinstance(c, _Either) else (c,)


@dataclass
class Tier:
    """One tier: a root (path or ``s3://bucket/prefix``), its own retention, and, for every
    tier after the first, how often it receives a checkpoint (``every``; None: each one
    committed on the tier before), how long an outage is retried between attempts at most
    (``retry_max_s``) and after how long behind a warning is logged (``lag_warning_s``).
    ``storage``: an already opened storage for ``root`` (another endpoint, tuned parts).
    ``node_local`` (first tier only): ``root`` is a path on each node's own disk, holding only
    the shards that node's ranks wrote (see ``tiers.node_chain``). ``replicas`` (0 or 1; a
    node-local first tier only): with 1, each node also keeps a copy of the next node's
    shards, sent by the ranks after each commit, so that a replaced node recovers its shards
    from its partner without reading the next tier (see ``tiers.replica``)."""

    root: str
    retention: Policy | RetentionPolicy | None = None
    every: Cadence | None = None
    retry_max_s: float = DEFAULT_RETRY_MAX_S
    lag_warning_s: float = DEFAULT_LAG_WARNING_S
    storage: Storage | None = field(default=None, repr=False)
    node_local: bool = False
    replicas: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas not in (0, 1):
            raise ValueError(f"Tier.replicas must be 0 or 1 (one peer replica per node), got {self.replicas!r}")
        if self.replicas and not self.node_local:
            raise ValueError("Tier.replicas=1 needs node_local=True: a peer replica copies one node's shards to "
                             "another node's disk; a shared root needs none (set replicas=0)")
        if self.every is not None and not isinstance(self.every, Cadence):
            raise TypeError(f"Tier.every must be a cadence such as Steps(1000) | Minutes(30), got {self.every!r}")
        for name in ("retry_max_s", "lag_warning_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Tier.{name} must be a positive number of seconds, got {value!r}")

    def open(self) -> Storage:
        return self.storage if self.storage is not None else open_storage(self.root)


def check_tiers(tiers: list[Tier]) -> list[Tier]:
    """The tiers as given, checked: ``ValueError``/``TypeError`` on every rank at once."""
    tiers = list(tiers)
    if not tiers:
        raise ValueError("tiers: give at least one Tier")
    for t in tiers:
        if not isinstance(t, Tier):
            raise TypeError(f"tiers must be Tier objects, got {t!r}")
    if tiers[0].every is not None:
        raise ValueError("the first tier receives every save; 'every' applies to the tiers after it")
    if any(t.node_local for t in tiers[1:]):
        raise ValueError("only the first tier can be node-local (node_local=True)")
    if any(t.replicas for t in tiers[1:]):
        raise ValueError("only the first tier keeps peer replicas (replicas=1); set replicas=0 on the others")
    return tiers
