"""The save's barrier, through the c10d store: every rank has finished writing, or rank 0
names the ranks that did not (lost to a timeout, or to a stopped heartbeat).

Liveness goes through the c10d store every rank already talks to, not through the
gloo group: a gloo wait that times out breaks the group's connections, so rank 0
could no longer tell the others which rank was missing (``monitored_barrier`` names
it on rank 0 only and leaves the others blocked until their own timeout). The store
carries a few keys per save, independent of the number of ranks:

- each rank appends its rank to ``<round>/arrived`` (who is missing) and increments
  ``<round>/count``; the last one sets ``<round>/all`` to ``1``;
- rank 0 waits for ``<round>/all`` up to the timeout, then writes ``<round>/answer``
  (``ok:``, or ``timeout:`` or ``heartbeat:`` and the missing ranks); the others wait
  for that answer.

Each wait is one blocking wait, not a loop of short ones (a TCPStore wait that times
out logs two warnings; sliced waits would print them every slice on every rank). The
heartbeat thread watches while this thread waits, and wakes it by writing the key it
waits for: rank 0's sets ``<round>/all`` to ``lost:<ranks>`` once a rank that has not
arrived stops beating; another rank's sets ``<round>/answer`` to ``coordinator:0``
once rank 0 stops beating. Both use ``compare_set`` on an absent key, so a real
arrival or answer is never overwritten; rank 0 writes its answer the same way, so the
first verdict written is the one every rank acts on.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ckptctl.save.heartbeat import Heartbeat, parse_ranks


class StoreBarrier:
    """One per coordinator; ``wait`` once per save, on every rank."""

    def __init__(self, store: "dist.Store", rank: int, world_size: int, timeout: timedelta, heartbeat: Heartbeat | None) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.heartbeat = heartbeat
        self._round = 0  # saves coordinated so far; names this save's keys in the store

    def wait(self) -> tuple[str, list[int]]:
        """Block until rank 0's verdict: ``("ok", [])``, ``("timeout", ranks)``, ``("heartbeat",
        ranks)`` or ``("coordinator", [0])`` (rank 0 stopped beating). Store errors propagate:
        ``DistStoreError`` when rank 0 never answered, another ``RuntimeError`` when the store
        itself is gone."""
        self._round += 1
        st, rnd, ws = self.store, self._round, self.world_size
        missing: list[int] = []
        cause = "ok"
        try:
            st.append(f"{rnd}/arrived", f"{self.rank},")
            if st.add(f"{rnd}/count", 1) == ws:
                st.set(f"{rnd}/all", "1")
            self._watch(rnd)
            if self.rank == 0:
                try:
                    st.wait([f"{rnd}/all"], self.timeout)
                    verdict = st.get(f"{rnd}/all").decode()
                    if verdict != "1":  # our heartbeat thread found ranks that stopped beating
                        cause, missing = "heartbeat", parse_ranks(verdict.partition(":")[2])
                except dist.DistStoreError:  # timed out; find out who is missing
                    arrived = set(parse_ranks(st.get(f"{rnd}/arrived").decode()))
                    cause, missing = "timeout", [r for r in range(ws) if r not in arrived]
                # If another rank took rank 0 for dead meanwhile, its verdict stands for all.
                answer = st.compare_set(f"{rnd}/answer", "", f"{cause}:{','.join(map(str, missing))}").decode()
                cause, _, ranks = answer.partition(":")
                missing = parse_ranks(ranks)
                if rnd > 1:  # every rank has read the previous round's answer by now
                    for key in ("count", "all", "answer", "arrived"):
                        st.delete_key(f"{rnd - 1}/{key}")
            else:
                # Rank 0 may itself arrive up to a timeout late, then waits a timeout for the rest.
                st.wait([f"{rnd}/answer"], 2 * self.timeout)
                cause, _, ranks = st.get(f"{rnd}/answer").decode().partition(":")
                missing = parse_ranks(ranks)
        finally:
            self._watch(None)
        return cause, missing

    def _watch(self, rnd: int | None) -> None:
        if self.heartbeat is not None:
            self.heartbeat.watch = rnd
