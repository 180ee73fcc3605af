"""``VerifyReport``: what ``verify`` says of one checkpoint, as the command prints it and its
JSON documents it (``ckptctl-json(7)``).

It is a view of what the checkpoint's layout found (``found``, a ``layouts.checked.Checked``,
the one record of a check's findings): it adds only what the engine knows and the layout does
not (the checkpoint's URL, how long the check took, the node of each rank of a torchrun job that
shared it, what its number counts) and says the rest in the report's words (``note``,
``checked``, ``ranks``, ``untested``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ckptctl.layouts.base import numbered
from ckptctl.layouts.checked import Checked, Level, Problem, checked_by


@dataclass
class RankShare:
    """What one rank of a torchrun job verified: its share of the files (``ops.distributed.share``)."""

    rank: int
    node: str
    files: int
    bytes_read: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class VerifyReport:
    url: str
    found: Checked  # what the checkpoint's layout found
    seconds: float = 0.0
    nodes: tuple[str, ...] = ()  # under torchrun: the node of each rank of the job that shared the check
    # What ``step`` counts (``layouts.base.Numbering``): accelerate's checkpoint_N, a "save index".
    numbered_by: str = "step"

    @property
    def level(self) -> Level:
        return self.found.level

    @property
    def step(self) -> int | None:
        return self.found.step

    @property
    def problems(self) -> list[Problem]:
        return self.found.problems

    @property
    def files(self) -> int:
        return self.found.files

    @property
    def tensors(self) -> int:
        return self.found.tensors

    @property
    def bytes_read(self) -> int:
        return self.found.bytes_read

    @property
    def seal_hint(self) -> str | None:
        """What would give the files without checksums some (``ckptctl seal``, an integration)."""
        return self.found.seal_hint

    @property
    def ok(self) -> bool:
        return self.found.ok

    @property
    def note(self) -> str | None:
        """What the check could not establish, and what vouched for the checkpoint, in one line."""
        return "; ".join(self.found.notes) or None

    @property
    def checked(self) -> str:
        """What was actually established (``layouts.checked.checked_by``): ``structure`` where
        some file's format records no checksum, whatever level was asked for."""
        return checked_by(self.found.level, self.found.unsummed)

    @property
    def untested(self) -> list[str]:
        """The files not test-loaded (decoded structurally, or only present and sized), one line
        each: what a seal records as such (``ops.seal``); not in the JSON (the note says it)."""
        return self.found.structural + self.found.not_loaded

    @property
    def ranks(self) -> list[RankShare]:
        """Under torchrun: what each rank read (its share of the files), by rank; empty otherwise."""
        nodes = self.nodes
        return [RankShare(r, nodes[r] if r < len(nodes) else "?", s.files, s.bytes_read, s.seconds)
                for r, s in enumerate(self.found.shares)]

    @property
    def label(self) -> str:
        """``step 20``, or ``save index 2``: its number named for what it counts."""
        return numbered(self.numbered_by, self.step)

    def to_dict(self) -> dict:
        d = {"url": self.url, "level": self.level, "step": self.step,
             "problems": [{**asdict(p), "text": str(p)} for p in self.problems],
             "files": self.files, "tensors": self.tensors, "bytes_read": self.bytes_read,
             "seconds": self.seconds, "note": self.note}
        ranks = self.ranks
        if ranks:  # a plain run's document has no "ranks"
            d["ranks"] = [r.to_dict() for r in ranks]
        d["checked"] = self.checked
        if self.seal_hint is not None:
            d["seal_hint"] = self.seal_hint
        d["numbered_by"] = self.numbered_by
        d["ok"] = self.ok
        return d
