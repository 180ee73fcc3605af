"""The progress callback type every long operation accepts, defined once, and telling it a total.

A leaf module: no torch, no terminal library. Library functions take ``progress:
Progress | None`` and call it with the number of bytes just processed (read, hashed, copied
or written), possibly from several threads at once; the CLI builds the visible bar
(``ckptctl.cli.progress``) and a library user may pass any callable.

A callable that also has an ``expect(n)`` method (the CLI's bar has) is told beforehand, by the
operations that know it, that ``n`` more bytes will be reported (``expect_bytes``), so it can
show a total, %, and an ETA. Any other callable is left as it is, so a library user's
``progress=print`` keeps working.
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int], None]  # called with the number of bytes just processed


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


__all__ = ["Progress", "counting_only", "expect_bytes"]
