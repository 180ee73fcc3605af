#!/usr/bin/env python
"""What each ``ckptctl.integrations`` module costs the stack's own save, measured in one run.

    .venv/bin/python scripts/bench_integrations.py [--size-mib 96] [--repeat 7] [--only dcp,lightning,...]
                                                   [--dir PATH] [--json PATH]

For each stack, the same save of the same state with and without the integration, alternating
(base, ours, ours, base, ...) so that load on the machine falls on both; every figure is the
median of ``--repeat`` pairs after one warm-up pair, and each ratio (ours / base) is the median
of the pairs' own ratios, with their range: on a shared machine the load drifts between pairs
far more than within one. Three figures per save:

  stall    how long the training thread is blocked: the save call (``dcp.async_save`` and the
           asynchronous Lightning plugins: until they hand the write to their thread)
  stall CPU  the CPU time the training thread spends in that call (``time.thread_time``): what an
           integration adds to the training thread's own work, which time on a shared
           machine's clock buries under waiting for a core
  durable  from the save call to the checkpoint durable on disk and, with the integration,
           sealed: both arms end with an fsync of every file the save wrote and of its
           directory (DCP fsyncs its files but no directory; Lightning, the Trainer and
           accelerate fsync nothing; the integrations fsync all, so theirs is a no-op), and
           with the integration the wait for its background seal is included

  dcp         ``dcp.save`` (FileSystemWriter, sync_files=True) vs ``Writer``
  dcp-async   ``dcp.async_save`` (FileSystemWriter) vs ``Writer``, until the future is done
  dcp-tap     ``dcp.save`` through ``Writer`` hashing every piece on the saving thread (as it did
              before) vs ``Writer`` as it is (large pieces hashed on a helper during their write)
  lightning   ``TorchCheckpointIO.save_checkpoint`` vs ``CheckpointIO()``
  lightning-async  ``AsyncCheckpointIO(TorchCheckpointIO())`` vs ``CheckpointIO(asynchronous=True)``
  trainer     ``Trainer._save_checkpoint`` + ``on_save`` callbacks, without and with ``SealCallback``
              (TRL's trainers save through the same method)
  accelerate  ``Accelerator.save_state`` without and with ``seal_saves``

The state is about ``--size-mib`` of fp32 tensors (DCP, Lightning: one flat dict of a model's
and its Adam state's shapes; Trainer and accelerate: a GPT-2 from a config of about that size
with AdamW state). Targets: durable <= 1.10x, stall <= 1.05x. The machine's load
average is printed before and after: on a shared machine the ratios move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import files_under  # noqa: E402

Timing = tuple[float, float, float]  # (stall, durable, stall CPU) in seconds


class Clock:
    """One save's clocks: wall time from the call, and the calling thread's CPU time."""

    def __init__(self) -> None:
        self.t0, self.cpu0 = time.perf_counter(), time.thread_time()
        self.stall = self.stall_cpu = 0.0

    def stalled(self) -> None:
        """The training thread has its control back."""
        self.stall, self.stall_cpu = time.perf_counter() - self.t0, time.thread_time() - self.cpu0

    def done(self) -> Timing:
        return self.stall, time.perf_counter() - self.t0, self.stall_cpu


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (a file or directory), then the directories."""
    targets = [path] if os.path.isfile(path) else files_under(path)
    for f in targets:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    d = path if os.path.isdir(path) else os.path.dirname(path)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flat_state(size_mib: int) -> dict[str, torch.Tensor]:
    """A model's and its Adam moments' tensors: ``size_mib`` in all, in 24 tensors."""
    g = torch.Generator().manual_seed(0)
    per = (size_mib << 20) // 4 // 24
    cols = 1024
    return {f"{part}.layer{i}": torch.randn(per // cols, cols, generator=g)
            for part in ("model", "exp_avg", "exp_avg_sq") for i in range(8)}


# --- the stacks: each returns (base, ours) savers of one checkpoint into a fresh path ---------


def dcp_pair(state: dict[str, torch.Tensor], asynchronous: bool) -> tuple[Callable[[str], Timing], Callable[[str], Timing]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptctl.integrations.dcp import Writer

    def run(path: str, writer: Any) -> Timing:
        clock = Clock()
        if asynchronous:
            fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
            clock.stalled()
            fut.result()
        else:
            dcp.save(state, storage_writer=writer, no_dist=True)
            clock.stalled()
        fsync_tree(path)
        return clock.done()

    return (lambda p: run(p, FileSystemWriter(p, sync_files=True)), lambda p: run(p, Writer(p)))


def dcp_tap_pair(state: dict[str, torch.Tensor]) -> tuple[Callable[[str], Timing], Callable[[str], Timing]]:
    from ckptctl.integrations import stream

    _base, ours = dcp_pair(state, asynchronous=False)
    beside = stream.TAP_BESIDE

    def inline(path: str) -> Timing:
        stream.TAP_BESIDE = 1 << 62  # no piece is that large: every one hashed on the saving thread
        try:
            return ours(path)
        finally:
            stream.TAP_BESIDE = beside

    return inline, ours


def lightning_pair(state: dict[str, torch.Tensor], asynchronous: bool) -> tuple[Callable[[str], Timing], Callable[[str], Timing]]:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    from ckptctl.integrations.lightning import CheckpointIO

    checkpoint = {"state_dict": state, "epoch": 0, "global_step": 100, "optimizer_states": [{"param_groups": []}]}

    def run(path: str, io: Any) -> Timing:
        os.makedirs(path)
        target = os.path.join(path, "epoch=0-step=100.ckpt")
        clock = Clock()
        io.save_checkpoint(checkpoint, target)
        clock.stalled()
        io.teardown()  # waits for an asynchronous write
        fsync_tree(target)
        return clock.done()

    def base(path: str) -> Timing:
        return run(path, AsyncCheckpointIO(TorchCheckpointIO()) if asynchronous else TorchCheckpointIO())

    return base, lambda p: run(p, CheckpointIO(asynchronous=asynchronous))


def gpt2(size_mib: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # Weights + 2 Adam moments = 3x the parameters: about size_mib on disk.
    layers = max(1, size_mib // 3 * (1 << 20) // 4 // (12 * 256 * 256))
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=256, n_head=4, vocab_size=4096, n_positions=64))


def trainer_pair(size_mib: int, base_dir: str) -> tuple[Callable[[str], Timing], Callable[[str], Timing]]:
    from transformers import Trainer, TrainingArguments

    from ckptctl.integrations.trainer import SealCallback

    data = [{"input_ids": torch.randint(0, 4096, (16,)), "labels": torch.randint(0, 4096, (16,))} for _ in range(4)]

    def build(out: str, callbacks: list) -> Any:
        args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                 disable_tqdm=True, save_strategy="no", logging_steps=100)
        t = Trainer(model=gpt2(size_mib), args=args, train_dataset=data, callbacks=callbacks)
        t.train()  # one step: the optimizer has its state
        return t

    plain = build(os.path.join(base_dir, "trainer-base"), [])
    sealing = SealCallback()
    sealed = build(os.path.join(base_dir, "trainer-ours"), [sealing])
    counter = {"step": 1}

    def run(path: str, t: Any, wait: Callable[[], None]) -> Timing:
        t.args.output_dir = path
        counter["step"] += 1
        t.state.global_step = counter["step"]
        clock = Clock()
        t._save_checkpoint(t.model, trial=None)
        t.control = t.callback_handler.on_save(t.args, t.state, t.control)
        clock.stalled()
        wait()
        fsync_tree(os.path.join(path, f"checkpoint-{counter['step']}"))
        return clock.done()

    return (lambda p: run(p, plain, lambda: None), lambda p: run(p, sealed, sealing.sealer.wait))


def accelerate_pair(size_mib: int) -> tuple[Callable[[str], Timing], Callable[[str], Timing]]:
    from accelerate import Accelerator

    from ckptctl.integrations.accelerate import seal_saves

    def build() -> Any:
        acc = Accelerator(cpu=True)
        model = gpt2(size_mib)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        model(torch.randint(0, 4096, (2, 16)), labels=torch.randint(0, 4096, (2, 16))).loss.backward()
        opt.step()
        return acc

    plain = build()
    sealed = build()
    sealing = seal_saves(sealed)

    def run(path: str, acc: Any, wait: Callable[[], None]) -> Timing:
        target = os.path.join(path, "checkpoint_1")
        clock = Clock()
        acc.save_state(target)
        clock.stalled()
        wait()
        fsync_tree(target)
        return clock.done()

    return (lambda p: run(p, plain, lambda: None), lambda p: run(p, sealed, sealing.sealer.wait))


# --- measuring ----------------------------------------------------------------------------------


def measure(name: str, base: Callable[[str], Timing], ours: Callable[[str], Timing], repeat: int,
            where: str) -> dict[str, Any]:
    samples: dict[str, list[Timing]] = {"base": [], "ours": []}
    for i in range(repeat + 1):  # pair 0 warms both up and is not counted
        order = [("base", base), ("ours", ours)] if i % 2 == 0 else [("ours", ours), ("base", base)]
        for arm, fn in order:
            path = os.path.join(where, f"{name}-{arm}-{i}")
            got = fn(path)
            if i:
                samples[arm].append(got)
            shutil.rmtree(path, ignore_errors=True)
    med = {arm: tuple(statistics.median(t[i] for t in v) for i in range(3)) for arm, v in samples.items()}
    # Each ratio is the median of the pairs' own ratios (ours / base of one pair, measured back to
    # back): on a shared machine the load drifts between pairs far more than within one.
    ratios = [[o[i] / b[i] for b, o in zip(samples["base"], samples["ours"])] for i in range(3)]
    row: dict[str, Any] = {"stack": name}
    for i, what in enumerate(("stall", "durable", "stall_cpu")):
        row |= {f"base_{what}_s": med["base"][i], f"ours_{what}_s": med["ours"][i],
                f"{what}_ratio": statistics.median(ratios[i]), f"{what}_ratio_range": (min(ratios[i]), max(ratios[i]))}

    def shown(what: str, label: str) -> str:
        low, high = row[f"{what}_ratio_range"]
        return (f"{label} {row[f'base_{what}_s'] * 1e3:7.1f} -> {row[f'ours_{what}_s'] * 1e3:7.1f} ms "
                f"({row[f'{what}_ratio']:.3f}x, {low:.2f}-{high:.2f})")

    print(f"{name:16s} {shown('stall', 'stall')}   {shown('stall_cpu', 'stall CPU')}   {shown('durable', 'durable')}",
          flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=96)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--only", default="dcp,dcp-async,lightning,lightning-async,trainer,accelerate")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)  # DCP and transformers narrate every save
    where = tempfile.mkdtemp(prefix="ckptctl-bench-integrations-", dir=a.dir)
    print(f"load average before: {os.getloadavg()}; {a.size_mib} MiB per checkpoint; median of {a.repeat} pairs; "
          f"writing under {where}", flush=True)
    rows = []
    state = flat_state(a.size_mib)
    wanted = a.only.split(",")
    try:
        for name in wanted:
            if name in ("dcp", "dcp-async"):
                pair = dcp_pair(state, name == "dcp-async")
            elif name == "dcp-tap":
                pair = dcp_tap_pair(state)
            elif name in ("lightning", "lightning-async"):
                pair = lightning_pair(state, name == "lightning-async")
            elif name == "trainer":
                pair = trainer_pair(a.size_mib, where)
            elif name == "accelerate":
                pair = accelerate_pair(a.size_mib)
            else:
                raise SystemExit(f"unknown stack {name!r}")
            rows.append(measure(name, *pair, a.repeat, where))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size_mib": a.size_mib, "repeat": a.repeat, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
