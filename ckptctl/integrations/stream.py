"""A Python file object over a ``Storage`` writer, for the stacks' own serialisers
(``torch.save`` in Lightning's and DCP's writers) to write into.

The stacks write through ``write(bytes)`` calls, many of them tiny (``torch.save`` writes each
zip header and padding on its own); small pieces are gathered into one buffer before they go
to the storage writer, so a save costs no more system calls than a buffered file. ``tap`` sees
every byte once, in order, as it is handed to the storage writer (the seal's digest). A large
piece is tapped on a helper thread while this thread writes it, and ``write`` returns only when
both are done: the caller may reuse its buffer after ``write``, so the bytes tapped are the
bytes written. The writing thread waits on the disk for much of a large file (the storage
writer's write-behind), so on the helper the hash costs that thread nothing (xxhash and the
system calls release the GIL). ``close`` commits the file (durable and whole under its final
name); leaving a ``with`` block by an exception aborts it, so a failed save leaves nothing
under that name.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

from ckptctl.storage.base import Writer, byte_view

SMALL_WRITE = 64 << 10  # pieces below this are gathered before they are handed on
GATHER = 1 << 20  # gathered bytes handed on at once
TAP_BESIDE = 4 << 20  # pieces from this size are tapped on the helper thread; smaller ones cost
# less to hash (about 0.15 ms) than to hand to a thread and back


class StorageStream:
    """Write-only file object over ``writer``; see the module docstring."""

    def __init__(self, writer: Writer, tap: Callable[[memoryview], None] | None = None) -> None:
        self._writer = writer
        self._tap = tap
        self._helper: ThreadPoolExecutor | None = None  # started by the first large piece
        self._gathered = bytearray()
        self._pos = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = byte_view(data)
        self._pos += len(view)
        if len(view) < SMALL_WRITE:
            self._gathered += view
            if len(self._gathered) >= GATHER:
                self._hand_on()
        else:
            self._hand_on()
            self._pass_on(view)
        return len(view)

    def _hand_on(self) -> None:
        if self._gathered:
            self._pass_on(memoryview(self._gathered))
            self._gathered = bytearray()

    def _pass_on(self, view: memoryview) -> None:
        """Tap ``view`` and write it; a large one on two threads at once, both finished on return."""
        if self._tap is None or len(view) < TAP_BESIDE:
            if self._tap is not None:
                self._tap(view)
            self._writer.write(view)
            return
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-tap")
        tapped = self._helper.submit(self._tap, view)
        try:
            self._writer.write(view)
        finally:
            wait([tapped])  # the caller's buffer is tapped to its end before write returns, even on failure
        tapped.result()  # the tap's own exception, if it raised

    def _stop_helper(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

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
            try:
                self._hand_on()
            finally:
                self._stop_helper()
            self._writer.commit()

    def abort(self) -> None:
        """Discard everything written: nothing appears under the name."""
        if not self.closed:
            self.closed = True
            self._stop_helper()
            self._writer.abort()

    def __enter__(self) -> "StorageStream":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
