"""Durations as people type them (``90s``, ``15m``, ``1h30m``) and as people read them.

Used by ``--keep-within``, ``--cost`` and ``--mtbf``. Parsing is strict on purpose: a typo in a
retention window must be an error, never a silently different window.

>>> parse_duration("1h30m")
5400.0
>>> format_duration(5400)
'1h 30m'
"""

from __future__ import annotations

import math
import re

from ckptctl.errors import UsageError

__all__ = ["ACCEPTED_FORMS", "format_duration", "parse_duration"]

# Seconds per unit, largest first: compound durations must list units in this order.
_UNITS: dict[str, float] = {
    "w": 7 * 86400.0,
    "d": 86400.0,
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
    "ms": 0.001,
}
_RANK = {unit: i for i, unit in enumerate(_UNITS)}

# Digits with an optional fraction; no sign, exponent, underscores, 'nan' or 'inf', so that
# float() never sees anything we did not mean to accept.
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN = re.compile(rf"{_NUMBER}")
# 'ms' before 'm' so that "850ms" is not read as 850 minutes followed by garbage.
_PART = re.compile(rf"\s*({_NUMBER})(ms|w|d|h|m|s)")

ACCEPTED_FORMS = (
    "a number of seconds (90, 1.5) or NUMBER+UNIT with units ms, s, m, h, d, w "
    "(90s, 15m, 1.5h, 7d, 1w), combinable largest first (1h30m, 2h 5m)"
)


def parse_duration(text: str, *, option: str | None = None) -> float:
    """Parse a duration into seconds.

    Accepts plain numbers (seconds), ``NUMBER+UNIT`` with units ``ms s m h d w``, decimals
    (``1.5h``) and compounds with units largest first (``1h30m``, ``2h 5m``). Rejects signs,
    unknown units, repeated or out-of-order units, and empty text, with a
    :class:`~ckptctl.errors.UsageError` naming ``option`` (when given) and the text.

    >>> parse_duration("90")
    90.0
    >>> parse_duration("1.5h")
    5400.0
    >>> parse_duration("850ms")
    0.85
    """
    stripped = text.strip()
    if _PLAIN.fullmatch(stripped):
        return _finite(float(stripped), text, option)

    total = 0.0
    last_rank = -1
    pos = 0
    while pos < len(stripped):
        match = _PART.match(stripped, pos)
        if match is None:
            # Name the likely mistake: a negative window is the one people actually type.
            why = "durations cannot be negative" if stripped.startswith("-") else None
            raise _invalid(text, option, why=why)
        number, unit = match.groups()
        # Units must strictly decrease: "30m1h" or "1h1h" is more likely a typo than intent.
        if _RANK[unit] <= last_rank:
            raise _invalid(text, option, why="units must appear once each, largest first")
        last_rank = _RANK[unit]
        total += float(number) * _UNITS[unit]
        pos = match.end()
    if last_rank < 0:  # empty or whitespace only
        raise _invalid(text, option)
    return _finite(total, text, option)


def format_duration(seconds: float) -> str:
    """Format seconds for people: two units at most, rounded to the smaller one.

    >>> format_duration(0.85)
    '850ms'
    >>> format_duration(45.24)
    '45.2s'
    >>> format_duration(7500)
    '2h 5m'
    >>> format_duration(3 * 86400 + 7200)
    '3d 2h'
    """
    if not math.isfinite(seconds):
        raise ValueError(f"cannot format a non-finite duration: {seconds!r}")
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    # Each branch rounds first and falls through when rounding reaches the next unit, so the
    # output never reads "60s" or "1m 60s".
    if seconds < 1:
        ms = seconds * 1000
        text = _trim(f"{ms:.1f}") if ms < 10 else str(round(ms))
        if text != "1000":
            return text + "ms"
    tenths = round(seconds * 10)
    if tenths < 600:
        return _trim(f"{tenths / 10:.1f}") + "s"
    whole = round(seconds)
    if whole < 3600:
        return _pair(whole // 60, "m", whole % 60, "s")
    minutes = round(seconds / 60)
    if minutes < 24 * 60:
        return _pair(minutes // 60, "h", minutes % 60, "m")
    hours = round(seconds / 3600)
    return _pair(hours // 24, "d", hours % 24, "h")


def _pair(big: int, big_unit: str, small: int, small_unit: str) -> str:
    return f"{big}{big_unit}" if small == 0 else f"{big}{big_unit} {small}{small_unit}"


def _trim(number: str) -> str:
    return number[:-2] if number.endswith(".0") else number


def _finite(value: float, text: str, option: str | None) -> float:
    # "9" * 400 parses to inf; an infinite window would silently keep (or cost) everything.
    if not math.isfinite(value):
        raise _invalid(text, option, why="too large")
    return value


def _invalid(text: str, option: str | None, why: str | None = None) -> UsageError:
    where = f"{option}: " if option else ""
    detail = f" ({why})" if why else ""
    return UsageError(
        f"{where}invalid duration {text!r}{detail}",
        hint=f"use {ACCEPTED_FORMS}",
    )
