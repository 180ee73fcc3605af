"""Scale simulation of a multi-rank save's coordination, in one process, with no network.

    python scripts/sim_scale.py [--tensors 2000] [--ranks 256,512,1024,2048,4096]

For a synthetic FSDP job (every tensor row-sharded over all ranks) it runs, for real, the
code a save runs outside the collectives themselves:

- one rank's planning (``make_layout``: layout, structure digest, coverage vector); the same
  on every rank, in parallel, so it is timed once;
- rank 0's share of the exchange: decoding one JSON report per rank (what the ``gather``
  hands it), deciding (``Coordinator._decide``), checking coverage of every tensor once the
  ``reduce`` has summed the ranks' vectors (the summing is done by the collective, spread over
  the ranks, so the sim gives rank 0 the summed vector), and building and serialising the
  manifest (``Manifest.new`` + ``to_json``);

and prints time and size per row. Rank 0's time and the manifest must grow linearly in
ranks + tensors; the last column shows what the manifest would weigh if it held the chunk
index (ranks x tensors entries), which is why that index lives in the shard headers.

The read side (``sim_read.py``: a synthetic checkpoint in memory whose headers are generated
when read) counts the bytes and files read, and times: (a) one rank's load planning (the
manifest, the headers its region needs by the manifest's placement hints, its per-rank state
and rank 0's), (b) ``load_latest``'s decision (rank 0's; the others read nothing for it), (c)
``verify``'s default level and (d) ``prune --dry-run``'s anchor check, their metadata work
(these read every header: their work must be linear in the chunk index they check).

It exits 1 when any counted figure grows faster than linearly (a log-log slope above 1.15
along ranks or tensors, or a ranks x tensors term, see ``growth_problems``), or a time does
beyond a looser tolerance (``--no-time-check`` skips those on a noisy machine).
``--read-all-headers`` plans loads as the reader did before the hints (every rank reading
every header): the sim must then fail.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict

import torch

from ckptctl.format.manifest import FileEntry, Manifest
from ckptctl.save.coordination import Coordinator
from ckptctl.save.messages import REPORT_BYTES, RankReport, pack, unpack
from ckptctl.save.shard_layout import make_layout, signature_of
from ckptctl.state.placement import LOCAL, SavedTensor

import sim_read  # noqa: E402  (scripts/ is on sys.path when this runs as a script)

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
    plan = make_layout(local, signature_of(local), rank=0, world_size=ranks)
    t_plan = time.perf_counter() - t0

    # What the gather delivers to rank 0: one fixed-size JSON report per rank.
    payloads = []
    for r in range(ranks):
        entry = FileEntry(f"rank-{r:05d}-of-{ranks:05d}.safetensors", 1 << 30, "0123456789abcdef", r, tensors)
        rep = RankReport(r, 1000, entry, None, plan.structure, r == 0, {"bytes": float(1 << 30), "stall_s": 0.5, "write_s": 3.0})
        payloads.append(pack(asdict(rep), REPORT_BYTES, shorten="error"))
    per_report = len(json.dumps(asdict(rep)))
    summed = torch.tensor(plan.coverage, dtype=torch.int64).reshape(len(plan.table), 4)
    held = len([r for r in range(ranks) if r * math.ceil(ROWS / ranks) < ROWS])
    summed[:, 0] = held  # after the reduce: every rank that holds rows has one chunk of every tensor
    summed[:, 1] = ROWS * COLS
    summed[:, 2] = held  # each on its own block of the split: the manifest records the split
    summed[:, 3] = 0

    coord = Coordinator(None, timeout_s=60, rank=0, world_size=ranks)
    manifest_bytes: list[int] = []

    def commit(files, table, stats) -> str:
        raw = Manifest.new(1000, ranks, files, table, {"model": {}}, stats).to_json()
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


def growth_problems(what: str, rows: list[dict], key: str, *, slope_max: float, interaction_max: float | None) -> list[str]:
    """Why ``key`` of ``rows`` grows faster than linearly, if it does: a log-log slope above
    ``slope_max`` along ranks (tensors fixed) or along tensors (ranks fixed), or, when
    ``interaction_max`` is given, a ranks x tensors term: for the corners (r1,t1), (r2,t1),
    (r1,t2), (r2,t2), an additive cost a*r + b*t + c has v22 - v21 - v12 + v11 = 0, a product
    r*t has it equal to (1 - r1/r2)(1 - t1/t2) of v22."""
    out = []
    ranks = sorted({r["ranks"] for r in rows})
    tensors = sorted({r["tensors"] for r in rows})
    at = {(r["ranks"], r["tensors"]): max(float(r[key]), 1e-9) for r in rows}
    for label, xs, pts in (
        ("ranks", ranks, [(n, at[(n, tensors[-1])]) for n in ranks if (n, tensors[-1]) in at]),
        ("tensors", tensors, [(t, at[(ranks[-1], t)]) for t in tensors if (ranks[-1], t) in at]),
    ):
        if len(pts) >= 2:
            lx = [math.log(x) for x, _ in pts]
            ly = [math.log(y) for _, y in pts]
            mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
            slope = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)
            if slope > slope_max:
                out.append(f"{what}: {key} grows as {label}^{slope:.2f} (at most {slope_max} allowed)")
    corners = [(ranks[0], tensors[0]), (ranks[-1], tensors[0]), (ranks[0], tensors[-1]), (ranks[-1], tensors[-1])]
    if interaction_max is not None and all(c in at for c in corners) and len(ranks) > 1 and len(tensors) > 1:
        v11, v21, v12, v22 = (at[c] for c in corners)
        inter = (v22 - v21 - v12 + v11) / v22
        if inter > interaction_max:
            out.append(f"{what}: {key} has a ranks x tensors term ({inter:.2f} of the largest value; "
                       f"at most {interaction_max} allowed)")
    return out


def read_side(ranks: list[int], tensors: int, verify_tensors: int, repeat: int, read_all: bool) -> tuple[list[dict], list[dict]]:
    """(a) load planning and (b) load_latest's decision on the grid ranks x {t/4, t/2, t}
    (corners included), and (c) verify and (d) prune's anchor check on ranks x verify_tensors."""
    def grid(t: int) -> list[tuple[int, int]]:
        return sorted({(n, t) for n in ranks} | {(ranks[-1], t // 4), (ranks[-1], t // 2), (ranks[0], t // 4)})

    def best(fn, root) -> dict[str, float]:
        runs = [sim_read.measure(fn, root) for _ in range(repeat)]
        return {**runs[0], "s": min(r["s"] for r in runs)}

    load_rows, verify_rows = [], []
    for n, t in grid(tensors):
        root = sim_read.build_root(n, t)
        a = best(lambda r: sim_read.load_planning(r, n, read_all=read_all), root)
        b = best(sim_read.latest_decision, root)
        load_rows.append({"ranks": n, "tensors": t, "a_bytes": a["bytes"], "a_opens": a["opens"], "a_s": a["s"],
                          "b_bytes": b["bytes"], "b_opens": b["opens"], "b_s": b["s"]})
    for n, t in grid(verify_tensors):
        root = sim_read.build_root(n, t)
        c = best(sim_read.verify_metadata, root)
        d = best(sim_read.prune_anchor_metadata, root)
        verify_rows.append({"ranks": n, "tensors": t, "chunks": n * t, "c_bytes": c["bytes"], "c_s": c["s"],
                            "d_bytes": d["bytes"], "d_s": d["s"]})
    return load_rows, verify_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--ranks", default="256,512,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=5, help="runs per row; the fastest is shown")
    ap.add_argument("--read-repeat", type=int, default=2, help="runs per read-side row (verify/prune rows take seconds each)")
    ap.add_argument("--verify-tensors", type=int, default=100,
                    help="tensors for verify/prune, which read every chunk entry (ranks x tensors of them)")
    ap.add_argument("--read-all-headers", action="store_true",
                    help="plan loads as the old reader did (every rank reads every header): must fail")
    ap.add_argument("--no-time-check", action="store_true", help="check counted bytes only, not times")
    args = ap.parse_args(argv)
    rank_list = [int(n) for n in args.ranks.split(",")]
    rows = [simulate(n, args.tensors, args.repeat) for n in rank_list]
    rows += [simulate(rank_list[-1], t, args.repeat) for t in (args.tensors // 4, args.tensors // 2)]
    rows.append(simulate(rank_list[0], args.tensors // 4, args.repeat))
    print("save side (rank 0's share of a save, and the manifest):")
    print(f"{'ranks':>6} {'tensors':>7} {'plan/rank':>10} {'rank0 first':>12} {'rank0 cached':>13} "
          f"{'manifest':>10} {'B/(r+t)':>8} {'report':>7} {'if index in manifest':>21}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['tensors']:>7} {r['plan_s'] * 1e3:>8.1f}ms {r['rank0_s'] * 1e3:>10.1f}ms "
              f"{r['rank0_cached_s'] * 1e3:>11.1f}ms {r['manifest'] / 1e6:>8.2f}MB "
              f"{r['manifest'] / (r['ranks'] + r['tensors']):>8.1f} {r['report']:>6}B {r['chunk_index'] / 1e6:>19.1f}MB")
    problems = growth_problems("save: manifest", rows, "manifest", slope_max=1.15, interaction_max=0.1)
    if not args.no_time_check:
        problems += growth_problems("save: rank 0", rows, "rank0_s", slope_max=1.6, interaction_max=0.5)

    load_rows, verify_rows = read_side(rank_list, args.tensors, args.verify_tensors, min(args.repeat, args.read_repeat),
                                       args.read_all_headers)
    print("\nread side, per rank: (a) one rank's load planning (manifest, the headers it needs, per-rank "
          "state), (b) load_latest's decision (rank 0; the others read nothing for it)")
    print(f"{'ranks':>6} {'tensors':>7} {'(a) bytes':>11} {'files':>6} {'time':>9} {'(b) bytes':>11} {'files':>6} {'time':>9}")
    for r in load_rows:
        print(f"{r['ranks']:>6} {r['tensors']:>7} {r['a_bytes'] / 1e6:>9.2f}MB {r['a_opens']:>6} {r['a_s'] * 1e3:>7.1f}ms "
              f"{r['b_bytes'] / 1e6:>9.2f}MB {r['b_opens']:>6} {r['b_s'] * 1e3:>7.1f}ms")
    print("\n(c) verify (default level) and (d) prune --dry-run's anchor check, metadata only: every "
          "header is read, so the work must be linear in the chunk index (ranks x tensors entries)")
    print(f"{'ranks':>6} {'tensors':>7} {'chunks':>9} {'(c) bytes':>11} {'time':>9} {'us/chunk':>9} {'(d) bytes':>11} {'time':>9}")
    for r in verify_rows:
        print(f"{r['ranks']:>6} {r['tensors']:>7} {r['chunks']:>9} {r['c_bytes'] / 1e6:>9.2f}MB {r['c_s'] * 1e3:>7.1f}ms "
              f"{r['c_s'] / r['chunks'] * 1e6:>9.2f} {r['d_bytes'] / 1e6:>9.2f}MB {r['d_s'] * 1e3:>7.1f}ms")
    for key in ("a_bytes", "a_opens", "b_bytes", "b_opens"):
        problems += growth_problems("read", load_rows, key, slope_max=1.15, interaction_max=0.1)
    for key in ("c_bytes", "d_bytes"):  # linear in each of ranks and tensors: in their product, the chunks
        problems += growth_problems("verify/prune", verify_rows, key, slope_max=1.15, interaction_max=None)
    if not args.no_time_check:
        for key in ("a_s", "b_s"):
            problems += growth_problems("read", load_rows, key, slope_max=1.6, interaction_max=0.5)
        for key in ("c_s", "d_s"):
            problems += growth_problems("verify/prune", verify_rows, key, slope_max=1.6, interaction_max=None)
    print()
    for p in problems:
        print("FAIL:", p)
    print("FAIL: growth faster than linear" if problems else "OK: every figure grows linearly in ranks + tensors "
          "(verify/prune: in the chunks they must read)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
