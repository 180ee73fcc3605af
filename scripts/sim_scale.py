"""Scale simulation of a multi-rank save's coordination, in one process, with no network.

    python scripts/sim_scale.py [--tensors 2000] [--ranks 256,512,1024,2048,4096]

For a synthetic FSDP job (every tensor row-sharded over all ranks) it runs, for real, the
code a save runs outside the collectives themselves:

- one rank's planning (``make_plan``: layout, structure digest, coverage vector); the same
  on every rank, in parallel, so it is timed once;
- rank 0's share of the exchange: decoding one JSON report per rank (what the ``gather``
  hands it), deciding (``Coordinator._decide``), checking coverage of every tensor once the
  ``reduce`` has summed the ranks' vectors (the summing is done by the collective, spread over
  the ranks, so the sim gives rank 0 the summed vector), and building and serialising the
  manifest (``manifest_of`` + ``to_json``);

and prints time and size per row. Rank 0's time and the manifest must grow linearly in
ranks + tensors; the last column shows what the manifest would weigh if it held the chunk
index (ranks x tensors entries), which is why that index lives in the shard headers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict

import torch

from ckptctl.format.manifest import FileEntry
from ckptctl.save.commit import manifest_of
from ckptctl.save.coordination import Coordinator
from ckptctl.save.messages import REPORT_BYTES, RankReport, pack, unpack
from ckptctl.save.plan import make_plan, signature_of
from ckptctl.state.capture import LOCAL, SavedTensor

ROWS, COLS = 16384, 1024


def rank_tensors(rank: int, ranks: int, tensors: int) -> dict[str, SavedTensor]:
    """One rank's view of the state: a row shard of each tensor (torch.chunk sizes). Meta
    tensors: planning needs shapes and dtypes, never data."""
    per = math.ceil(ROWS / ranks)
    start = min(rank * per, ROWS)
    rows = max(0, min(per, ROWS - start))
    out = {}
    for i in range(tensors):
        name = f"model/layers.{i // 8}.w{i % 8}"
        out[name] = SavedTensor(torch.empty(rows, COLS, device="meta"), "model", (ROWS, COLS), (start, 0), LOCAL)
    return out


def simulate(ranks: int, tensors: int, repeat: int = 5) -> dict[str, float]:
    """Best of ``repeat`` runs: the minimum is the cost, the rest is noise from the machine."""
    runs = [simulate_once(ranks, tensors) for _ in range(repeat)]
    best = dict(runs[0])
    for k in ("plan_s", "rank0_s", "rank0_cached_s"):
        best[k] = min(r[k] for r in runs)
    return best


def simulate_once(ranks: int, tensors: int) -> dict[str, float]:
    local = rank_tensors(0, ranks, tensors)
    t0 = time.perf_counter()
    plan = make_plan(local, signature_of(local), rank=0, world_size=ranks)
    t_plan = time.perf_counter() - t0

    # What the gather delivers to rank 0: one fixed-size JSON report per rank.
    payloads = []
    for r in range(ranks):
        entry = FileEntry(f"rank-{r:05d}-of-{ranks:05d}.safetensors", 1 << 30, "0123456789abcdef", r, tensors)
        rep = RankReport(r, 1000, entry, None, plan.structure, r == 0, {"bytes": float(1 << 30), "stall_s": 0.5, "write_s": 3.0})
        payloads.append(pack(asdict(rep), REPORT_BYTES, shorten="error"))
    per_report = len(json.dumps(asdict(rep)))
    summed = torch.tensor(plan.coverage, dtype=torch.int64).reshape(len(plan.table), 2)
    summed[:, 0] = ranks  # after the reduce: every rank holds one chunk of every tensor
    summed[:, 1] = ROWS * COLS

    coord = Coordinator(None, timeout_s=60, rank=0, world_size=ranks)
    manifest_bytes: list[int] = []

    def commit(files, table, stats) -> str:
        raw = manifest_of(1000, ranks, files, table, {"model": {}}, stats).to_json()
        manifest_bytes.append(len(raw))
        return "sim://step-0000001000"

    t0 = time.perf_counter()
    gathered = [unpack(p) for p in payloads]
    action, _ = coord._decide(gathered, plan)
    assert action == "plan", action
    action, msg = coord._check_coverage(1000, plan, summed)
    assert action == "commit", msg
    action, url = coord._commit(1000, gathered, commit)
    assert action == "ok", url
    t_rank0 = time.perf_counter() - t0
    # Rank 0's work on a later save with the same structure: no coverage round.
    for g in gathered:
        g["replanned"] = False
    coord._last_plan = plan
    t0 = time.perf_counter()
    gathered2 = [unpack(p) for p in payloads]
    for g in gathered2:
        g["replanned"] = False
    assert coord._decide(gathered2, plan)[0] == "commit"
    coord._commit(1000, gathered2, commit)
    t_cached = time.perf_counter() - t0
    chunk_index = ranks * tensors * 70  # ~bytes per chunk entry (name, offsets, checksum) in JSON
    return {
        "ranks": ranks, "tensors": tensors, "plan_s": t_plan, "rank0_s": t_rank0, "rank0_cached_s": t_cached,
        "manifest": manifest_bytes[0], "report": per_report, "chunk_index": chunk_index,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--ranks", default="256,512,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=5, help="runs per row; the fastest is shown")
    args = ap.parse_args(argv)
    rows = [simulate(int(n), args.tensors, args.repeat) for n in args.ranks.split(",")]
    rows += [simulate(int(args.ranks.split(",")[-1]), t, args.repeat) for t in (args.tensors // 4, args.tensors // 2)]
    print(f"{'ranks':>6} {'tensors':>7} {'plan/rank':>10} {'rank0 first':>12} {'rank0 cached':>13} "
          f"{'manifest':>10} {'B/(r+t)':>8} {'report':>7} {'if index in manifest':>21}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['tensors']:>7} {r['plan_s'] * 1e3:>8.1f}ms {r['rank0_s'] * 1e3:>10.1f}ms "
              f"{r['rank0_cached_s'] * 1e3:>11.1f}ms {r['manifest'] / 1e6:>8.2f}MB "
              f"{r['manifest'] / (r['ranks'] + r['tensors']):>8.1f} {r['report']:>6}B {r['chunk_index'] / 1e6:>19.1f}MB")
    # Linear in ranks + tensors means a constant cost per added rank (at fixed tensors) and per
    # added tensor (at fixed ranks); a ranks x tensors term would make the first grow with the
    # tensor count and the second with the rank count.
    by_ranks = [r for r in rows if r["tensors"] == args.tensors]
    by_tensors = sorted((r for r in rows if r["ranks"] == by_ranks[-1]["ranks"]), key=lambda r: r["tensors"])
    print("\nmarginal cost per added rank (tensors fixed):")
    for a, b in zip(by_ranks, by_ranks[1:]):
        d = b["ranks"] - a["ranks"]
        print(f"  {a['ranks']:>5} -> {b['ranks']:>5} ranks: manifest {(b['manifest'] - a['manifest']) / d:7.1f} B/rank   "
              f"rank 0 {(b['rank0_s'] - a['rank0_s']) / d * 1e6:6.1f} us/rank")
    print(f"marginal cost per added tensor ({by_ranks[-1]['ranks']} ranks fixed):")
    for a, b in zip(by_tensors, by_tensors[1:]):
        d = b["tensors"] - a["tensors"]
        print(f"  {a['tensors']:>5} -> {b['tensors']:>5} tensors: manifest {(b['manifest'] - a['manifest']) / d:7.1f} B/tensor   "
              f"rank 0 {(b['rank0_s'] - a['rank0_s']) / d * 1e6:6.1f} us/tensor   plan {(b['plan_s'] - a['plan_s']) / d * 1e6:5.1f} us/tensor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
