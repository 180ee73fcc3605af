"""The file formats' names: what ``convert --to`` accepts and what a reader reads a path as.

Which format a path holds is ``layouts.classify``'s one answer (through ``layouts.files``, from
names and magic bytes only); this module keeps the vocabulary the readers and writers share.
Kept apart from the format readers (``dcp_io``, ``safetensors_io``, ``torch_io``), which import
torch: naming a format must not cost a torch import.
"""

from __future__ import annotations

from typing import Literal

from ckptctl.errors import UsageError
from ckptctl.format.formats import FILE_FORMATS, name_among

Format = Literal["ckptctl", "dcp", "safetensors", "torch"]
# The file formats of the shared vocabulary (``format.formats``), which names layouts too.
FORMATS: tuple[Format, ...] = FILE_FORMATS  # type: ignore[assignment]
SAFETENSORS_INDEX = "model.safetensors.index.json"


def format_named(name: str) -> Format:
    """The file format ``name`` (a name or an alias of ``format.formats``) stands for. Raises
    UsageError for an unknown name or a layout that is no file format (``--to hf-trainer``)."""
    try:
        return name_among(name, FILE_FORMATS)  # type: ignore[return-value]
    except ValueError as e:
        raise UsageError(f"--to: {e}", hint=f"use one of {', '.join(FILE_FORMATS)}") from None
