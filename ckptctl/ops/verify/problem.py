"""``Problem``: one thing wrong with a checkpoint, located as precisely as it can be. Every
check that reports rather than raises (verify, cp/restore's source check, prune's anchor
check, foreign formats) collects these."""

from __future__ import annotations

from dataclasses import dataclass


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
