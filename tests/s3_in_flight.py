"""How many S3 requests a verb keeps in flight at once, seen from botocore's own event hooks
(the requests really go to the moto server): each counted request is held a moment before it
is sent, so that requests asked for together overlap for sure, and the test asserts on the
most in flight, never on a time."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass
class InFlight:
    most: int = 0  # the most counted requests in flight at once
    sent: list[dict] = field(default_factory=list)  # each counted request's parameters, in sending order


@contextmanager
def in_flight(client: Any, operation: str = "", *, hold_s: float = 0.05,
              when: Callable[[dict], bool] = lambda params: True) -> Iterator[InFlight]:
    """Requests ``client`` sends inside the block, of ``operation`` ("GetObject"; every one
    when empty) whose parameters satisfy ``when``."""
    suffix = f".{operation}" if operation else ""
    lock = threading.Lock()
    seen, now = InFlight(), [0]

    def sending(params: dict, context: dict, **_kw: object) -> None:
        if not when(params):
            return
        context["ckptctl-test-counted"] = True
        with lock:
            seen.sent.append(dict(params))
            now[0] += 1
            seen.most = max(seen.most, now[0])
        time.sleep(hold_s)

    def done(context: dict, **_kw: object) -> None:
        if context.pop("ckptctl-test-counted", False):
            with lock:
                now[0] -= 1

    hooks = [(f"provide-client-params.s3{suffix}", sending), (f"after-call.s3{suffix}", done),
             (f"after-call-error.s3{suffix}", done)]
    for event, hook in hooks:
        client.meta.events.register(event, hook)
    try:
        yield seen
    finally:
        for event, hook in hooks:
            client.meta.events.unregister(event, hook)
