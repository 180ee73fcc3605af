"""Durations: strict parsing of what people type, and readable formatting."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptctl.durations import format_duration, parse_duration
from ckptctl.errors import EXIT_USAGE, UsageError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("90s", 90.0),
        ("15m", 900.0),
        ("6h", 21600.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        ("1.5h", 5400.0),
        (".5h", 1800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("2d12h", 216000.0),
        ("1w1d1h1m1s", 604800.0 + 86400 + 3600 + 60 + 1),
        ("850ms", 0.85),
        ("1s500ms", 1.5),
        ("  6h  ", 21600.0),
    ],
)
def test_parse_accepts(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "-5",
        "-5m",
        "+5m",
        "5x",
        "h",
        "1h30",  # trailing bare number: minutes or seconds? refuse to guess
        "30m1h",  # out of order
        "1h1h",  # repeated unit
        "1 h",
        "1e3",
        "nan",
        "inf",
        "1H",  # "M" could mean months; only lower-case units
        "5 minutes",
        "9" * 400 + "s",  # overflows to inf
    ],
)
def test_parse_rejects_with_usage_error(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_duration(text, option="--keep-within")
    err = info.value
    assert err.exit_code == EXIT_USAGE
    message = str(err)
    assert "\n" not in message
    assert message.startswith("--keep-within: ")
    assert repr(text) in message
    assert err.hint is not None and "ms, s, m, h, d, w" in err.hint and "1h30m" in err.hint


def test_negative_is_named_as_such() -> None:
    with pytest.raises(UsageError, match="cannot be negative"):
        parse_duration("-6h", option="--keep-within")


def test_parse_without_option_still_names_text() -> None:
    with pytest.raises(UsageError, match=r"^invalid duration 'soon'$"):
        parse_duration("soon")


@given(
    st.integers(0, 52),
    st.integers(0, 6),
    st.integers(0, 23),
    st.integers(0, 59),
    st.integers(0, 59),
)
def test_compound_is_the_sum_of_its_parts(w: int, d: int, h: int, m: int, s: int) -> None:
    text = f"{w}w{d}d{h}h{m}m{s}s"
    assert parse_duration(text) == w * 604800 + d * 86400 + h * 3600 + m * 60 + s


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.85, "850ms"),
        (0.0042, "4.2ms"),
        (0.9996, "1s"),  # rounds up into seconds, never "1000ms"
        (1, "1s"),
        (45.24, "45.2s"),
        (45.0, "45s"),
        (59.96, "1m"),  # never "60s"
        (90, "1m 30s"),
        (3599.6, "1h"),  # never "59m 60s"
        (7500, "2h 5m"),
        (6 * 3600, "6h"),
        (86399, "1d"),
        (3 * 86400 + 7200, "3d 2h"),
        (-5, "-5s"),
    ],
)
def test_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_format_rejects_non_finite(bad: float) -> None:
    with pytest.raises(ValueError):
        format_duration(bad)


@given(st.floats(min_value=0, max_value=1e8, allow_nan=False))
def test_format_round_trips_within_its_rounding(seconds: float) -> None:
    text = format_duration(seconds)
    back = parse_duration(text)
    # Half of the smallest unit shown, for the range the value falls in.
    if seconds < 1:
        tolerance = 0.0005
    elif seconds < 60:
        tolerance = 0.05
    elif seconds < 3600:
        tolerance = 0.5
    elif seconds < 86400:
        tolerance = 30
    else:
        tolerance = 1800
    assert abs(back - seconds) <= tolerance + 1e-9 * seconds, (seconds, text, back)


@given(st.floats(min_value=0, max_value=1e8, allow_nan=False))
def test_format_never_shows_a_full_smaller_unit(seconds: float) -> None:
    text = format_duration(seconds)
    assert not re.search(r"\b(60s|60m|24h|1000ms)\b", text), text
    assert len(text.split()) <= 2
