"""Verbs that list a whole root look at its checkpoints several at once (moto over HTTP).

Listing a root reads a few small things of each checkpoint (its marker and manifest, a listing
of its files); on object storage each is a round trip of 15-50 ms, and one after another a
root of 1,000 checkpoints took minutes to `ls`, `du` or plan a `prune`. ``layouts.lookups``
keeps up to ``settings.REQUEST_THREADS`` checkpoints in flight, in order. Shown here by the
requests in flight at once (each held a moment, so that requests sent together overlap for
sure), never by timing; and the answers are the same as one at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.storage import open_storage
from helpers import cli
from s3_in_flight import in_flight

STEPS = range(1, 9)
TIMED = ("created", "now", "seconds", "duration_s", "elapsed_s", "throughput", "mb_per_s")


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
    with in_flight(client) as requests:
        r = cli(verb[0], root, *verb[1:])
    assert r.exit_code == 0, r.stderr
    # Before: 1, each checkpoint's reads waiting for the one before's.
    assert requests.most >= 4, requests.most
    import ckptctl.layouts.lookups as lookups

    monkeypatch.setattr(lookups, "REQUEST_THREADS", 1)  # one at a time: the same answer
    with in_flight(client) as requests:
        one = cli(verb[0], root, *verb[1:])
    assert one.exit_code == 0, one.stderr
    assert requests.most == 1, requests.most
    assert _stable(r.json()) == _stable(one.json())
