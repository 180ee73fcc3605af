"""Telling a progress bar how many bytes are coming, so it can show a total, %, and an ETA.

``Progress`` (``ckptctl.progress``) is a plain callable taking the bytes just processed. A
callable that also has an ``expect(n)`` method (the CLI's bar has) is told beforehand, by the
operations that know it, that ``n`` more bytes will be reported. Any other callable is left
as it is, so a library user's ``progress=print`` keeps working.
"""

from __future__ import annotations

from ckptctl.progress import Progress


def expect_bytes(progress: Progress | None, n: int) -> None:
    """Add ``n`` to the total that ``progress`` will be called with, if it keeps one."""
    expect = getattr(progress, "expect", None)
    if callable(expect) and n > 0:
        expect(n)


def counting_only(progress: Progress | None) -> Progress | None:
    """``progress`` without its ``expect``: for an inner operation whose bytes the caller
    already announced (a sync announces every copy's bytes up front)."""
    if progress is None:
        return None
    return lambda n: progress(n)
