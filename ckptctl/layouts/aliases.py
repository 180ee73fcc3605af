"""Aliases: files a tool keeps under its root beside its checkpoints, each standing for one of
them (Lightning's ``last.ckpt``, which ``ModelCheckpoint(save_last=True)`` rewrites at every
save). ``ls`` shows them; they are never checkpoints of their own: no verb counts, resumes,
copies or deletes one, so a retention rule never mistakes one for another training step and
prune never removes what the tool manages.

A layout that has them answers ``aliases()`` (an optional member of ``base.Layout``), bound to
its root.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    """One alias under a root, as its layout read it (no tensor data)."""

    name: str  # its name under the root
    url: str
    layout: str
    step: int | None  # the step it records; None when that cannot be read safely (a link is never followed)
    same_as: str | None  # the checkpoint of that step under the root, when there is one
    why: str  # what it is and who keeps it, in words

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def aliases(layout: Any) -> list[Alias]:
    """``layout.aliases()`` of a ``base.Layout`` bound to a root (``base`` imports this module
    for the type); none for a layout without the member."""
    ask = getattr(layout, "aliases", None)
    return [] if ask is None else list(ask())
