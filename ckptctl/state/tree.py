"""Encoding nested state as JSON with tensors pulled out by name.

The encoding is lossless for what training state holds and never uses pickle:

- a tensor becomes ``{"__tensor__": "optimizer/state/fc.weight/exp_avg"}`` (its bytes go to a
  shard under that name);
- a tuple becomes ``{"__tuple__": [...]}`` (optimizer betas, Python's RNG state);
- a dict whose keys are not all strings, or that uses one of these reserved keys, becomes
  ``{"__items__": [[key, value], ...]}``;
- str, int, float (including inf and nan), bool, None and lists are themselves.

Anything else is a ``StateError`` naming the key, so nothing is silently dropped.
Names join the path's keys with ``/``; a ``/`` or ``%`` inside a key is percent-escaped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ckptctl.errors import StateError
from ckptctl.format import dtypes, parse

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"
_RESERVED = {TENSOR, TUPLE, ITEMS}
# Each level of a state is at most 3 JSON levels once encoded (a dict with odd keys), so 40
# stays inside the parsers' bound (``format.parse.MAX_DEPTH``) with room for the file around it.
MAX_DEPTH = 40


def _is_text(s: Any) -> bool:
    if not isinstance(s, str):
        return True  # non-string dict keys are encoded as values: checked there
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(path: tuple[str, ...]) -> str:
    """The state key of ``path`` for a message, printable whatever the key holds."""
    return ascii(join(path)) if not all(_is_text(p) for p in path) else repr(join(path))


def join(path: tuple[str, ...]) -> str:
    return "/".join(p.replace("%", "%25").replace("/", "%2F") for p in path)


def encode(value: Any, path: tuple[str, ...], on_tensor: Callable[[str, torch.Tensor], None]) -> Any:
    """JSON form of ``value``; every tensor is handed to ``on_tensor(name, tensor)``."""
    if len(path) > MAX_DEPTH:
        raise StateError(
            f"state key {_shown(path[:4])}/...: nested more than {MAX_DEPTH} levels deep",
            hint="checkpoint state is read back by a bounded parser; flatten this value",
        )
    if (path and not _is_text(path[-1])) or not _is_text(value):
        raise StateError(
            f"state key {_shown(path)}: a key or string that is not valid Unicode (a lone "
            "surrogate) cannot be saved",
            hint="keys and strings must be encodable as UTF-8; fix or drop this value",
        )
    if isinstance(value, torch.Tensor):
        name = join(path)
        on_tensor(name, value)
        return {TENSOR: name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _RESERVED & value.keys():
            return {k: encode(v, path + (k,), on_tensor) for k, v in value.items()}
        return {ITEMS: [[_key(k, path), encode(v, path + (str(k),), on_tensor)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v, path + (str(i),), on_tensor) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, path + (str(i),), on_tensor) for i, v in enumerate(value)]}
    raise StateError(
        f"state key {join(path)!r}: a {type(value).__name__} cannot be saved",
        hint="checkpoint state may hold tensors, objects with state_dict(), and JSON values "
        "(dict, list, tuple, str, int, float, bool, None); convert this value first",
    )


def check_savable(name: str, t: torch.Tensor) -> None:
    """Raise StateError naming state key ``name`` unless ``t`` is a tensor a checkpoint can
    hold: dense (strided), not quantized, with data (not on the meta device), of a supported dtype."""
    why = None
    if getattr(t, "is_nested", False):
        why = "a nested tensor"
    elif t.layout != torch.strided:
        why = f"a sparse tensor ({t.layout})"
    elif t.is_quantized:
        why = f"a quantized tensor ({t.dtype})"
    elif t.device.type == "meta":
        why = "a meta tensor (it has no data)"
    else:
        try:
            dtypes.name_of(t.dtype)
        except ValueError:
            why = f"a {t.dtype} tensor"
    if why is not None:
        raise StateError(
            f"state key {repr(name) if _is_text(name) else ascii(name)}: {why} cannot be saved",
            hint=f"checkpoints hold dense tensors with data, of dtype {', '.join(dtypes.names())}; "
            "convert it first (e.g. .to_dense(), .dequantize(), .to(torch.float32))",
        )


def _key(k: Any, path: tuple[str, ...]) -> Any:
    if k is None or isinstance(k, (bool, int, float, str)):
        return k
    raise StateError(f"state key {join(path)!r}: dict key {k!r} of type {type(k).__name__} cannot be saved")


def decode(doc: Any, get_tensor: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of ``encode``; ``get_tensor(name)`` supplies each tensor."""
    if isinstance(doc, list):
        return [decode(v, get_tensor) for v in doc]
    if isinstance(doc, dict):
        if TENSOR in doc and len(doc) == 1:
            return get_tensor(doc[TENSOR])
        if TUPLE in doc and len(doc) == 1:
            return tuple(decode(v, get_tensor) for v in doc[TUPLE])
        if ITEMS in doc and len(doc) == 1:
            return {k: decode(v, get_tensor) for k, v in doc[ITEMS]}
        return {k: decode(v, get_tensor) for k, v in doc.items()}
    return doc


def tensor_refs(doc: Any) -> list[str]:
    """Names of every tensor an encoded tree refers to, in order."""
    out: list[str] = []
    decode(doc, lambda n: out.append(n))  # type: ignore[func-returns-value]
    return out


def check(doc: Any, where: str) -> None:
    """Raise InvalidCheckpoint (naming ``where``) unless ``doc`` is a well-formed encoded tree
    that ``decode`` can walk (see ``format.parse.check_state_tree``)."""
    parse.check_state_tree(doc, where)
