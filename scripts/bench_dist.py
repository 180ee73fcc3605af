#!/usr/bin/env python
"""Multi-rank save/load benchmark: ckptctl beside torch.distributed.checkpoint (DCP).

    .venv/bin/python scripts/bench_dist.py [--size-mib 256] [--ranks 1,2,4] [--steady 5]
                                           [--dir PATH] [--json] [--no-prepare] [--device cpu|cuda]
    .venv/bin/python scripts/bench_dist.py --phases [--ranks 1,2] [--size-mib 256] [--steady 5]

The parent launches one ``torchrun --standalone --nproc-per-node N`` job per N (as
``sys.executable -m torch.distributed.run``; gloo, CPU), each rank re-running this script with
``--child``. ``--device cuda`` puts the model on one GPU per rank (NCCL for the training;
``--ranks`` at most the GPUs present) and so measures the pinned staging path and copy stream
beside DCP's. Every job builds the same FSDP2-sharded state (``fully_shard`` on a CPU device
mesh of N ranks; an MLP of Linear(dim, dim) layers plus its AdamW state after one step;
``--size-mib`` is the total of model + optimizer state over all ranks), saved through each
tool's own model/optimizer state-dict path.

Three tools save that state in every round, in an order that rotates from round to round:

* ckptctl: ``Checkpointer(root).save(step, {"model": model, "optimizer": opt})`` stall (until it
  returns), save start -> ``handle.wait()`` (committed: durable), save return -> committed,
  and the slowest rank's own write (``write_s`` in the manifest's stats is the max over ranks
  of each rank's shard write: hash + write + fsync, no coordination);
* DCP*: ``get_state_dict(model, opt)`` + ``dcp.async_save(..., async_stager=<one DefaultStager
  kept across saves>, process_group=<own gloo group>)``: its host copies are reused from save
  to save, DCP at its best on this host and the reference of the targets;
* DCP default: the same with async_save's default stager (fresh host copies every save).

Round 0 is every tool's cold first save (a fresh Checkpointer, a fresh stager, no
``prepare()`` and no ``stage()``; the job first calls ``load_latest``, finding nothing, as the
README's training loop does, then trains for 1 s, longer if ckptctl's background preparation
is not done by then: a job's first save comes minutes in). Then both tools get the same
warm-up: ``Checkpointer.prepare(state)`` and one
``stage()`` of DCP*'s stager, followed by 2 training steps; round 1 is the prepared first save,
rounds 2.. the steady ones (``--no-prepare`` skips the warm-up for both). Each tool keeps only
its newest checkpoint (``--keep-all``: every one, as a job that never prunes, so the page cache
grows by a checkpoint per save); deletion and an ``os.sync()`` run outside the timed sections, and
``/proc/meminfo`` Dirty/Writeback is recorded before each save. Time to durable is printed per
round with the ratio to DCP*, and each tool's growth over the consecutive saves 1.. (median of
the later half / median of the earlier half; when DCP* grows too, the machine slowed down). What "durable" guarantees differs: ckptctl fsyncs every
file, renames it and fsyncs the directory, marker last; DCP fsyncs its files and renames
``.metadata`` but fsyncs no directory. ``--phases`` instead times each phase of a rank's shard
write (hash, write, fsync, rename + directory fsync) for a plain writer and for ckptctl's, N
processes at once, every file kept (``benchutil.write_phases``).

Load with re-sharding: each job after the first loads the previous job's checkpoints
(written at another world size) into its FSDP2 state, cold (evicted from the page cache):
``ck.load(path, state)`` vs ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``, both into
the live tensors. A final load-only job at the first N loads the last job's checkpoints (e.g.
4 -> 1), so every N gets a re-sharding load. The two loads are checked to give bitwise equal
local shards.

Each rank writes its figures to a JSON file; the parent prints, per N, the max over ranks
(the slowest rank gates training) and the targets, each a median of per-round ratios with its
min and max: steady stall <= DCP*'s, cold first stall <= 0.5 x DCP*'s cold first, prepared
first stall <= DCP*'s prepared first, time to durable <= DCP*'s and not growing over the
consecutive saves (median of the later half / of the earlier half <= 1.25), commit within 1.10 x the slowest rank's own write, re-sharding load <= DCP's. On a small machine (2 cores) N=4 oversubscribes the CPUs: the
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

from benchutil import cpu_pressure_us, dir_bytes, drop_cache, free_memory, meminfo_mib, write_phases

DIM = 1024  # width of every Linear layer

TOOLS = ["ck", "dcp", "dcpd"]  # ckptctl, DCP with a kept stager (the reference), DCP default

# (key, label, bound): ratio = ckptctl / DCP* (DCP at its best: kept stager), lower is better.
TARGETS = [
    ("steady_stall", "steady stall / DCP* steady stall", 1.0),
    ("cold_first_stall", "cold first stall / DCP* cold first stall", 0.5),
    ("prepared_first_stall", "prepared first stall / DCP* prepared first stall", 1.0),
    ("durable", "time to durable / DCP* (saves 1..)", 1.0),
    ("durable_growth", "time to durable, later / earlier saves (growth)", 1.25),
    ("commit_vs_write", "commit (save return -> committed) / slowest rank write", 1.10),
    ("reshard_load", "re-sharding load / DCP re-sharding load", 1.0),
]
# Same-run comparisons with DCP's default configuration (shown, never PASS/MISS).
INFO = [
    ("steady_stall_vs_default", "steady stall / DCP default steady stall"),
    ("durable_vs_default", "time to durable / DCP default (saves 1..)"),
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


def make_stager(device: str):
    """DCP at its best: one DefaultStager kept across saves, so its StateDictStager reuses its
    host copies (it caches them by storage) instead of allocating every save. Synchronous
    staging: async_save returns after the copy, as ckptctl's save() does. Pinned memory only
    where there is a device to copy from."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=cuda))


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
    res: dict = {"rank": rank, "world": world, "local_bytes": local_bytes, "order": []}
    for tool in TOOLS:
        res[tool] = {}

    def add(tool: str, key: str, v) -> None:
        res[tool].setdefault(key, []).append(v)

    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives off the default group
    newest: dict[str, str | None] = {t: None for t in TOOLS}

    def start_line() -> None:
        """Every rank at the start line with its GPU drained: a gloo barrier does not wait for
        kernels still queued, which would otherwise land in whichever tool is timed next."""
        if a.device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def keep_newest(tool: str, path: str) -> None:
        """Every tool keeps only its newest checkpoint (as keep_last=1 would; --keep-all: every
        one), deleted outside the timed section; then everything is flushed, so no tool
        inherits dirty pages."""
        dist.barrier()
        if rank == 0:
            old, newest[tool] = newest[tool], path
            if old and not a.keep_all:
                shutil.rmtree(local_path(old), ignore_errors=True)
            os.sync()
        dist.barrier()

    def save_ck(ck, r: int) -> None:
        start_line()
        add("ck", "dirty_mib", meminfo_mib())
        t0, c0 = time.perf_counter(), time.process_time()
        h = ck.save(r + 1, state)
        t1, c1 = time.perf_counter(), time.process_time()
        url = h.wait()
        t2 = time.perf_counter()
        add("ck", "stall_s", t1 - t0)
        add("ck", "stall_cpu_s", c1 - c0)
        add("ck", "durable_s", t2 - t0)
        add("ck", "bg_s", t2 - t1)
        dist.barrier()
        if rank == 0:
            stats = inspect_checkpoint(open_storage(url)).stats
            add("ck", "write_s", stats.get("write_s"))  # max over ranks
            add("ck", "capture_s", stats.get("capture_s"))  # max over ranks
            add("ck", "copy_s", stats.get("copy_s"))
            res["ck"]["file_bytes"] = dir_bytes(local_path(url))
        keep_newest("ck", url)

    def save_dcp(tool: str, r: int, stager) -> None:
        path = os.path.join(a.work, f"{tool}-{world}-{r}")
        start_line()
        add(tool, "dirty_mib", meminfo_mib())
        t0, c0 = time.perf_counter(), time.process_time()
        msd, osd = get_state_dict(model, opt)
        tg = time.perf_counter()
        kw = {"async_stager": stager} if stager is not None else {}
        fut = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, process_group=dcp_pg, **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        fut.result()
        t2 = time.perf_counter()
        add(tool, "stall_s", t1 - t0)
        add(tool, "stall_cpu_s", c1 - c0)
        add(tool, "get_state_dict_s", tg - t0)
        add(tool, "durable_s", t2 - t0)
        add(tool, "bg_s", t2 - t1)
        del msd, osd, fut
        dist.barrier()
        if rank == 0:
            res[tool]["file_bytes"] = dir_bytes(path)
        keep_newest(tool, path)

    if not a.no_save:
        # Round 0, cold: every tool's first save with no prepare() and no stage() (a fresh
        # Checkpointer, a fresh kept stager). The job starts as the README's loop does:
        # load_latest (nothing to resume), which prepares ckptctl's buffer in the background
        # on its own; then at least 1 s of training, and the first saves.
        log("save round 0 (cold first saves)")
        ck_cold = Checkpointer(os.path.join(a.work, f"ckptctl-cold-{world}"), timeout_s=600)
        ck_cold.load_latest(state)
        t0, steps = time.perf_counter(), 0
        while True:
            train_step(model, opt, g)
            steps += 1
            # A job's first save comes minutes in: train until ckptctl's background preparation
            # is done too (on a loaded host faulting the buffer in takes more than a second).
            # Every rank takes as many steps (FSDP's collectives pair up): any rank asks for more.
            staging = ck_cold._saver.staging
            ready = staging.ready or not staging.held
            more = torch.tensor([int(steps < 2 or time.perf_counter() - t0 < 1.0 or not ready)])
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item() or time.perf_counter() - t0 > 60:
                break
        res["cold_steps"], res["cold_train_s"] = steps, time.perf_counter() - t0
        cold_stager = make_stager(a.device)
        order = TOOLS[:]
        res["order"].append(order)
        for tool in order:
            free_memory()  # the same heap for every cold first save: nobody reuses another's pages
            if tool == "ck":
                save_ck(ck_cold, 0)
            else:
                save_dcp(tool, 0, cold_stager if tool == "dcp" else None)
        ck_cold.close()
        cold_stager.close()
        del ck_cold, cold_stager
        # Prepared: the same warm-up for both tools, as a training job would after a step:
        # ckptctl plans and faults in its staging buffer (prepare), DCP's kept stager makes its
        # host copies (stage once); then 2 more training steps, so both save newer values.
        ck = Checkpointer(os.path.join(a.work, f"ckptctl-{world}"), timeout_s=600)
        stager = make_stager(a.device)
        if a.no_prepare:
            res["prepare"] = "off (--no-prepare): neither tool warmed up"
        else:
            t0 = time.perf_counter()
            ok = ck.prepare(state)
            res["prepare_s"] = time.perf_counter() - t0
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            stager.stage({"model": msd, "optimizer": osd})
            res["dcp_stage_s"] = time.perf_counter() - t0
            del msd, osd
            res["prepare"] = ("ckptctl prepare() + DCP kept stager staged once" if ok is not False
                              else "prepare() returned False; DCP stager staged once")
        t0 = time.perf_counter()
        for _ in range(2):
            train_step(model, opt, g)
        res["steps_s"] = time.perf_counter() - t0
        for r in range(1, 1 + a.steady + 1):
            log(f"save round {r}" + (" (prepared first saves)" if r == 1 else ""))
            order = TOOLS[r % len(TOOLS):] + TOOLS[: r % len(TOOLS)]  # rotate who goes first
            res["order"].append(order)
            for tool in order:
                if tool == "ck":
                    save_ck(ck, r)
                else:
                    save_dcp(tool, r, stager if tool == "dcp" else None)
        stager.close()
        res["ck_path"], res["dcp_path"] = newest["ck"], newest["dcp"]
    else:
        ck = Checkpointer(os.path.join(a.work, f"ckptctl-{world}"), timeout_s=600)

    if a.load_ck and a.load_dcp:
        # Both load into the live model and optimizer (existing tensors): ckptctl directly,
        # DCP into get_state_dict's tensors and then set_state_dict, as its docs show.
        log(f"re-sharding loads from {a.load_from} ranks")
        dist.barrier()
        if rank == 0:
            drop_cache(local_path(a.load_ck))
        start_line()
        t0 = time.perf_counter()
        ck.load(a.load_ck, state)
        if a.device == "cuda":
            torch.cuda.synchronize()  # the copies onto the GPU are part of the load
        add("ck", "load_s", time.perf_counter() - t0)
        got = [t.clone() for t in local_tensors(model, opt)]
        with torch.no_grad():
            for t in local_tensors(model, opt):
                t.zero_()
        dist.barrier()
        if rank == 0:
            drop_cache(a.load_dcp)
        start_line()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=a.load_dcp)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        if a.device == "cuda":
            torch.cuda.synchronize()  # the copies onto the GPU are part of the load
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
           "--steady", str(a.steady), "--device", a.device, *(["--no-prepare"] if a.no_prepare else []),
           *(["--keep-all"] if a.keep_all else []), *extra]
    p0, t0, la0 = cpu_pressure_us(), time.perf_counter(), os.getloadavg()[0]
    rc = subprocess.run(cmd, stdout=sys.stderr).returncode
    wall = time.perf_counter() - t0
    p1 = cpu_pressure_us()
    if rc != 0:
        raise SystemExit(f"torchrun with {n} ranks failed (exit {rc})")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(n)]
    return {"n": n, "ranks": ranks, "wall_s": wall, "loadavg": (la0, os.getloadavg()[0]),
            "pressure": (p1 - p0) / 1e6 / wall if p0 is not None and p1 is not None else None}


def per_round_max(ranks: list[dict], tool: str, key: str) -> list:
    cols = [r[tool].get(key) or [] for r in ranks]
    return [max(c) for c in zip(*cols)] if all(cols) else []


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def div(a, b):
    return a / b if a is not None and b else None


def spread(xs: list) -> tuple | None:
    """(min, median, max) of the samples that exist."""
    xs = [x for x in xs if x is not None]
    return (min(xs), statistics.median(xs), max(xs)) if xs else None


def growth(xs: list) -> float | None:
    """Median of the later half of a series over the median of its earlier half: > 1 when the
    saves get slower one after another."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 4:
        return None
    h = len(xs) // 2
    return div(statistics.median(xs[-h:]), statistics.median(xs[:h]))


def summarize(job: dict, load_job: dict | None, load_from: int | None) -> dict:
    ranks = job["ranks"]
    s: dict = {"n": job["n"], "bytes": sum(r["local_bytes"] for r in ranks), "order": ranks[0]["order"]}
    r0 = ranks[0]
    for tool in TOOLS:
        for key in ("stall_s", "stall_cpu_s", "durable_s", "bg_s", "get_state_dict_s"):
            s[f"{tool}_{key}"] = per_round_max(ranks, tool, key)
        s[f"{tool}_file_bytes"] = r0[tool].get("file_bytes")
        s[f"{tool}_dirty_mib"] = r0[tool].get("dirty_mib") or []
    modes = sorted({r.get("prepare", "n/a") for r in ranks})
    s["prepare"] = modes[0] if len(modes) == 1 else "mixed: " + "; ".join(modes)
    s["prepare_call_s"] = max((r["prepare_s"] for r in ranks if "prepare_s" in r), default=None)
    s["dcp_stage_s"] = max((r["dcp_stage_s"] for r in ranks if "dcp_stage_s" in r), default=None)
    s["steps_before_first_save_s"] = max((r["steps_s"] for r in ranks if "steps_s" in r), default=None)
    s["cold_train"] = max(((r["cold_train_s"], r["cold_steps"]) for r in ranks if "cold_train_s" in r), default=None)
    for key in ("write_s", "capture_s", "copy_s"):
        s[f"ck_{key}"] = r0["ck"].get(key) or []
    if load_job is not None:
        lr = load_job["ranks"]
        s["load_from"] = load_from
        s["ck_load_s"] = max(r["ck"]["load_s"][0] for r in lr)
        s["dcp_load_s"] = max(r["dcp"]["load_s"][0] for r in lr)
        s["load_ok"] = all(r.get("load_equal") and r.get("load_nonzero") for r in lr)

    def paired(key: str, ref: str, rounds: slice) -> list:
        return [div(c, d) for c, d in zip(s[f"ck_{key}"][rounds], s[f"{ref}_{key}"][rounds])]

    # Rounds: 0 cold first saves, 1 prepared first saves, 2.. steady. Time to durable is
    # judged over every save of the prepared Checkpointer (1..), all consecutive.
    s["per_round"] = {
        "steady_stall": paired("stall_s", "dcp", slice(2, None)),
        "durable": paired("durable_s", "dcp", slice(1, None)),
        "durable_vs_default": paired("durable_s", "dcpd", slice(1, None)),
        "steady_stall_vs_default": paired("stall_s", "dcpd", slice(2, None)),
        "commit_vs_write": [div(b, w) for b, w in zip(s["ck_bg_s"], s["ck_write_s"])],
    }
    one = lambda v: [v] if v is not None else []  # noqa: E731
    s["per_round"].update({
        "cold_first_stall": one(div(s["ck_stall_s"][0], s["dcp_stall_s"][0])),
        "prepared_first_stall": one(div(s["ck_stall_s"][1], s["dcp_stall_s"][1])),
        # ckptctl's own times, not the paired ratio: DCP* speeds up over its first saves here
        # (its page cache settles), which would read as growth of the ratio. DCP*'s own growth
        # is printed beside it: when both grow, the machine slowed down.
        "durable_growth": one(growth(s["ck_durable_s"][1:])),
        "reshard_load": one(div(s.get("ck_load_s"), s.get("dcp_load_s"))),
    })
    s["dcp_growth"] = growth(s["dcp_durable_s"][1:])
    s["spread"] = {k: spread(v) for k, v in s["per_round"].items()}
    s["ratios"] = {k: (v[1] if v else None) for k, v in s["spread"].items()}
    s["verdicts"] = {k: (None if s["ratios"][k] is None else s["ratios"][k] <= b) for k, _, b in TARGETS}
    s["pressure"] = job["pressure"]
    s["loadavg"] = job["loadavg"]
    return s


GUARANTEES = [
    "ckptctl: each shard fsynced, renamed, directory fsynced; then manifest and marker the same way",
    "  (temporary name, fsync, rename/link, directory fsync), marker last: committed = on disk, names too",
    "DCP (FileSystemWriter, sync_files=True): each data file and .metadata fsynced, .metadata renamed,",
    "  no directory fsync: after a power loss the files' names (and so the checkpoint) may be gone",
]


def print_report(summaries: list[dict], a: argparse.Namespace, out) -> None:
    def p(*x):
        print(*x, file=out)

    def ms(v):
        return f"{v * 1e3:9.1f} ms" if v is not None else "       n/a   "

    def gbs(nb, v):
        return f"{nb / v / 1e9:6.2f} GB/s" if v else "    n/a   "

    def xs(v, unit=" s"):
        return "[" + " ".join("n/a" if x is None else f"{x:.2f}" for x in v) + "]" + unit

    def mmm(sp):
        return "n/a" if sp is None else f"{sp[1]:.2f} (min {sp[0]:.2f}, max {sp[2]:.2f})"

    import torch

    where = (f"model on {torch.cuda.get_device_name()} (NCCL), pinned staging" if a.device == "cuda" else "gloo on CPU")
    p(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; {where}; one torchrun job per N")
    p(f"state: MLP of {a.layers} x Linear({DIM}, {DIM}) + AdamW, FSDP2 fully_shard, saved through "
      f"each tool's model/optimizer state-dict path; ~{summaries[0]['bytes'] / 2**20:.0f} MiB over all ranks")
    p(f"tools: ckptctl = Checkpointer.save({{'model': model, 'optimizer': opt}}); DCP* = get_state_dict + "
      "async_save with one DefaultStager kept across saves (reused host copies: DCP at its best, the reference);")
    p("       DCP default = get_state_dict + async_save with its default stager (fresh host copies every save)")
    p(f"rounds: 0 = cold first saves (no prepare() or stage(): load_latest, then training); 1 = prepared first saves (ckptctl prepare(), DCP* stager "
      f"staged once, then 2 training steps); 2..{1 + a.steady} = steady. Tool order rotates every round.")
    p("every tool keeps all its checkpoints (--keep-all), os.sync() after each save, outside the timed sections"
      if a.keep_all else "every tool keeps only its newest checkpoint (deleted, then os.sync(), outside the timed sections)")
    p("figures: max over ranks per round (the slowest rank gates training); ratios: median of per-round")
    p("paired ratios (min, max); DCP stall includes get_state_dict; GB = 1e9 bytes")
    p("durability of 'durable' (save start -> committed / future.result()):")
    for line in GUARANTEES:
        p("  " + line)
    for s in summaries:
        n, nb = s["n"], s["bytes"]
        p()
        pr = s["pressure"]
        noisy = pr is not None and pr > 0.2
        p(f"=== N = {n} ranks ({nb / n / 2**20:.0f} MiB per rank)   CPU pressure over the job: "
          + (f"{pr:.0%}" if pr is not None else "n/a") + f", load avg {s['loadavg'][0]:.1f} -> {s['loadavg'][1]:.1f}"
          + ("  -> NOISY: CPUs oversubscribed" if noisy else ""))
        pc, st, ds = s["prepare_call_s"], s["steps_before_first_save_s"], s["dcp_stage_s"]
        p(f"  warm-up: {s['prepare']}" + (f"; prepare() {pc * 1e3:.1f} ms" if pc is not None else "")
          + (f"; DCP* stage {ds * 1e3:.1f} ms" if ds is not None else "")
          + (f"; 2 training steps {st * 1e3:.0f} ms" if st is not None else ""))
        if s.get("cold_train"):
            p(f"  cold round: load_latest, then {s['cold_train'][1]} training steps in {s['cold_train'][0]:.1f} s, "
              "then the first saves")
        p(f"  order per round: " + " | ".join(",".join(o) for o in s["order"]))
        p(f"  {'':<34}{'ckptctl':>13}{'DCP*':>13}{'DCP default':>13}")
        for label, key, rounds in (("stall, cold first save", "stall_s", 0), ("stall, prepared first save", "stall_s", 1)):
            p(f"  {label:<34}" + "".join(ms(s[f'{t}_{key}'][rounds]) for t in TOOLS))
        p(f"  {'stall, steady (median)':<34}" + "".join(ms(med(s[f'{t}_stall_s'][2:])) for t in TOOLS))
        p(f"  {'  CPU time of the stall, steady':<34}" + "".join(ms(med(s[f'{t}_stall_cpu_s'][2:])) for t in TOOLS))
        p(f"  {'  CPU time of the stall, cold first':<34}" + "".join(ms(s[f'{t}_stall_cpu_s'][0]) for t in TOOLS))
        if s["ck_capture_s"] and None not in s["ck_capture_s"]:
            p(f"  {'  ckptctl capture | copy, steady':<34}{ms(med(s['ck_capture_s'][2:]))} | {med(s['ck_copy_s'][2:]) * 1e3:.1f} ms")
            p(f"  {'  ckptctl capture | copy, cold first':<34}{ms(s['ck_capture_s'][0])} | {s['ck_copy_s'][0] * 1e3:.1f} ms")
        p(f"  {'durable, cold first save':<34}" + "".join(ms(s[f'{t}_durable_s'][0]) for t in TOOLS))
        p(f"  {'durable, saves 1.. (median)':<34}" + "".join(ms(med(s[f'{t}_durable_s'][1:])) for t in TOOLS))
        p(f"  {'  throughput (state / durable)':<34}" + "".join(f"{gbs(nb, med(s[f'{t}_durable_s'][1:])):>13}" for t in TOOLS))
        p(f"  {'slowest rank own write (manifest)':<34}{ms(med(s['ck_write_s'][1:]))}")
        p("  time to durable per round (s), rounds 0.. :")
        for t, label in (("ck", "ckptctl"), ("dcp", "DCP*"), ("dcpd", "DCP default")):
            p(f"    {label:<12}{xs(s[f'{t}_durable_s'])}   stall {xs(s[f'{t}_stall_s'])}")
        p(f"    {'ck / DCP*':<12}{xs([None] + s['per_round']['durable'], '')}   "
          f"growth (median of later half / earlier half of saves 1..): ckptctl {s['ratios']['durable_growth'] or float('nan'):.2f}, "
          f"DCP* {s['dcp_growth'] or float('nan'):.2f}")
        p("    Dirty/Writeback MiB before each ckptctl save: "
          + " ".join(f"{d:.0f}/{w:.0f}" for d, w in s["ck_dirty_mib"]))
        p("    Dirty/Writeback MiB before each DCP* save:    "
          + " ".join(f"{d:.0f}/{w:.0f}" for d, w in s["dcp_dirty_mib"]))
        if "ck_load_s" in s:
            ok = "bitwise equal" if s["load_ok"] else "LOADS DIFFER"
            what = f"re-sharding load {s['load_from']} -> {n} (cold, into the live state)"
            p(f"  {what:<34}{ms(s['ck_load_s'])}{ms(s['dcp_load_s'])}   "
              f"{gbs(nb, s['ck_load_s'])} | {gbs(nb, s['dcp_load_s'])}; shards: {ok}")
        fb = [s.get(f"{t}_file_bytes") for t in TOOLS]
        p(f"  {'on disk':<34}" + "".join(f"{x / 2**20:9.1f} MiB" if x else "      n/a    " for x in fb))
        p(f"  TARGETS (N={n}): median of per-round ratios (min, max); PASS/MISS on the median")
        for k, label, bound in TARGETS:
            v = s["ratios"][k]
            verdict = "n/a" if v is None else ("PASS" if v <= bound else "MISS")
            p(f"    {label:<58} {mmm(s['spread'][k]):<28} <= {bound:<5} {verdict}")
        for k, label in INFO:
            p(f"    (info) {label:<51} {mmm(s['spread'][k])}")
    p()
    p(f"  {'SUMMARY: median ratio (verdict) per N':<62}" + "".join(f"{'N=' + str(s['n']):>15}" for s in summaries))
    for k, label, bound in TARGETS:
        cells = []
        for s in summaries:
            v = s["ratios"][k]
            cells.append(f"{'n/a':>15}" if v is None else f"{v:6.2f} ({'PASS' if v <= bound else 'MISS'})".rjust(15))
        p(f"  {label + ' <= ' + str(bound):<62}" + "".join(cells))
    p()
    p("NOTE: the machine has few cores; with N > cores the ranks and their writer threads share CPUs,")
    p("so stalls and write times at N=4 include waiting for a CPU (see CPU pressure); single samples")
    p("swing 2-3x on a shared VM. Ratios compare tools measured side by side in the same job.")


def print_phases(ns: list[int], a: argparse.Namespace, work: str) -> None:
    """``--phases``: per rank and round, each phase of writing a shard of this N's size."""
    for n in ns:
        nbytes = int(a.size_mib * 2**20 / n) >> 20 << 20
        rounds = 1 + a.steady
        p0, t0 = cpu_pressure_us(), time.perf_counter()
        rows = write_phases(n, nbytes, rounds, work)
        p1 = cpu_pressure_us()
        pr = (p1 - p0) / 1e6 / (time.perf_counter() - t0) if p0 is not None and p1 is not None else None
        print(f"=== N = {n}: {n} processes x {nbytes / 2**20:.0f} MiB, {rounds} saves each, every file kept; "
              f"CPU pressure {pr:.0%}" if pr is not None else "CPU pressure n/a")
        print("  mode    round rank  Dirty/WB MiB   phases (ms)")
        for mode, r, rank, (dirty, wb), t in rows:
            phases = "  ".join(f"{k} {v * 1e3:.0f}" for k, v in t.items())
            print(f"  {mode:<8}{r:>5}{rank:>5}  {dirty:6.0f}/{wb:<6.0f} {phases}")
        for mode in ("plain", "ckptctl"):
            tot = [max(t["total"] for m, rr, _, _, t in rows if m == mode and rr == r) for r in range(rounds)]
            print(f"  {mode:<8} slowest rank per round: [" + " ".join(f"{x:.2f}" for x in tot) + "] s, "
                  f"{n * nbytes / statistics.median(tot) / 1e9:.2f} GB/s (median)")
        print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="multi-rank ckptctl vs DCP benchmark (torchrun, gloo, CPU)")
    ap.add_argument("--size-mib", type=float, default=256, help="total model + AdamW state in MiB (default 256)")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    ap.add_argument("--steady", type=int, default=5,
                    help="steady saves after the prepared first save (default 5; growth needs >= 3)")
    ap.add_argument("--dir", default=None, help="where to write (a temporary directory is made inside)")
    ap.add_argument("--json", action="store_true", help="also dump the summaries as JSON on stdout")
    ap.add_argument("--no-prepare", action="store_true",
                    help="no warm-up for either tool before round 1 (no prepare(), no pre-staged DCP stager)")
    ap.add_argument("--keep-all", action="store_true",
                    help="every tool keeps all its checkpoints (a job that never prunes) instead of only the newest")
    ap.add_argument("--phases", action="store_true",
                    help="instead: where a rank's time to durable goes (hash, write, fsync, rename + directory "
                         "fsync; Dirty/Writeback before each save), plain writer vs ckptctl's, N processes")
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
    if a.phases:
        try:
            print_phases(ns, a, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return 0
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
