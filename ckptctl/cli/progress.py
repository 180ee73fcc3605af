"""A byte progress bar on stderr, shown only on a terminal (cron logs stay clean)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

from tqdm import tqdm

from ckptctl.progress import Progress

# Total, %, bytes done of the total, elapsed<ETA and rate, in MiB/GiB (units of 1024).
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}]"
_FORMAT_NO_TOTAL = "{desc}: {n_fmt}{unit} [{elapsed}, {rate_fmt}]"


class _Bar:
    """The ``Progress`` callback the CLI passes down: counts bytes from any thread, and takes
    ``expect(n)`` from operations that know how many bytes are coming (``ckptctl.progress.expect_bytes``)."""

    def __init__(self, bar: tqdm) -> None:
        self._bar = bar
        self._lock = threading.Lock()  # callbacks arrive from reader threads

    def __call__(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def expect(self, n: int) -> None:
        with self._lock:
            self._bar.total = (self._bar.total or 0) + n
            self._bar.bar_format = _FORMAT
            self._bar.refresh()


@contextlib.contextmanager
def byte_progress(desc: str, total: int | None = None, *, quiet: bool = False) -> Iterator[Progress | None]:
    """A ``Progress`` callback drawing a byte bar named ``desc`` on a terminal; None (no
    callback at all) when stderr is not one, or with ``quiet`` (``--quiet``). The bar shows a
    total, %, rate and ETA once the total is known (``total``, or ``expect`` calls)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    # unit "iB" scaled by 1024 reads KiB, MiB, GiB: the units of the rest of the output.
    bar = tqdm(total=total, desc=desc, unit="iB", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False,
               bar_format=_FORMAT if total else _FORMAT_NO_TOTAL)
    try:
        yield _Bar(bar)
    finally:
        bar.close()
