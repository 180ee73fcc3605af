#!/usr/bin/env python
"""Multi-rank save/load benchmark: ckptctl beside torch.distributed.checkpoint (DCP).

    .venv/bin/python scripts/bench_dist.py [--size-mib 256] [--ranks 1,2,4] [--steady 2]
                                           [--dir PATH] [--json] [--no-prepare] [--device cpu|cuda]

The parent launches one ``torchrun --standalone --nproc-per-node N`` job per N (as
``sys.executable -m torch.distributed.run``; gloo, CPU), each rank re-running this script with
``--child``. ``--device cuda`` puts the model on one GPU per rank (NCCL for the training;
``--ranks`` at most the GPUs present) and so measures the pinned staging path and copy stream
beside DCP's. Every job builds the same FSDP2-sharded state (``fully_shard`` on a CPU device
mesh of N ranks; an MLP of Linear(dim, dim) layers plus its AdamW state after one step;
``--size-mib`` is the total of model + optimizer state over all ranks). Then, as a training job
would after its first optimizer step, it calls ``Checkpointer.prepare(state)`` (plan, and
allocate + fault in the staging buffer on a background thread; skipped with ``--no-prepare``,
or when the Checkpointer has no ``prepare``) and runs 2 more real training steps (forward,
backward, ``opt.step()``, ``zero_grad``) in either mode, so that the background work overlaps
real work and both modes save the same state. Every tool saves that same state in each round.
``--no-prepare`` reproduces the unprepared first save, which also pays for the staging buffer's
memory; the report says which mode ran. It then measures, on that state and the same disk, in
interleaved rounds (round 0 holds the first saves):

* ckptctl: ``Checkpointer(root).save(step, {"model": model, "optimizer": opt})`` stall (until it
  returns), save start -> ``handle.wait()`` (committed), save return -> committed, and the
  slowest rank's own write (``write_s`` in the manifest's stats is the max over ranks of each
  rank's shard write: hash + write + fsync, no coordination);
* DCP: ``get_state_dict(model, opt)`` + ``dcp.async_save(..., process_group=<own gloo group>)``
  stall, save start -> ``future.result()``;
* load with re-sharding: each job after the first loads the previous job's checkpoints
  (written at another world size) into its FSDP2 state, cold (evicted from the page cache):
  ``ck.load(path, state)`` vs ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``. A final
  load-only job at the first N loads the last job's checkpoints (e.g. 4 -> 1), so every N gets
  a re-sharding load. The two loads are checked to give bitwise equal local shards.

Each rank writes its figures to a JSON file; the parent prints, per N, the max over ranks
(the slowest rank gates training) and the targets of issue 3: stall <= DCP's at every N,
first stall <= 0.5 x DCP's first, time to commit within 1.10 x the slowest rank's own write,
re-sharding load <= DCP's. On a small machine (2 cores) N=4 oversubscribes the CPUs: the
output reports the CPU pressure (Linux PSI) over each job. GB = 1e9 bytes.

torch_checkpointing (Meta, BSD; issue 3 asks for it "where it runs on CPU") is NOT measured,
because its re-shardable save does not run on CPU. Version 0.1.1 (needs torch>=2.11; install it
beside our torch with ``pip install --no-deps torch_checkpointing==0.1.1``: its other
dependencies, numpy, safetensors and typing_extensions, come with ckptctl and torch) would be
driven as ``CheckpointManager(CheckpointManager.Config(items={"model": ItemSpec(resharder=
DefaultResharder()), "optimizer": ...}))``, ``fut = mgr.save(path, {"model": msd, "optimizer":
osd})`` on ``get_state_dict(model, opt)`` and ``mgr.load(path, into=...)`` + ``set_state_dict``.
Declaring a resharder (without one a checkpoint cannot be loaded at another world size) makes
the first save all-gather the sharding metadata in
``torch_checkpointing/metadata_manager.py:_all_gather_pickled_data``, which puts its tensors on
``device="cuda"`` whatever the process group's backend. With torch 2.13.0+cpu, gloo and 2 ranks::

    metadata_manager.py, line 416, in _all_gather_pickled_data
        max_size_tensor = torch.tensor([total_size], dtype=torch.int64, device="cuda")
    AssertionError: Torch not compiled with CUDA enabled

At 1 rank it skips that all-gather and saves (with metadata; loading that at 2 ranks was not
tried), and without a resharder it saves at any N, but not a checkpoint that can be loaded at
another world size. The bench saves re-shardable checkpoints at every N, so torch_checkpointing
is left out rather than measured on different terms. Two more things to know when it runs
(on a CUDA host): its default ``LocalFileSystemStorageConfig(use_direct_io=True)`` fails on
this ext4 disk (``OSError: [Errno 22] Invalid argument`` from unaligned O_DIRECT writes;
``use_direct_io=False`` works), and it never fsyncs, so its "written" is not durable the way
ckptctl's and DCP's (``sync_files=True``) commits are; its staging copy also runs after
``save()`` returns (``mgr.lock()`` around ``opt.step()`` waits for it), so its stall is to be
timed to the end of staging, not to the return of ``save()``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from benchutil import cpu_pressure_us, dir_bytes, drop_cache

DIM = 1024  # width of every Linear layer

# (key, label, bound): ratio = ckptctl / DCP (or commit / write), lower is better.
TARGETS = [
    ("steady_stall", "steady stall / DCP steady stall", 1.0),
    ("first_stall", "first stall / DCP first stall", 0.5),
    ("commit_vs_write", "commit (save return -> committed) / slowest rank's write", 1.10),
    ("reshard_load", "re-sharding load / DCP re-sharding load", 1.0),
]


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


# --- child: one rank of one torchrun job --------------------------------------------------


def build(world: int, layers: int, device: str = "cpu", seed: int = 0):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)  # same full weights on every rank before sharding
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(layers)]).to(device)
    mesh = init_device_mesh(device, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    train_step(model, opt, g)
    return model, opt, g


def train_step(model, opt, g) -> None:
    """One real step on the FSDP2 model: forward, backward, optimizer step, zero_grad. ``g``
    draws the batch, the same on every rank."""
    import torch

    x = torch.randn(8, DIM, generator=g).to(next(model.parameters()).device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def local_tensors(model, opt) -> list:
    """Every local shard of model and optimizer state, in a fixed order."""
    import torch

    out = []
    for p in model.parameters():
        out.append(p.to_local() if hasattr(p, "to_local") else p)
        for k in sorted(opt.state[p]):
            v = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def child(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    if a.device == "cuda":
        # One GPU per rank; NCCL for the training, gloo for CPU tensors (DCP's metadata).
        # ckptctl makes its own gloo group either way.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cuda:nccl,cpu:gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Import time is nobody's stall.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckptctl import Checkpointer
    from ckptctl.ops.inspect import inspect_checkpoint
    from ckptctl.storage import open_storage

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[bench N={world}] {msg}", file=sys.stderr, flush=True)

    model, opt, g = build(world, a.layers, a.device)
    state = {"model": model, "optimizer": opt}
    local_bytes = sum(t.numel() * t.element_size() for t in local_tensors(model, opt))
    res: dict = {"rank": rank, "world": world, "local_bytes": local_bytes, "ck": {}, "dcp": {}}

    def add(tool: str, key: str, v) -> None:
        res[tool].setdefault(key, []).append(v)

    ck = Checkpointer(os.path.join(a.work, f"ckptctl-{world}"), timeout_s=600)
    if not a.no_save:
        # As a training job would after its first optimizer step (build() made it): prepare,
        # then keep training. The 2 steps run in both modes, for every tool alike.
        if a.no_prepare:
            res["prepare"] = "off (--no-prepare)"
        elif not hasattr(ck, "prepare"):
            res["prepare"] = "unavailable (Checkpointer has no prepare)"
        else:
            t0 = time.perf_counter()
            ok = ck.prepare(state)
            res["prepare_s"] = time.perf_counter() - t0
            res["prepare"] = "on" if ok is not False else "on, but prepare() returned False"
        t0 = time.perf_counter()
        for _ in range(2):
            train_step(model, opt, g)
        res["steps_s"] = time.perf_counter() - t0
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives off the default group
    last_ck = last_dcp = None
    if not a.no_save:
        for r in range(1 + a.steady):
            log(f"save round {r}" + (" (first saves)" if r == 0 else ""))
            # ckptctl
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            h = ck.save(r + 1, state)
            t1, c1 = time.perf_counter(), time.process_time()
            url = h.wait()
            t2 = time.perf_counter()
            add("ck", "stall_s", t1 - t0)
            add("ck", "stall_cpu_s", c1 - c0)
            add("ck", "commit_s", t2 - t0)
            add("ck", "bg_s", t2 - t1)
            dist.barrier()
            if rank == 0:
                stats = inspect_checkpoint(open_storage(url)).stats
                add("ck", "write_s", stats.get("write_s"))  # max over ranks
                add("ck", "manifest_stall_s", stats.get("stall_s"))
                add("ck", "capture_s", stats.get("capture_s"))  # max over ranks
                add("ck", "copy_s", stats.get("copy_s"))
                res["ck"]["file_bytes"] = dir_bytes(local_path(url))
            last_ck = url
            # DCP
            path = os.path.join(a.work, f"dcp-{world}-{r}")
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            msd, osd = get_state_dict(model, opt)
            tg = time.perf_counter()
            fut = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, process_group=dcp_pg)
            t1, c1 = time.perf_counter(), time.process_time()
            fut.result()
            t2 = time.perf_counter()
            add("dcp", "stall_s", t1 - t0)
            add("dcp", "stall_cpu_s", c1 - c0)
            add("dcp", "get_state_dict_s", tg - t0)
            add("dcp", "commit_s", t2 - t0)
            add("dcp", "bg_s", t2 - t1)
            del msd, osd, fut
            dist.barrier()
            if rank == 0:
                res["dcp"]["file_bytes"] = dir_bytes(path)
                if last_dcp:
                    shutil.rmtree(last_dcp, ignore_errors=True)  # keep the newest only
                os.sync()
            last_dcp = path
        res["ck_path"], res["dcp_path"] = last_ck, last_dcp

    if a.load_ck and a.load_dcp:
        log(f"re-sharding loads from {a.load_from} ranks")
        dist.barrier()
        if rank == 0:
            drop_cache(local_path(a.load_ck))
        dist.barrier()
        t0 = time.perf_counter()
        ck.load(a.load_ck, state)
        add("ck", "load_s", time.perf_counter() - t0)
        got = [t.clone() for t in local_tensors(model, opt)]
        with torch.no_grad():
            for t in local_tensors(model, opt):
                t.zero_()
        dist.barrier()
        if rank == 0:
            drop_cache(a.load_dcp)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=a.load_dcp)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        add("dcp", "load_s", time.perf_counter() - t0)
        now = local_tensors(model, opt)
        res["load_equal"] = len(now) == len(got) and all(torch.equal(x, y) for x, y in zip(now, got))
        res["load_nonzero"] = any(bool(t.abs().sum() > 0) for t in got)
        del got, sd, msd, osd

    ck.close()
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- parent -------------------------------------------------------------------------------


def launch(n: int, a: argparse.Namespace, work: str, layers: int, tag: str, extra: list[str]) -> dict:
    out = os.path.join(work, f"result-{tag}")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.abspath(__file__), "--child", "--work", work, "--out", out, "--layers", str(layers),
           "--steady", str(a.steady), "--device", a.device, *(["--no-prepare"] if a.no_prepare else []), *extra]
    p0, t0, la0 = cpu_pressure_us(), time.perf_counter(), os.getloadavg()[0]
    rc = subprocess.run(cmd, stdout=sys.stderr).returncode
    wall = time.perf_counter() - t0
    p1 = cpu_pressure_us()
    if rc != 0:
        raise SystemExit(f"torchrun with {n} ranks failed (exit {rc})")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(n)]
    return {"n": n, "ranks": ranks, "wall_s": wall, "loadavg": (la0, os.getloadavg()[0]),
            "pressure": (p1 - p0) / 1e6 / wall if p0 is not None and p1 is not None else None}


def per_round_max(ranks: list[dict], tool: str, key: str) -> list[float]:
    cols = [r[tool].get(key) or [] for r in ranks]
    return [max(c) for c in zip(*cols)] if all(cols) else []


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def div(a, b):
    return a / b if a is not None and b else None


def summarize(job: dict, load_job: dict | None, load_from: int | None) -> dict:
    ranks = job["ranks"]
    s: dict = {"n": job["n"], "bytes": sum(r["local_bytes"] for r in ranks)}
    r0 = ranks[0]
    for tool in ("ck", "dcp"):
        for key in ("stall_s", "stall_cpu_s", "commit_s", "bg_s", "get_state_dict_s"):
            s[f"{tool}_{key}"] = per_round_max(ranks, tool, key)
        s[f"{tool}_stall_per_rank"] = [r[tool]["stall_s"] for r in ranks]
        s[f"{tool}_file_bytes"] = r0[tool].get("file_bytes")
    modes = sorted({r.get("prepare", "n/a") for r in ranks})
    s["prepare"] = modes[0] if len(modes) == 1 else "mixed: " + "; ".join(modes)
    s["prepare_call_s"] = max((r["prepare_s"] for r in ranks if "prepare_s" in r), default=None)
    s["steps_before_first_save_s"] = max((r["steps_s"] for r in ranks if "steps_s" in r), default=None)
    s["ck_write_s"] = r0["ck"].get("write_s") or []
    s["ck_manifest_stall_s"] = r0["ck"].get("manifest_stall_s") or []
    s["ck_capture_s"] = r0["ck"].get("capture_s") or []
    s["ck_copy_s"] = r0["ck"].get("copy_s") or []
    if load_job is not None:
        lr = load_job["ranks"]
        s["load_from"] = load_from
        s["ck_load_s"] = max(r["ck"]["load_s"][0] for r in lr)
        s["dcp_load_s"] = max(r["dcp"]["load_s"][0] for r in lr)
        s["load_ok"] = all(r.get("load_equal") and r.get("load_nonzero") for r in lr)
    ck_first, dcp_first = s["ck_stall_s"][0], s["dcp_stall_s"][0]
    ck_steady, dcp_steady = med(s["ck_stall_s"][1:]), med(s["dcp_stall_s"][1:])
    commit_ratios = [div(b, w) for b, w in zip(s["ck_bg_s"], s["ck_write_s"])]
    s["ratios"] = {
        "steady_stall": med([div(c, d) for c, d in zip(s["ck_stall_s"][1:], s["dcp_stall_s"][1:])]),
        "first_stall": div(ck_first, dcp_first),
        "commit_vs_write": med(commit_ratios),
        "reshard_load": div(s.get("ck_load_s"), s.get("dcp_load_s")),
    }
    s["info"] = {
        "commit_per_round": commit_ratios,
        "commit_from_start_vs_write": med([div(c, w) for c, w in zip(s["ck_commit_s"], s["ck_write_s"])]),
        "ck_steady_s": ck_steady, "dcp_steady_s": dcp_steady,
    }
    s["verdicts"] = {k: (None if s["ratios"][k] is None else s["ratios"][k] <= b) for k, _, b in TARGETS}
    s["pressure"] = job["pressure"]
    s["loadavg"] = job["loadavg"]
    return s


def print_report(summaries: list[dict], a: argparse.Namespace, out) -> None:
    def p(*x):
        print(*x, file=out)

    def ms(v):
        return f"{v * 1e3:9.1f} ms" if v is not None else "       n/a   "

    def gbs(nb, v):
        return f"{nb / v / 1e9:6.2f} GB/s" if v else "    n/a   "

    def xs(v):
        return "[" + " ".join(f"{x:.2f}" for x in v) + "] s"

    import torch

    where = (f"model on {torch.cuda.get_device_name()} (NCCL), pinned staging" if a.device == "cuda" else "gloo on CPU")
    p(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; {where}; one torchrun job per N")
    p(f"state: MLP of {a.layers} x Linear({DIM}, {DIM}) + AdamW after 3 training steps, FSDP2 fully_shard; "
      f"~{summaries[0]['bytes'] / 2**20:.0f} MiB over all ranks; 1 first + {a.steady} steady saves per tool")
    modes = sorted({s["prepare"] for s in summaries})
    p(f"prepare mode: {'; '.join(modes)} -- Checkpointer.prepare(state) right after build's training step "
      "unless --no-prepare; then, in both modes, 2 more training steps before round 0 (all tools save that state)")
    p("figures are the max over ranks (the slowest rank gates training); steady = median over steady rounds;")
    p("DCP stall includes get_state_dict (ckptctl's save() captures the state itself); GB = 1e9 bytes")
    p("torch_checkpointing: not measured -- its re-shardable save needs CUDA at N > 1 (see this script's docstring)")
    for s in summaries:
        n, nb = s["n"], s["bytes"]
        p()
        pr = s["pressure"]
        noisy = pr is not None and pr > 0.2
        p(f"=== N = {n} ranks ({nb / n / 2**20:.0f} MiB per rank)   CPU pressure over the job: "
          + (f"{pr:.0%}" if pr is not None else "n/a") + f", load avg {s['loadavg'][0]:.1f} -> {s['loadavg'][1]:.1f}"
          + ("  -> NOISY: CPUs oversubscribed" if noisy else ""))
        pc, st = s["prepare_call_s"], s["steps_before_first_save_s"]
        p(f"  first save prepared: {s['prepare']}"
          + (f"; prepare() returned in {pc * 1e3:.1f} ms" if pc is not None else "")
          + (f"; the 2 training steps before round 0 took {st * 1e3:.0f} ms" if st is not None else ""))
        p(f"  {'':<40}{'ckptctl':>13}{'DCP':>13}   samples ckptctl | DCP (per round, max over ranks)")
        p(f"  {'stall, first save':<40}{ms(s['ck_stall_s'][0])}{ms(s['dcp_stall_s'][0])}")
        p(f"  {'stall, steady':<40}{ms(s['info']['ck_steady_s'])}{ms(s['info']['dcp_steady_s'])}   "
          f"{xs(s['ck_stall_s'])} | {xs(s['dcp_stall_s'])}")
        p(f"  {'  stall per rank, first save':<40}  " + " ".join(f"{r[0] * 1e3:.0f}" for r in s["ck_stall_per_rank"])
          + " ms | " + " ".join(f"{r[0] * 1e3:.0f}" for r in s["dcp_stall_per_rank"]) + " ms")
        p(f"  {'  CPU time of the stall, steady':<40}{ms(med(s['ck_stall_cpu_s'][1:]))}{ms(med(s['dcp_stall_cpu_s'][1:]))}")
        p(f"  {'  of which DCP get_state_dict':<40}{'':>13}{ms(med(s['dcp_get_state_dict_s']))}")
        if s["ck_capture_s"] and None not in s["ck_capture_s"]:
            p(f"  {'  ckptctl capture+plan | copy, steady':<40}{ms(med(s['ck_capture_s'][1:]))} | {med(s['ck_copy_s'][1:]) * 1e3:.1f} ms"
              " (max over ranks, from the manifest)")
        p(f"  {'save start -> committed':<40}{ms(med(s['ck_commit_s']))}{ms(med(s['dcp_commit_s']))}   "
          f"{xs(s['ck_commit_s'])} | {xs(s['dcp_commit_s'])}")
        p(f"  {'save return -> committed':<40}{ms(med(s['ck_bg_s']))}{ms(med(s['dcp_bg_s']))}   "
          f"{xs(s['ck_bg_s'])} | {xs(s['dcp_bg_s'])}")
        p(f"  {'slowest rank own write (manifest)':<40}{ms(med(s['ck_write_s']))}{'':>13}   {xs(s['ck_write_s'])}")
        p(f"  {'throughput (state / start->committed)':<40}{gbs(nb, med(s['ck_commit_s'])):>13}{gbs(nb, med(s['dcp_commit_s'])):>13}")
        if "ck_load_s" in s:
            ok = "bitwise equal" if s["load_ok"] else "LOADS DIFFER"
            what = f"re-sharding load {s['load_from']} -> {n} (cold)"
            p(f"  {what:<40}{ms(s['ck_load_s'])}{ms(s['dcp_load_s'])}   "
              f"{gbs(nb, s['ck_load_s'])} | {gbs(nb, s['dcp_load_s'])}; the two loads' shards: {ok}")
        fb = [s.get("ck_file_bytes"), s.get("dcp_file_bytes")]
        p(f"  {'on disk':<40}" + "".join(f"{x / 2**20:10.1f} MiB" if x else "      n/a    " for x in fb))
        p(f"  TARGETS (N={n})")
        for k, label, bound in TARGETS:
            v = s["ratios"][k]
            verdict = "n/a" if v is None else ("PASS" if v <= bound else "MISS")
            p(f"    {label:<58}{(f'{v:6.2f}' if v is not None else '   n/a'):>8}  <= {bound:<5} {verdict}")
        cf = s["info"]["commit_from_start_vs_write"]
        p(f"    {'(info) commit from save start / slowest rank write':<58}{(f'{cf:6.2f}' if cf is not None else '   n/a'):>8}")
    p()
    p(f"  {'SUMMARY: ratio (verdict) per N':<58}" + "".join(f"{'N=' + str(s['n']):>15}" for s in summaries))
    for k, label, bound in TARGETS:
        cells = []
        for s in summaries:
            v = s["ratios"][k]
            cells.append(f"{'n/a':>15}" if v is None else f"{v:6.2f} ({'PASS' if v <= bound else 'MISS'})".rjust(15))
        p(f"  {label + ' <= ' + str(bound):<58}" + "".join(cells))
    p()
    p("NOTE: the machine has few cores; with N > cores the ranks and their writer threads share CPUs,")
    p("so stalls and write times at N=4 include waiting for a CPU (see CPU pressure); single samples")
    p("swing 2-3x on a shared VM. Ratios compare tools measured side by side in the same job.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="multi-rank ckptctl vs DCP benchmark (torchrun, gloo, CPU)")
    ap.add_argument("--size-mib", type=float, default=256, help="total model + AdamW state in MiB (default 256)")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    ap.add_argument("--steady", type=int, default=2, help="steady-state saves after the first (default 2)")
    ap.add_argument("--dir", default=None, help="where to write (a temporary directory is made inside)")
    ap.add_argument("--json", action="store_true", help="also dump the summaries as JSON on stdout")
    ap.add_argument("--no-prepare", action="store_true",
                    help="do not call Checkpointer.prepare before the first save (the unprepared first save)")
    # child-only
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model lives (cuda: one GPU per rank, NCCL; the pinned staging path)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-ck", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-dcp", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-from", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.steady = max(a.steady, 1)
    if a.child:
        return child(a)

    per_layer = (DIM * DIM + DIM) * 4 * 3  # weight + bias, fp32, param + exp_avg + exp_avg_sq
    a.layers = max(1, round(a.size_mib * 2**20 / per_layer))
    ns = [int(x) for x in a.ranks.split(",") if x.strip()]
    if a.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(ns) > have:
            raise SystemExit(f"--device cuda needs one GPU per rank: --ranks {a.ranks} asks for {max(ns)}, this host has {have}")
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckptctl-bench-dist-", dir=a.dir or "/tmp")
    t_start = time.perf_counter()
    try:
        jobs, summaries = [], []
        for i, n in enumerate(ns):
            extra: list[str] = []
            if i > 0:
                prev = jobs[-1]["ranks"][0]
                extra = ["--load-ck", prev["ck_path"], "--load-dcp", prev["dcp_path"], "--load-from", str(ns[i - 1])]
            print(f"[bench] N={n} ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr, flush=True)
            jobs.append(launch(n, a, work, a.layers, str(n), extra))
        load_first = None
        if len(ns) > 1:  # the first N re-shards too: load the last job's checkpoints
            last = jobs[-1]["ranks"][0]
            print(f"[bench] N={ns[0]} load-only ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr, flush=True)
            load_first = launch(ns[0], a, work, a.layers, f"{ns[0]}-load",
                                ["--no-save", "--load-ck", last["ck_path"], "--load-dcp", last["dcp_path"], "--load-from", str(ns[-1])])
        for i, job in enumerate(jobs):
            if i == 0:
                summaries.append(summarize(job, load_first, ns[-1] if load_first else None))
            else:
                summaries.append(summarize(job, job, ns[i - 1]))
        print_report(summaries, a, sys.stdout)
        print(f"[bench] done in {time.perf_counter() - t_start:.0f}s", file=sys.stderr)
        if a.json:
            json.dump(summaries, sys.stdout, indent=2, default=str)
            print()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
