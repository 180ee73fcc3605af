"""What every foreign format offers the converter: tensor metadata, one tensor at a time, and
whatever structure and non-tensor state the format can hold.

A ``Source`` never loads a whole checkpoint: ``read_into`` fills one caller-owned tensor, so a
conversion holds one tensor (plus the format's own temporaries) at a time.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ckptctl.format import dtypes
from ckptctl.interop.steps import StepClue
from ckptctl.state import tree as statetree


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # manifest dtype name (ckptctl.format.dtypes)
    shape: tuple[int, ...]
    group: str = "other"  # model / optimizer / other, for inspect's byte counts

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


# Fills ``out`` (contiguous CPU, the meta's dtype and shape) with the tensor's values.
Fill = Callable[[TensorMeta, torch.Tensor], None]


class Source(ABC):
    kind: str  # "ckptctl", "dcp", "safetensors" or "torch": what detection found
    url: str
    has_checksums: bool = False

    def __init__(self) -> None:
        self.tensors: dict[str, TensorMeta] = {}
        # The state's structure as ckptctl.state.tree encodes it (tensors as {"__tensor__": name}),
        # or None when the format has nothing beyond flat names.
        self.tree: Any | None = None
        self.metadata: dict[str, str] = {}  # string metadata (safetensors __metadata__)
        self.step: int | None = None  # the step every clue agrees on (``settle_step``), else None
        self.step_clues: list[StepClue] = []  # each place the source records its step (``interop.steps``)
        self.dropped: list[str] = []  # non-tensor state this source could not hand over, and why
        # Files left unread by design (a pickle of a class), and why: not carried either, but no
        # sign of damage, so ``verify`` does not count them as problems.
        self.skipped: list[str] = []

    @abstractmethod
    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (the tensor's own dtype and shape) with tensor ``name``."""

    def close(self) -> None:
        pass

    def settle_step(self) -> None:
        """``step`` from the clues: their common value, or None when there is none or they
        disagree (``interop.steps.decide_step`` then says which, for a caller that needs it)."""
        steps = {c.step for c in self.step_clues}
        self.step = steps.pop() if len(steps) == 1 else None

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def group_of(name: str) -> str:
    top = name.split("/", 1)[0].split(".", 1)[0]
    if top in ("model", "module", "models", "state_dict"):  # state_dict: Lightning's (and many a torch.save's) model
        return "model"
    if top.startswith("optim"):
        return "optimizer"
    return "other" if "/" in name else "model"  # a flat weights file is a model


@dataclass
class Written:
    """What a writer produced, for the report."""

    files: list[str] = field(default_factory=list)
    bytes: int = 0


def return_freed_memory() -> None:
    """Make large allocations go straight back to the OS when freed (glibc only; a no-op
    elsewhere). Call once, early, in a process that streams tensors.

    glibc raises its mmap threshold each time a large mmapped block is freed, after which
    blocks of that size come from the heap instead, where a freed tensor is not returned but
    fragments: streaming 16 MiB tensors through DCP's writer grew the process by 16 MiB per
    tensor (measured: a 256 MiB conversion peaked 284 MiB above baseline; with a fixed 1 MiB
    threshold, 36 MiB). A fixed threshold keeps every tensor-sized block mmapped.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, 1 << 20)


def rename_refs(doc: Any, rename: Callable[[str], str]) -> Any:
    """The encoded state ``doc`` (``state.tree``) with every tensor reference renamed."""
    if isinstance(doc, list):
        return [rename_refs(v, rename) for v in doc]
    if isinstance(doc, dict):
        if len(doc) == 1 and statetree.TENSOR in doc:
            return {statetree.TENSOR: rename(doc[statetree.TENSOR])}
        if len(doc) == 1 and isinstance(doc.get(statetree.ITEMS), list):  # keys stay: only values hold refs
            return {statetree.ITEMS: [[kv[0], rename_refs(kv[1], rename)] for kv in doc[statetree.ITEMS]]}
        return {k: rename_refs(v, rename) for k, v in doc.items()}
    return doc
