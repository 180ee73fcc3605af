"""Each rank's sign of life during multi-rank saves, and the watch kept on the ranks waited for.

The c10d store cannot tell a dead rank from a slow one, so without this a killed rank is
noticed only when ``timeout_s`` (default 900 s) runs out. With it, every rank's daemon thread
bumps a counter in the store, and a rank that is waited for and whose counter stands still
for ``liveness_s`` is taken as dead (``barrier`` says who waits for whom).
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

DEFAULT_LIVENESS_S = 60.0  # no heartbeat for this long: the rank is dead
# A beat every liveness_s / 6, within these bounds: several beats may be missed (a loaded host,
# a busy store) before a rank is taken as dead, and 4,096 ranks beating every 10 s are
# ~400 store operations a second.
BEAT_MIN_S, BEAT_MAX_S = 0.2, 10.0
# ``compare_set`` of an absent key with this expected value creates nothing and answers it: a
# read that never waits (``tiers.link.peek`` is the same for the tiers, a layer this one may
# not import).
_ABSENT = "\x00ckptctl: absent\x00"

log = logging.getLogger("ckptctl")


def parse_ranks(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Heartbeat:
    """This rank's sign of life: a daemon thread adds 1 to ``alive/<rank>`` every beat, a
    counter and not a time (hosts' clocks differ). While the rank waits in the save's barrier
    (``watch`` is the round), the same thread reads the counters of the ranks it waits for
    and notes, by its own monotonic clock, when each last changed; one that has not changed
    for ``liveness_s`` is dead, and the waiting thread is woken (see ``barrier``).

    It has a store connection of its own (``Store.clone``): a TCPStore connection serves one
    request at a time, and the barrier's wait holds it for as long as it waits. The thread
    never raises into the training process: when the store fails, it logs once and keeps
    trying every beat."""

    def __init__(self, store: "dist.Store", rank: int, world_size: int, liveness_s: float) -> None:
        self.store, self.rank, self.world_size, self.liveness_s = store, rank, world_size, liveness_s
        self.interval = min(max(liveness_s / 6, BEAT_MIN_S), BEAT_MAX_S)
        self.watch: int | None = None  # set by the writer thread; read here
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckptctl-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # A beat in flight takes a store round trip; do not hold close() up for longer.
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        seen: dict[int, tuple[int | None, float]] = {}  # rank -> (counter, when it last changed)
        watched: int | None = None
        failing = False  # logged once per outage, not once per beat
        delay = 0.0  # the first beat at once
        while not self._stop.wait(delay):
            delay = self.interval
            try:
                self.store.add(f"alive/{self.rank}", 1)
                rnd = self.watch
                if rnd != watched:  # a new wait: nobody has been seen standing still yet
                    seen, watched = {}, rnd
                if rnd is not None:
                    self._check(rnd, seen)
            except RuntimeError as e:  # DistStoreError, DistNetworkError: the store is unreachable
                # Keep trying: a blip must not make this rank look dead for good. While it
                # lasts, the ranks waiting for this one may take it as dead, as they should:
                # it could not answer them through the store either.
                if not failing:
                    log.warning(
                        "rank %d: heartbeat interrupted, the c10d store failed: %s; retrying every %gs "
                        "(other ranks take this rank as dead after %gs without one)",
                        self.rank, first_line(e), self.interval, self.liveness_s,
                    )
                failing = True
                continue
            if failing:
                log.warning("rank %d: heartbeat resumed", self.rank)
                failing = False

    def _check(self, rnd: int, seen: dict[int, tuple[int | None, float]]) -> None:
        st = self.store
        if self.rank == 0:
            # Rank 0 appended itself before watching, so the key exists, unless this thread
            # lagged a whole save behind and the next barrier deleted it (even between a
            # ``check`` and a ``get``): a ``get`` would then block for the store's timeout,
            # silencing this rank's heartbeat meanwhile. So one request that never waits.
            raw = st.compare_set(f"{rnd}/arrived", _ABSENT, _ABSENT)
            if raw == _ABSENT.encode():
                return
            arrived = set(parse_ranks(raw.decode()))
            waiting = [r for r in range(self.world_size) if r not in arrived]
        else:
            waiting = [0]
        if not waiting:
            return
        now = time.monotonic()
        dead: list[int] = []
        known = [r for r in waiting if seen.get(r, (None, 0.0))[0] is not None]
        for r, count in read_counters(st, waiting, known).items():
            last = seen.get(r)
            if last is None or last[0] != count:
                seen[r] = (count, now)
            elif now - last[1] >= self.liveness_s:
                dead.append(r)
        if not dead:
            return
        # Never overwrites a real arrival or answer that came in meanwhile (see _barrier).
        if self.rank == 0:
            st.compare_set(f"{rnd}/all", "", "lost:" + ",".join(map(str, dead)))
        else:
            st.compare_set(f"{rnd}/answer", "", "coordinator:0")


def read_counters(st: "dist.Store", ranks: list[int], known: list[int]) -> dict[int, int | None]:
    """The heartbeat counters of ``ranks`` in one request, None for a rank that has not beaten
    yet (it may be just past ``create``): ``get`` of an absent key would block until the
    store's timeout, so keys not ``known`` to exist are checked first."""
    unknown = set(ranks).difference(known)
    if unknown and not st.check([f"alive/{r}" for r in unknown]):  # rare: before every first beat
        absent = {r for r in unknown if not st.check([f"alive/{r}"])}
        ranks = [r for r in ranks if r not in absent]
    else:
        absent = set()
    keys = [f"alive/{r}" for r in ranks]
    multi_get = getattr(st, "multi_get", None)
    if not keys:
        values: list[bytes] = []
    elif multi_get is not None:
        values = multi_get(keys)
    else:
        values = [st.get(k) for k in keys]
    return {**dict.fromkeys(absent), **{r: int(v) for r, v in zip(ranks, values)}}


def first_line(e: BaseException) -> str:
    """An exception's first line, for one-line messages (c10d errors span many lines)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
