"""Which checkpoint a ``Checkpointer`` resumes from, agreed on by every rank: ``load_newest``.

Rank 0 lists the candidates, newest first, on every tier (a node-local first tier first learns
which steps the other nodes hold), and every rank takes its list. Each candidate is loaded by
every rank, its verdict agreed on (``save.coordination``'s ``agree``, the lowest of every
rank's): all loaded, it is the one; a rank found its part corrupt or missing, every rank moves
on together (with tiers, first to the step's other copies: the partner node's, each later
tier's); a rank's error that no older checkpoint fixes (a state that does not match) fails
every rank. So no two ranks ever resume from different steps.

May import: ``save`` (the coordinator's verdicts and collectives, through the ``Saver``),
``storage``, ``tiers`` (candidates and copies across tiers) and the leaves; it sits beside
``checkpointer``, its only user, and never imports it.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator

from ckptctl.errors import CkptError, InvalidCheckpoint, NotFound, OperationalError, StateError, StorageError
from ckptctl.save.coordination import AGREE_FATAL, AGREE_OK, AGREE_SKIP
from ckptctl.save.saver import Saver
from ckptctl.storage import Storage
from ckptctl.tiers.chain import Tiers
from ckptctl.tiers.recovery import committed_across

MAX_ATTEMPTS = 4  # attempts at one step: its nearest copy, the partner node's, each later tier's

log = logging.getLogger("ckptctl")


def load_newest(saver: Saver, tiers: Tiers | None, roots: list[Storage],
                load: Callable[[Storage], int]) -> int | None:
    """``load`` (the ``Checkpointer``'s own, into its state) the newest committed checkpoint
    on ``roots`` (the tiers' roots, nearest first) that every rank of ``saver``'s group loads;
    its step, or None when none does. Raises the error of a rank that no older checkpoint
    would fix, and an ``OperationalError`` when nothing loaded and a tier could not be reached
    (the job must not start over then)."""
    coord = saver.coordinator
    # Only rank 0 lists and reads markers: the others take its list, so the listing's
    # cost does not grow with the number of ranks. A node-local first tier first tells
    # rank 0 which steps the other nodes hold (every rank calls it; a no-op otherwise).
    if tiers is not None:
        tiers.gather()
    if coord is None:
        names: Iterable[tuple[int, str]] = _candidates(tiers, roots)  # lazily: one root costs what it always did
    else:
        names = saver.collective(coord.from_rank0, list(_candidates(tiers, roots)) if saver.rank == 0 else [])
    outage: OperationalError | None = None
    for tier, name in names:
        for _ in range(MAX_ATTEMPTS):  # each attempt reads the copies the one before did not
            ckpt = _at(tiers, roots, tier, name)
            step, error = None, None
            try:
                step = load(ckpt)
                verdict = AGREE_OK
            except (InvalidCheckpoint, NotFound) as e:
                error, verdict = e, AGREE_SKIP
            except OperationalError as e:  # with tiers, one unreachable: another copy, or an older step
                error, verdict, outage = e, (AGREE_SKIP if tiers is not None else AGREE_FATAL), e
            except CkptError as e:  # a mismatch with the state: no older checkpoint fixes it
                error, verdict = e, AGREE_FATAL
            everyone = _everyone(saver, verdict)
            if everyone == AGREE_OK:
                if tiers is not None:
                    tiers.loaded(ckpt)
                return step
            if everyone == AGREE_FATAL:
                if error is not None and verdict == AGREE_FATAL:
                    raise error
                raise StateError(
                    f"{ckpt.url}: another rank could not load its part of this checkpoint",
                    hint="the failing rank's error says why (for example a shape mismatch)",
                )
            # Every copy of a step before an older step: again, when some rank set a damaged one aside.
            again = tiers is not None and error is not None and tiers.avoid(ckpt, error)
            if _everyone(saver, AGREE_SKIP if again else AGREE_OK) == AGREE_OK:
                break
        log.warning("skipping %s: %s", ckpt.url, error or "another rank found its part of it corrupt or missing")
    # Nothing loaded. Not "no checkpoint" when a tier could not be reached: the job would start over.
    if _everyone(saver, AGREE_SKIP if outage is not None else AGREE_OK) == AGREE_SKIP:
        if outage is not None:
            raise outage
        raise StorageError("no checkpoint could be loaded, and another rank could not reach a tier",
                           hint="that rank's log says which; resume once the tier is back")
    return None


def _everyone(saver: Saver, verdict: int) -> int:
    """The lowest of every rank's verdict (this one's, in a single process)."""
    coord = saver.coordinator
    return verdict if coord is None else saver.collective(coord.agree, verdict)


def _candidates(tiers: Tiers | None, roots: list[Storage]) -> Iterator[tuple[int, str]]:
    return tiers.candidates() if tiers is not None else committed_across(roots)


def _at(tiers: Tiers | None, roots: list[Storage], tier: int, name: str) -> Storage:
    # A node-local first tier reads each file from the nearest tier holding it.
    return tiers.checkpoint(tier, name) if tiers is not None else roots[tier].sub(name)
