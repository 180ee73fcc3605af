"""A byte progress bar on stderr, shown only on a terminal (cron logs stay clean)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

from tqdm import tqdm

from ckptctl.progress import Progress


@contextlib.contextmanager
def byte_progress(desc: str, total: int | None = None, *, quiet: bool = False) -> Iterator[Progress | None]:
    """A ``Progress`` callback drawing a byte bar named ``desc`` on a terminal; None (no
    callback at all) when stderr is not one, or with ``quiet`` (``--quiet``)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    # unit "iB" scaled by 1024 reads KiB, MiB, GiB: the units of the rest of the output.
    bar = tqdm(total=total, desc=desc, unit="iB", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)
    lock = threading.Lock()  # callbacks arrive from reader threads

    def update(n: int) -> None:
        with lock:
            bar.update(n)

    try:
        yield update
    finally:
        bar.close()
