"""Which checkpoints ``load_latest`` tries, across tiers: the newest step first, and for one
step the nearest tier first (the first tier, then the next), so a first tier that lost a
checkpoint, or all of them (a replaced node's empty disk), resumes from the next tier.

Lazy, like ``layouts.catalog.newest_committed``: with one tier it costs exactly what a
single-root ``Checkpointer`` costs. A tier that cannot be listed (an S3 outage, a first tier's
directory gone) is skipped with a warning when other tiers remain.

May import: ``layouts``, ``storage``, leaves.
"""

from __future__ import annotations

import heapq
import logging
from typing import Iterator

from ckptctl.errors import CkptError
from ckptctl.layouts.catalog import CHECKPOINTER_LAYOUTS, newest_committed
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")


def committed_across(roots: list[Storage]) -> Iterator[tuple[int, str]]:
    """``(tier index, checkpoint name)`` of every committed checkpoint (ckptctl's own; contents
    not verified) on ``roots``, newest step first, nearest tier first within a step."""
    if len(roots) == 1:
        yield from ((0, e.name) for e in newest_committed(roots[0], layouts=CHECKPOINTER_LAYOUTS))
        return
    streams = [_tagged(i, root) for i, root in enumerate(roots)]
    for _, i, name in heapq.merge(*streams):
        yield i, name


def _tagged(i: int, root: Storage) -> Iterator[tuple[int, int, str]]:
    # A function, not a generator expression in the list above: that would read ``i`` when
    # first advanced, after the loop ended, and tag every tier's checkpoints with the last
    # tier's index, so a resume would read S3 while the same step sat on local disk.
    return ((-e.step, i, e.name) for e in _listed(root))


def _listed(root: Storage) -> Iterator:
    try:
        yield from newest_committed(root, layouts=CHECKPOINTER_LAYOUTS)
    except CkptError as e:
        log.warning("cannot list %s, trying the other tiers: %s", root.url, e)
