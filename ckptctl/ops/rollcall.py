"""Roll call for a verb run by torchrun: every rank runs the same command, and every rank that
others wait for is still there.

Both go through the job's c10d store (the TCPStore every rank reaches), not through gloo: a
gloo collective cannot say which rank is missing, and waits for a rank that never comes until
its own timeout (ranks stayed blocked 12-14 minutes after torchrun was killed, when one rank
ran ``verify A`` and another ``ls ROOT``).

* ``agree``: before any work, each rank publishes its command (verb, arguments, resolved paths)
  and reads every other rank's. A rank that does not publish within ``settings.TORCHRUN_TIMEOUT_S``
  is named (exit 3); ranks that were given different commands are named with what differs
  (exit 2), on every rank, before anything is read or written. What may differ between nodes
  (``restore``'s DST: each node's own disk) must still agree within each node.
* ``Presence``: while a verb runs, a daemon thread bumps this rank's counter in the store; a
  rank that arrives at a collective (``arrive``) waits there, by polling, until every rank has
  arrived, and gives up, naming them, on ranks whose counter stood still for the timeout (killed
  without a word, stopped, its host gone). Once all have arrived the gloo collective itself is
  quick, and its own timeout (the group's) bounds what is left.

May import: leaves only (``errors``, ``settings``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

from ckptctl.errors import CoordinationError, UsageError


@dataclass(frozen=True)
class Command:
    """What one rank was asked to do: the verb, and each argument as text (paths resolved)."""

    verb: str
    args: dict[str, str] = field(default_factory=dict)
    per_node: tuple[str, ...] = ()  # arguments that may differ between nodes (never within one)

    def doc(self, node: str) -> dict:
        return {"verb": self.verb, "args": self.args, "per_node": list(self.per_node), "node": node}


def agree(store: Any, rank: int, world_size: int, node: str, command: Command,
          timeout_s: float | None = None) -> None:
    """Return once every rank published the same ``command`` (see the module docstring);
    UsageError naming the ranks and what differs, or CoordinationError naming the ranks that
    never published. The same on every rank, which all read the same documents."""
    timeout_s = timeout_s or timeout()
    n = next(_rounds)
    doc = json.dumps(command.doc(node))
    keys = [f"{_PREFIX}/command/{n}/{r}" for r in range(world_size)]
    with _store_errors("agreeing on the command"):
        store.set(keys[rank], doc)
        missing = _wait_for(store, keys, timeout_s)
        if missing:
            raise CoordinationError(
                f"rank(s) {_ranks(missing)} of this torchrun job did not start `ckptctl {command.verb}` within "
                f"{timeout_s:g}s: every rank must run the same command (rank {rank} ran {_shown(command.doc(node))})",
                hint="launch the same ckptctl command line on every rank; see the missing ranks' logs "
                     "(CKPTCTL_TORCHRUN_TIMEOUT sets how long to wait)")
        docs = [json.loads(raw) for raw in store.multi_get(keys)]
    _compare(docs)


def _compare(docs: list[dict]) -> None:
    """UsageError when the ranks' commands differ (``per_node`` arguments: within a node)."""
    per_node = sorted({name for d in docs for name in d["per_node"]})

    def compared(d: dict, within_node: bool) -> dict:
        return {k: v for k, v in d["args"].items() if within_node or k not in per_node}

    for within_node in (False, True):
        parts: dict[tuple[str, str], list[int]] = {}  # (node or "", the command compared) -> ranks
        for r, d in enumerate(docs):
            what = json.dumps([d["verb"], compared(d, within_node)], sort_keys=True)
            parts.setdefault((d["node"] if within_node else "", what), []).append(r)
        for scope in dict.fromkeys(scope for scope, _what in parts):
            groups = [ranks for (s, _what), ranks in parts.items() if s == scope]
            if len(groups) < 2:
                continue
            firsts = [compared(docs[g[0]], within_node) for g in groups]
            differs = (["verb"] if len({docs[g[0]]["verb"] for g in groups}) > 1 else
                       sorted({k for a in firsts for k in set(a) | set(firsts[0]) if a.get(k) != firsts[0].get(k)}))
            only = None if differs == ["verb"] else differs  # the arguments that differ, or all of them
            shown = "; ".join(f"rank {_ranks(g)}: {_shown(docs[g[0]], only)}" for g in groups[:4])
            raise UsageError(
                f"the ranks of this torchrun job{f' on {scope}' if scope else ''} were given different commands "
                f"({', '.join(differs)} differ): {shown}; nothing was done",
                hint="give every rank the same command line" +
                     (f" (each node may name its own {', '.join(per_node)}, the same on all its ranks)" if per_node else ""))


def _shown(doc: dict, only: list[str] | None = None) -> str:
    args = doc["args"] if only is None else {k: doc["args"].get(k) for k in only}
    text = " ".join([doc["verb"], *(f"{k}={v}" for k, v in args.items())])
    return text if len(text) <= 300 else text[:300] + "..."


class Presence:
    """This rank's sign of life in the store, and ``arrive``: every rank at the same point, or
    the ranks that stopped named (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float | None = None) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s or timeout()
        self.beat_s = min(max(self.timeout_s / 10, 0.2), 5.0)
        self._points = itertools.count()
        self.lost: list[int] = []  # ranks found gone: never waited for again
        self._session = next(_sessions)  # every rank makes its presences in the same order
        self._stop = threading.Event()
        clone = getattr(store, "clone", None)
        self._beating = clone() if clone is not None else store  # a connection of its own
        self._thread = threading.Thread(target=self._beat, name=f"ckptctl-presence-{rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        while True:
            try:
                self._beating.add(f"{_PREFIX}/alive/{self.rank}", 1)
            except RuntimeError:  # the store is gone (torchrun killed): the waiters say so
                pass
            if self._stop.wait(self.beat_s):
                return

    def arrive(self, what: str) -> None:
        """Wait until every rank arrived here (the n-th ``arrive`` of each rank), or raise
        CoordinationError naming the ranks that stopped answering while waited for."""
        n = next(self._points)
        st, at = self.store, f"{_PREFIX}/at/{self._session}/{n}"
        keys = [f"{at}/{r}" for r in range(self.world_size)]
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last changed)
        delay, checked = 0.005, 0.0
        with _store_errors(what):
            st.set(keys[self.rank], "1")
            arrived = int(st.add(at, 1))
            while arrived < self.world_size:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                now = time.monotonic()
                arrived = int(st.add(at, 0))
                if arrived >= self.world_size or now - checked < self.beat_s:
                    continue
                checked = now
                missing = [r for r, k in enumerate(keys) if not st.check([k])]
                gone = []
                for r in missing:
                    count = int(st.add(f"{_PREFIX}/alive/{r}", 0))
                    if r not in seen or seen[r][0] != count:
                        seen[r] = (count, now)
                    elif now - seen[r][1] >= self.timeout_s:
                        gone.append(r)
                if gone:
                    self.lost = gone
                    raise CoordinationError(
                        f"rank(s) {_ranks(gone)} of this torchrun job stopped answering (no sign of life for "
                        f"{self.timeout_s:g}s) while rank {self.rank} waited at {what}",
                        hint="see those ranks' logs (killed, out of memory, host down?), then run the command again")


_rounds = itertools.count()  # commands agreed on by this process: each has its own keys
_sessions = itertools.count()  # presences made by this process: each has its own keys
# The job's store outlives a restart of its workers (torchrun --max-restarts): each attempt
# keeps to keys of its own.
_PREFIX = f"ckptctl/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
_presence: ContextVar[Presence | None] = ContextVar("ckptctl_presence", default=None)


def current_presence() -> Presence | None:
    return _presence.get()


@contextlib.contextmanager
def present(presence: Presence) -> Iterator[Presence]:
    """``presence`` as the running verb's, for ``arrive`` before each collective; closed after."""
    token = _presence.set(presence)
    try:
        yield presence
    finally:
        _presence.reset(token)
        presence.close()


def _wait_for(store: Any, keys: list[str], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``keys``; the indices of those still missing (none: all there)."""
    deadline, delay = time.monotonic() + timeout_s, 0.005
    while not store.check(keys):  # one request for all of them
        if time.monotonic() >= deadline:
            return [i for i, k in enumerate(keys) if not store.check([k])]
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)
    return []


@contextlib.contextmanager
def _store_errors(what: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # DistStoreError, DistNetworkError: the store (torchrun's agent) is gone
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CoordinationError(f"the torchrun job's store failed while {what}: {first}",
                                hint="torchrun itself stopped (killed?) or its host is unreachable; "
                                     "run the command again") from None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def timeout() -> float:
    """``settings.TORCHRUN_TIMEOUT_S``, read when first needed: the command line checks the
    environment (exit 2 for a malformed CKPTCTL_* variable) only after it imported this module."""
    from ckptctl.settings import TORCHRUN_TIMEOUT_S

    return TORCHRUN_TIMEOUT_S


def store_timeout() -> timedelta:
    return timedelta(seconds=timeout())


def resolved(location: str) -> str:
    """A location as ranks compare it: a local path absolute with its links resolved (ranks
    in other working directories name the same place alike), a URL as given."""
    if "://" in location and not location.lower().startswith("file://"):
        return location
    path = location[len("file://"):] if location.lower().startswith("file://") else location
    return os.path.realpath(path)
