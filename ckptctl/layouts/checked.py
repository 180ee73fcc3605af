"""What checking one checkpoint finds: the typed result of every layout's ``check``.

- ``Level``: how deep a check goes, each level including the ones before: ``quick`` (the commit
  rule, every file present and of its size, headers), ``checksums`` (every byte against the
  checksums that exist: a manifest's, a seal's, the stack's own CRC-32s), ``load`` (every file
  the stack reads on resume test-loaded, or decoded structurally where torch refuses it).
- ``Problem``: one thing wrong, located as precisely as it can be (file, tensor, byte range).
- ``Checked``: everything one check found, the one record of it; a verb's report
  (``ops.verify.report.VerifyReport``) is a view of it, adding where and how long.
- ``Split``: how the work of one check is shared by the processes of one job (a ``verify``
  started by torchrun): which files this process reads, and everyone's results. A layout asks
  it and never talks to torch.distributed itself; ``ALONE`` is one process doing all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence, TypeVar

Level = Literal["quick", "checksums", "load"]
LEVELS: tuple[Level, ...] = ("quick", "checksums", "load")

T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    """One thing wrong, located as precisely as it can be."""

    message: str
    file: str | None = None
    tensor: str | None = None
    byte_range: tuple[int, int] | None = None
    hint: str | None = None

    def __str__(self) -> str:
        where = [p for p in (self.file, f"tensor {self.tensor!r}" if self.tensor else None) if p]
        if self.byte_range:
            where.append(f"bytes {self.byte_range[0]}-{self.byte_range[1]}")
        return (": ".join([", ".join(where), self.message]) if where else self.message)


@dataclass(frozen=True)
class Share:
    """What one process of a split check read: its share of the files."""

    files: int
    bytes_read: int
    seconds: float


@dataclass
class Checked:
    """What one layout's check of one checkpoint found. Problems make it fail; nothing raises
    for a problem of the checkpoint (only for storage that cannot be read)."""

    level: Level
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0
    notes: list[str] = field(default_factory=list)  # what this level could not check, what vouched for it
    # "NAME: decoded structurally: names ...; never unpickled": torch refused it, its stream is whole
    structural: list[str] = field(default_factory=list)
    # "NAME: not decoded (...)", files the stack reads on resume: the load level fails on them
    not_loaded: list[str] = field(default_factory=list)
    # What is wrong with files the stack never reads on resume (the Trainer's training_args.bin):
    # reported, never a reason to call the checkpoint broken.
    unread: list[str] = field(default_factory=list)
    shares: list[Share] = field(default_factory=list)  # split over a job's processes: each one's, by rank
    # The files this check read whose format records no checksum ("*.safetensors", "*.distcp"):
    # their bytes were checked for structure only (``checked_by``).
    unsummed: list[str] = field(default_factory=list)
    # What would give those files checksums (`ckptctl seal`, an integration); None when nothing can.
    seal_hint: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def checked_by(level: Level, unsummed: Sequence[str]) -> str:
    """What a check at ``level`` actually established, in the words of every verdict line:
    ``checksums`` only where every file's bytes were hashed against a recorded checksum,
    ``structure`` (headers, sizes, CRC-less decoding) where some format records none."""
    return "structure" if level == "checksums" and unsummed else level


class Split(Protocol):
    """How one check is shared by the processes of a job."""

    def mine(self, sizes: Sequence[int]) -> list[int]:
        """The indices of the items (of ``sizes`` bytes each) this process checks; together the
        processes take each item once."""

    def each(self, work: Callable[[], T]) -> list[T]:
        """``work()`` here, and every process's result, by rank. When ``work`` raised a
        ``CkptError`` on any process, that error is raised on every process."""


class _Alone:
    """One process does all of it."""

    def mine(self, sizes: Sequence[int]) -> list[int]:
        return list(range(len(sizes)))

    def each(self, work: Callable[[], T]) -> list[T]:
        return [work()]


ALONE: Split = _Alone()


def by_one(split: Split, work: Callable[[], T]) -> T:
    """``work()`` done by one process of the split (the one given the single item), its result
    given to every process: for a check that reads nothing worth sharing."""
    mine = bool(split.mine([1]))
    return next(r for r in split.each(lambda: (work(),) if mine else None) if r is not None)[0]
