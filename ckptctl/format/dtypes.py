"""Tensor dtypes by name: the manifest's names, safetensors' codes and torch's objects.

The table is plain strings and sizes, so reading manifests and shard headers (``ckptctl ls``,
``latest``, ``verify``, ``prune``: shell and cron commands that run many times) never imports
torch, whose import alone takes seconds. A manifest name is also the name of the dtype in the
``torch`` module (``"bfloat16"`` is ``torch.bfloat16``); torch is imported only by
``torch_dtype``, the one function that returns a torch object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# manifest name (= attribute of the torch module) -> (safetensors code, bytes per element)
_TABLE: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "bool": ("BOOL", 1),
    "complex64": ("C64", 8),
}
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for a dtype a checkpoint cannot hold."""
    text = str(dtype)  # "torch.bfloat16": no torch import needed to read it
    name = text.removeprefix("torch.")
    if name == text or name not in _TABLE:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; KeyError for an unknown name."""
    _TABLE[name]  # unknown names fail here, as KeyError, before torch is imported
    import torch  # deferred: only callers that build tensors pay for importing torch

    return getattr(torch, name)


def code_of(name: str) -> str:
    return _TABLE[name][0]


def name_from_code(code: str) -> str | None:
    return _BY_CODE.get(code) if isinstance(code, str) else None


def itemsize(name: str) -> int:
    return _TABLE[name][1]


def is_known(name: str) -> bool:
    return isinstance(name, str) and name in _TABLE


def names() -> list[str]:
    """Every dtype name a checkpoint can hold, in the table's order."""
    return list(_TABLE)
