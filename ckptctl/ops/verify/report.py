"""``VerifyReport``: what ``verify`` says of one checkpoint, as the command prints it and its
JSON documents it (``ckptctl-json(7)``), made from what the checkpoint's layout found
(``layouts.checked.Checked``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    level: Level
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    note: str | None = None
    # Under torchrun: what each rank read (its share of the files), by rank; empty otherwise.
    ranks: list[RankShare] = field(default_factory=list)
    # The files not test-loaded (decoded structurally, or only present and sized), one line
    # each: what a seal records as such (``ops.seal``); not in the JSON (the note says it).
    untested: list[str] = field(default_factory=list, repr=False)
    # What was actually established (``layouts.checked.checked_by``): ``structure`` where some
    # file's format records no checksum, whatever level was asked for; and how to get them.
    checked: str = ""
    seal_hint: str | None = None
    # What ``step`` counts (``layouts.base.Numbering``): accelerate's checkpoint_N, a "save index".
    numbered_by: str = "step"

    def __post_init__(self) -> None:
        self.checked = self.checked or self.level

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def label(self) -> str:
        """``step 20``, or ``save index 2``: its number named for what it counts."""
        return numbered(self.numbered_by, self.step)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["problems"] = [{**asdict(p), "text": str(p)} for p in self.problems]
        if not self.ranks:  # a plain run's document is unchanged
            del d["ranks"]
        if self.seal_hint is None:
            del d["seal_hint"]
        del d["untested"]
        return d


def report_of(url: str, checked: Checked, seconds: float, nodes: tuple[str, ...] = ()) -> VerifyReport:
    """The report of ``checked``, a check of the checkpoint at ``url`` (``nodes``: the node of
    each rank of the job that shared it)."""
    ranks = [RankShare(r, nodes[r] if r < len(nodes) else "?", s.files, s.bytes_read, s.seconds)
             for r, s in enumerate(checked.shares)]
    return VerifyReport(url, checked.level, checked.step, list(checked.problems), checked.files, checked.tensors,
                        checked.bytes_read, seconds, "; ".join(checked.notes) or None, ranks,
                        checked.structural + checked.not_loaded, checked_by(checked.level, checked.unsummed),
                        checked.seal_hint)
