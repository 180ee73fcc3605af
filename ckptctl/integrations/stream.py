"""A Python file object over a ``Storage`` writer, for the stacks' own serialisers
(``torch.save`` in Lightning's and DCP's writers) to write into.

The stacks write through ``write(bytes)`` calls, many of them tiny (``torch.save`` writes each
zip header and padding on its own); small pieces are gathered into one buffer before they go
to the storage writer, so a save costs no more system calls than a buffered file. ``tap`` sees
every byte once, in order, as it is written (the seal's digest). ``close`` commits the file
(durable and whole under its final name); leaving a ``with`` block by an exception aborts it,
so a failed save leaves nothing under that name.
"""

from __future__ import annotations

from typing import Callable

from ckptctl.storage.base import Writer, byte_view

SMALL_WRITE = 64 << 10  # pieces below this are gathered before they are handed on
GATHER = 1 << 20  # gathered bytes handed on at once


class StorageStream:
    """Write-only file object over ``writer``; see the module docstring."""

    def __init__(self, writer: Writer, tap: Callable[[memoryview], None] | None = None) -> None:
        self._writer = writer
        self._tap = tap
        self._gathered = bytearray()
        self._pos = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = byte_view(data)
        if self._tap is not None:
            self._tap(view)
        self._pos += len(view)
        if len(view) < SMALL_WRITE:
            self._gathered += view
            if len(self._gathered) >= GATHER:
                self._hand_on()
        else:
            self._hand_on()
            self._writer.write(view)
        return len(view)

    def _hand_on(self) -> None:
        if self._gathered:
            self._writer.write(self._gathered)
            self._gathered = bytearray()

    def tell(self) -> int:
        return self._pos

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing: the bytes become durable on ``close`` (the storage writer's commit)."""

    def close(self) -> None:
        """Commit: the file is durable and whole under its name."""
        if not self.closed:
            self.closed = True
            self._hand_on()
            self._writer.commit()

    def abort(self) -> None:
        """Discard everything written: nothing appears under the name."""
        if not self.closed:
            self.closed = True
            self._writer.abort()

    def __enter__(self) -> "StorageStream":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
