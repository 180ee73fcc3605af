"""One rank of the DCP integration's job (tests/test_integration_dcp.py): a real gloo group,
real ``dcp.save``/``dcp.async_save``/``dcp.load`` through ``ckptctl.integrations.dcp``.

argv: rank, world size, port, out (the checkpoint root; results in out/../rankR.json).

1. ``dcp.save`` of step-1, ``dcp.async_save`` of step-2 (a model and its Adam state, sharded
   by rank, and a train_state), then ``dcp.load`` of step-2 through the Reader into fresh
   tensors, compared with what was saved;
2. waits for the test to flip a bit in step-2 (``out/../flipped`` appears), loads step-2
   again: every rank must refuse, and the state it loads into must be unchanged;
3. saves step-3, and rank 0 SIGKILLs itself after the seal is written and before DCP's
   ``.metadata`` would commit it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptctl.integrations.dcp import Reader, Writer


def state(rank: int, seed: int) -> dict:
    """Each rank holds its own rows of the model (as a sharded job's would) and a train_state."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return {"model": {f"layer.{rank}.weight": torch.randn(64, 32, generator=g)},
            "optimizer": {f"state.{rank}.exp_avg": torch.randn(64, 32, generator=g)},
            "train_state": {"step": seed}}


def zeros_like(s: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
            "optimizer": {k: torch.zeros_like(v) for k, v in s["optimizer"].items()},
            "train_state": {"step": -1}}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[g][k], b[g][k]) for g in ("model", "optimizer") for k in a[g]) \
        and a["train_state"] == b["train_state"]


def main() -> None:
    warnings.filterwarnings("ignore")
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    result: dict = {}
    dcp.save(state(rank, 1), storage_writer=Writer(os.path.join(out, "step-1")))
    dcp.async_save(state(rank, 2), storage_writer=Writer(os.path.join(out, "step-2"))).result()
    loaded = zeros_like(state(rank, 2))
    dcp.load(loaded, storage_reader=Reader(os.path.join(out, "step-2")))
    result["loaded_equal"] = same(loaded, state(rank, 2))

    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "..", "saved"), "w"):
            pass
    while not os.path.exists(os.path.join(out, "..", "flipped")):
        time.sleep(0.05)
    target = zeros_like(state(rank, 2))
    before = zeros_like(state(rank, 2))
    try:
        dcp.load(target, storage_reader=Reader(os.path.join(out, "step-2")))
        result["refused"] = None
    except CheckpointException as e:  # DCP wraps every rank's error, the Reader's InvalidCheckpoint here
        result["refused"] = str(e) + "".join(str(f) for f in e.failures.values())
    result["unchanged"] = same(target, before)
    with open(os.path.join(out, "..", f"rank{rank}.json"), "w") as f:
        json.dump(result, f)

    writer = Writer(os.path.join(out, "step-3"))
    if rank == 0:
        commit = writer.fs.storage.write_if_absent

        def dies_before_metadata(key: str, data: bytes) -> bool:
            if key == ".metadata":  # the seal is written; DCP's commit file is next
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(key, data)

        writer.fs.storage.write_if_absent = dies_before_metadata  # type: ignore[method-assign]
    dcp.save(state(rank, 3), storage_writer=writer)


if __name__ == "__main__":
    main()
