"""Looking at many checkpoints at once: what a verb that lists a whole root does for each of
its checkpoints (read its marker and manifest, list its files) is a few small reads, and on
object storage or a network filesystem each is a round trip. ``each`` runs them on
``settings.REQUEST_THREADS`` threads and keeps the order, so a listing of a root costs a few
round trips instead of a few per checkpoint.

Only for reads. Deletes keep an order of their own (the commit files first, one at a time:
``layouts.removal``), and writes never go several at once through here.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

from ckptctl.settings import REQUEST_THREADS

T = TypeVar("T")
R = TypeVar("R")


def each(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, up to ``REQUEST_THREADS`` at a time, in order. The first
    item (in order) whose call raised raises here, after every call started has ended."""
    todo = list(items)
    if len(todo) <= 1:
        return [fn(x) for x in todo]
    with ThreadPoolExecutor(min(REQUEST_THREADS, len(todo)), thread_name_prefix="ckptctl-lookup") as pool:
        futures = [pool.submit(fn, x) for x in todo]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()  # after a failure (or Ctrl-C): start no more
