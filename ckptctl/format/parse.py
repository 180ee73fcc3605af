"""The validated parsing of every JSON document ckptctl reads: bytes in, typed values or
``InvalidCheckpoint`` out.

Every file under a checkpoint root is untrusted input (a manifest, a marker, a shard header, the
lock, the verification record, a Hugging Face index). Parsing one must never raise anything but
``InvalidCheckpoint``, never recurse without bound and never hand a caller a value of a type it
did not ask for. So:

- ``load_json`` bounds the size, refuses invalid UTF-8, NaN/Infinity (unless a document's free
  state may hold them), numbers that overflow a float and integers longer than 40 digits, then
  walks the result *iteratively* and refuses nesting deeper than ``max_depth`` and strings that
  are not valid Unicode (lone surrogates from ``\\ud800`` escapes, which cannot be printed or
  written back). Python's ``json`` recurses once per nesting level; a RecursionError from it is
  caught and becomes ``InvalidCheckpoint`` too, so depth is bounded both ways.
- ``Obj`` reads typed fields from one JSON object: an int in a range (never a bool), a finite
  float in a range, a string of bounded length, a list or object of bounded size. Unknown keys
  are ignored (forward compatibility, see ``check_version``).
- ``check_version`` refuses a document written by a newer major format version with a message
  that says to upgrade.
- ``shape`` validates a tensor shape: non-negative ints whose element count times the element
  size fits in int64.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from ckptctl.errors import InvalidCheckpoint

INT64_MAX = (1 << 63) - 1
# Deep enough for any state ckptctl writes (``ckptctl.state.tree`` limits a state to 40 levels
# of nesting, at most 3 JSON levels each) and far below Python's recursion limit, so code that
# walks a parsed document recursively (decoding a state tree) cannot hit it either.
MAX_DEPTH = 128
MAX_DIMS = 64  # torch's own limit on a tensor's number of dimensions
_MAX_INT_DIGITS = 40  # well past 2**64; longer integers are garbage, and slow to convert
# Epoch seconds later than this (about the year 5138) are not a plausible time.
MAX_TIME = 1e11

_UNSET: Any = object()


class _Refused(ValueError):
    """Raised from inside ``json.loads`` hooks; turned into InvalidCheckpoint by load_json."""


def _no_constant(text: str) -> NoReturn:
    raise _Refused(f"non-finite number {text}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} overflows a float")
    return value


def _any_float(text: str) -> float:
    return float(text)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _Refused(f"integer of {len(text)} digits")
    return int(text)


def invalid(where: str, message: str, *, hint: str | None = None) -> InvalidCheckpoint:
    """The error every parser raises: one line naming the file, a hint saying what to do."""
    return InvalidCheckpoint(
        f"{where}: {message}",
        hint=hint or "the file is damaged or was not written by ckptctl; do not trust it",
    )


def load_json(
    raw: bytes | str,
    where: str,
    what: str,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    allow_nonfinite: bool = False,
) -> Any:
    """Parse one JSON document of at most ``max_bytes`` bytes nested at most ``max_depth`` deep.

    ``what`` names the document in messages ("manifest", "commit marker"). With
    ``allow_nonfinite`` NaN and ±Infinity are accepted (a saved state may hold them); typed
    fields are still checked finite by ``Obj.float``. Raises InvalidCheckpoint, nothing else.
    """
    if len(raw) > max_bytes:
        raise invalid(where, f"{what} has {len(raw)} bytes, more than the {max_bytes} allowed")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise invalid(where, f"{what} is not UTF-8 text (byte {e.start})") from None
    else:
        text = raw
    try:
        doc = json.loads(
            text,
            parse_constant=_any_float if allow_nonfinite else _no_constant,
            parse_float=_any_float if allow_nonfinite else _finite_float,
            parse_int=_bounded_int,
        )
    except RecursionError:
        raise invalid(where, f"{what} is nested too deeply") from None
    except _Refused as e:
        raise invalid(where, f"{what} holds a {e}") from None
    except json.JSONDecodeError as e:
        raise invalid(where, f"{what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # e.g. an integer over Python's int/str conversion limit
        raise invalid(where, f"{what} is not valid JSON ({str(e)[:120]})") from None
    _check_tree(doc, where, what, max_depth)
    return doc


def _check_tree(doc: Any, where: str, what: str, max_depth: int) -> None:
    """Depth and string validity, checked with an explicit stack: never recursion."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, where, what)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise invalid(where, f"{what} is nested more than {max_depth} levels deep")
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, where, what)
                stack.append((v, depth + 1))
        else:
            stack.extend((v, depth + 1) for v in node)


def _check_text(s: str, where: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(where, f"{what} holds a string that is not valid Unicode ({ascii(s[:40])})") from None


def check_version(doc: dict[str, Any], where: str, what: str, *, supported: int, key: str = "version") -> int:
    """The document's format major version. A higher one than ``supported`` was written by a
    newer ckptctl and is refused with a message saying to upgrade; a version that is not a
    positive integer is garbage."""
    v = doc.get(key, _UNSET)
    if v is _UNSET:
        raise invalid(where, f"{what} has no {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise invalid(where, f"{what} has a bad {key!r}: {show(v)}")
    if v > supported:
        raise InvalidCheckpoint(
            f"{where}: {what} was written by a newer ckptctl (format v{v}); upgrade",
            hint=f"this ckptctl reads format v{supported}; install a newer ckptctl to read it",
        )
    return v


def show(v: Any) -> str:
    """A short, printable rendering of an untrusted value for a message."""
    if isinstance(v, (dict, list)) and len(v) > 8:
        return f"a {type(v).__name__} of {len(v)} items"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return "a huge integer"
    try:
        text = ascii(v)
    except RecursionError:  # only reachable for values not from load_json
        return type(v).__name__
    return text if len(text) <= 60 else text[:57] + "..."


class Obj:
    """Typed reads from one JSON object. Every failure is InvalidCheckpoint naming the file,
    the document and the field; unknown keys are ignored."""

    def __init__(self, doc: Any, where: str, what: str) -> None:
        if not isinstance(doc, dict):
            raise invalid(where, f"{what} is not a JSON object (got {type(doc).__name__})")
        self.doc = doc
        self.where = where
        self.what = what

    def bad(self, key: str, why: str) -> InvalidCheckpoint:
        return invalid(self.where, f"{self.what}: field {key!r} {why}")

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value). An optional field that is absent or null gives its default."""
        v = self.doc.get(key)
        if v is None:
            if default is _UNSET:
                raise self.bad(key, "is missing")
            return False, default
        return True, v

    def has(self, key: str) -> bool:
        return key in self.doc and self.doc[key] is not None

    def int(self, key: str, *, lo: int = 0, hi: int = INT64_MAX, default: Any = _UNSET) -> Any:
        """An integer in ``[lo, hi]``; booleans and floats are refused."""
        present, v = self._get(key, default)
        if not present:
            return v
        return as_int(v, lo=lo, hi=hi, err=lambda why: self.bad(key, why))

    def float(self, key: str, *, lo: float = -math.inf, hi: float = math.inf, default: Any = _UNSET) -> Any:
        """A finite number in ``[lo, hi]`` (an integer is accepted and returned as float)."""
        present, v = self._get(key, default)
        if not present:
            return v
        return as_float(v, lo=lo, hi=hi, err=lambda why: self.bad(key, why))

    def str(self, key: str, *, max_len: int = 4096, default: Any = _UNSET) -> Any:
        present, v = self._get(key, default)
        if not present:
            return v
        if not isinstance(v, str):
            raise self.bad(key, f"is not a string (got {show(v)})")
        if len(v) > max_len:
            raise self.bad(key, f"is longer than {max_len} characters")
        return v

    def list(self, key: str, *, max_len: int = 1 << 24, default: Any = _UNSET) -> Any:
        present, v = self._get(key, default)
        if not present:
            return v
        if not isinstance(v, list):
            raise self.bad(key, f"is not a list (got {type(v).__name__})")
        if len(v) > max_len:
            raise self.bad(key, f"has {len(v)} items, more than {max_len}")
        return v

    def dict(self, key: str, *, max_len: int = 1 << 24, default: Any = _UNSET) -> Any:
        present, v = self._get(key, default)
        if not present:
            return v
        if not isinstance(v, dict):
            raise self.bad(key, f"is not an object (got {type(v).__name__})")
        if len(v) > max_len:
            raise self.bad(key, f"has {len(v)} entries, more than {max_len}")
        return v

    def obj(self, key: str, what: str | None = None) -> "Obj":
        return Obj(self._get(key, _UNSET)[1], self.where, what or f"{self.what}: {key!r}")


def as_int(v: Any, *, lo: int, hi: int, err: Any) -> int:
    """``v`` if it is an int (not a bool) in ``[lo, hi]``; else raises ``err(why)``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise err(f"is not an integer (got {show(v)})")
    if not lo <= v <= hi:
        raise err(f"is {v if abs(v) < 10**30 else 'huge'}, outside {lo}..{hi}")
    return v


def as_float(v: Any, *, lo: float, hi: float, err: Any) -> float:
    """``v`` as a float if it is a finite number (not a bool) in ``[lo, hi]``; else ``err(why)``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise err(f"is not a number (got {show(v)})")
    try:
        f = float(v)
    except OverflowError:
        raise err("is too large") from None
    if not math.isfinite(f):
        raise err(f"is not finite ({f})")
    if not lo <= f <= hi:
        raise err(f"is {f:g}, outside {lo:g}..{hi:g}")
    return f


def shape(v: Any, itemsize: int, err: Any) -> tuple[int, ...]:
    """A tensor shape: at most ``MAX_DIMS`` non-negative ints whose element count times
    ``itemsize`` fits in int64 (so ``[2**62, 2**62]`` is refused). ``err(why)`` builds the error."""
    if not isinstance(v, (list, tuple)):
        raise err(f"is not a list (got {show(v)})")
    if len(v) > MAX_DIMS:
        raise err(f"has {len(v)} dimensions, more than {MAX_DIMS}")
    n = 1
    for d in v:
        as_int(d, lo=0, hi=INT64_MAX, err=lambda why: err(f"{show(list(v))}: a dimension {why}"))
        n *= d
        if n * itemsize > INT64_MAX:
            raise err(f"{show(list(v))} holds more bytes than fit in int64")
    return tuple(v)


def plain_file_name(name: Any) -> bool:
    """A record path a foreign format may name: one plain file name inside the checkpoint
    directory (no directory part, no ``..``, not absolute, not hidden, printable)."""
    if not isinstance(name, str) or not 0 < len(name) <= 255:
        return False
    if name in (".", "..") or name.startswith(".") or "/" in name or "\\" in name or "\x00" in name:
        return False
    return name.isprintable()


# The reserved keys of an encoded state tree (``ckptctl.state.tree``, which this layer may not
# import; a test checks that the two agree). The manifest's ``state`` is one such tree.
STATE_TENSOR, STATE_TUPLE, STATE_ITEMS = "__tensor__", "__tuple__", "__items__"


def check_state_tree(doc: Any, where: str, what: str = "saved state") -> None:
    """Raise InvalidCheckpoint unless ``doc`` is a well-formed encoded state tree: a reserved key
    alone in its object, holding what decoding expects (a tensor name, a list, a list of
    [key, value] pairs with plain keys). Iterative: the document is untrusted."""
    reserved_keys = {STATE_TENSOR, STATE_TUPLE, STATE_ITEMS}
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        reserved = reserved_keys & node.keys()
        if not reserved:
            stack.extend(node.values())
            continue
        key = min(reserved)
        inner = node[key]
        if key == STATE_TENSOR:
            ok = isinstance(inner, str)
        elif key == STATE_TUPLE:
            ok = isinstance(inner, list)
        else:
            ok = isinstance(inner, list) and all(
                isinstance(p, list) and len(p) == 2 and (p[0] is None or isinstance(p[0], (bool, int, float, str)))
                for p in inner
            )
        if len(node) != 1 or not ok:
            raise invalid(where, f"{what}: a {key!r} entry is malformed")
        if key == STATE_TUPLE:
            stack.extend(inner)
        elif key == STATE_ITEMS:
            stack.extend(p[1] for p in inner)
