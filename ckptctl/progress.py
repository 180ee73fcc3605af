"""The progress callback type every long operation accepts, defined once.

A leaf module: no torch, no terminal library. Library functions take ``progress:
Progress | None`` and call it with the number of bytes just processed (read, hashed, copied
or written), possibly from several threads at once; the CLI builds the visible bar
(``ckptctl.cli.progress``) and a library user may pass any callable.
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int], None]  # called with the number of bytes just processed

__all__ = ["Progress"]
