"""Tensor dtypes by name: the manifest's names, safetensors' codes and torch's objects."""

from __future__ import annotations

import torch

# manifest name -> (safetensors code, torch dtype)
_TABLE: dict[str, tuple[str, torch.dtype]] = {
    "float64": ("F64", torch.float64),
    "float32": ("F32", torch.float32),
    "float16": ("F16", torch.float16),
    "bfloat16": ("BF16", torch.bfloat16),
    "float8_e4m3fn": ("F8_E4M3", torch.float8_e4m3fn),
    "float8_e5m2": ("F8_E5M2", torch.float8_e5m2),
    "int64": ("I64", torch.int64),
    "int32": ("I32", torch.int32),
    "int16": ("I16", torch.int16),
    "int8": ("I8", torch.int8),
    "uint8": ("U8", torch.uint8),
    "uint16": ("U16", torch.uint16),
    "uint32": ("U32", torch.uint32),
    "uint64": ("U64", torch.uint64),
    "bool": ("BOOL", torch.bool),
    "complex64": ("C64", torch.complex64),
}
_BY_TORCH = {t: name for name, (_, t) in _TABLE.items()}
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}


def name_of(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint") from None


def torch_dtype(name: str) -> torch.dtype:
    return _TABLE[name][1]


def code_of(name: str) -> str:
    return _TABLE[name][0]


def name_from_code(code: str) -> str | None:
    return _BY_CODE.get(code)


def itemsize(name: str) -> int:
    return _TABLE[name][1].itemsize


def is_known(name: str) -> bool:
    return name in _TABLE
