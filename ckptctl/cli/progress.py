"""A byte progress bar on stderr, shown only on a terminal (cron logs stay clean)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator

from tqdm import tqdm


@contextlib.contextmanager
def byte_progress(desc: str, total: int | None = None) -> Iterator[Callable[[int], None] | None]:
    if not sys.stderr.isatty():
        yield None
        return
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)
    lock = threading.Lock()  # callbacks arrive from reader threads

    def update(n: int) -> None:
        with lock:
            bar.update(n)

    try:
        yield update
    finally:
        bar.close()
