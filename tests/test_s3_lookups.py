"""Verbs that list a whole root look at its checkpoints several at once (moto over HTTP).

Listing a root reads a few small things of each checkpoint (its marker and manifest, a listing
of its files); on object storage each is a round trip of 15-50 ms, and one after another a
root of 1,000 checkpoints took minutes to `ls`, `du` or plan a `prune`. ``layouts.lookups``
keeps up to ``settings.REQUEST_THREADS`` checkpoints in flight, in order. Shown here by the
requests in flight at once (each held a moment, so that requests sent together overlap for
sure), never by timing; and the answers are the same as one at a time.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.storage import open_storage
from helpers import cli

STEPS = range(1, 9)
TIMED = ("created", "now", "seconds", "duration_s", "elapsed_s", "throughput", "mb_per_s")


@contextmanager
def most_in_flight(client: Any, hold_s: float = 0.05) -> Iterator[list[int]]:
    """The most requests ``client`` had in flight at once inside the block."""
    lock = threading.Lock()
    now, most = [0], [0]

    def sent(context: dict, **_kw: object) -> None:
        context["ckptctl-test-counted"] = True
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(hold_s)

    def answered(context: dict, **_kw: object) -> None:
        if context.pop("ckptctl-test-counted", False):
            with lock:
                now[0] -= 1

    client.meta.events.register("provide-client-params.s3", sent)
    client.meta.events.register("after-call.s3", answered)
    client.meta.events.register("after-call-error.s3", answered)
    try:
        yield most
    finally:
        client.meta.events.unregister("provide-client-params.s3", sent)
        client.meta.events.unregister("after-call.s3", answered)
        client.meta.events.unregister("after-call-error.s3", answered)


@pytest.fixture
def root(s3_url: str) -> str:
    with Checkpointer(s3_url) as ck:
        for s in STEPS:
            ck.save(s, {"w": torch.full((1000,), float(s))}).wait()
    return s3_url


def _stable(doc: Any) -> Any:
    """``doc`` without what changes from one run to the next (ages, times)."""
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if not (k.startswith("age") or k in TIMED)}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    return doc


@pytest.mark.parametrize("verb", [["ls", "--json"], ["du", "--json"], ["prune", "--keep-last", "2", "--dry-run", "--json"]])
def test_a_root_wide_verb_looks_at_several_checkpoints_at_once(root, verb, monkeypatch):
    client = open_storage(root)._client.s3  # type: ignore[attr-defined]  (the process's shared client)
    with most_in_flight(client) as most:
        r = cli(verb[0], root, *verb[1:])
    assert r.exit_code == 0, r.stderr
    # Before: 1, each checkpoint's reads waiting for the one before's.
    assert most[0] >= 4, most
    import ckptctl.layouts.lookups as lookups

    monkeypatch.setattr(lookups, "REQUEST_THREADS", 1)  # one at a time: the same answer
    with most_in_flight(client) as most:
        one = cli(verb[0], root, *verb[1:])
    assert one.exit_code == 0, one.stderr
    assert most[0] == 1, most
    assert _stable(r.json()) == _stable(one.json())
