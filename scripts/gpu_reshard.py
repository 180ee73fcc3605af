"""Resharding on the GPU for ``scripts/gpu_smoke.py``: two gloo ranks sharing the GPU load a
1-rank checkpoint as ``Shard(0)`` DTensors (1->2), save, load as ``Shard(1)`` (2->2); one
process loads it whole (2->1); a copy with one flipped data byte must not load.

Kept apart from gpu_smoke.py so each file stays small; imported by it, never run alone (the
ranks are spawned processes that import this module by name).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from typing import Any


class ReshardChecks:
    """Mixed into gpu_smoke's ``Smoke`` (``torch``, ``device``, ``quick``, ``root``)."""

    torch: Any
    device: str
    quick: bool
    root: str

    def reshard(self) -> list[dict]:
        import torch.multiprocessing as mp

        from ckptctl import Checkpointer
        from ckptctl.errors import InvalidCheckpoint

        torch = self.torch
        shape = (64, 48) if self.quick else (2048, 1024)
        full = _pattern(torch, shape)
        one, two = os.path.join(self.root, "one"), os.path.join(self.root, "two")
        with Checkpointer(one) as ck:  # the 1-rank source of 1 -> 2
            m = torch.nn.Module()
            m.w = torch.nn.Parameter(full.to(self.device))
            ck.save(1, {"model": m}).wait()
        port = _free_port()
        mp.spawn(_reshard_rank, args=(2, f"tcp://127.0.0.1:{port}", self.root, self.device, shape), nprocs=2, join=True)
        ranks = [json.load(open(os.path.join(self.root, f"rank{r}.json"))) for r in range(2)]
        out = [{"name": f"reshard_{k}", "kind": "data", "ok": all(r[k] for r in ranks)} for k in ("1to2", "2to2_shard0_to_shard1")]
        # 2 -> 1: one process, no process group, the whole tensor on the device
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.zeros(shape, device=self.device))
        with Checkpointer(two) as ck:
            ck.load_latest({"model": m}, prepare=False)
        out.append({"name": "reshard_2to1", "kind": "data", "ok": torch.equal(m.w.detach().cpu(), full)})
        bad = os.path.join(self.root, "bad")
        shutil.copytree(two, bad)
        shard = max((os.path.join(d, f) for d, _, fs in os.walk(bad) for f in fs if f.startswith("rank")), key=os.path.getsize)
        with open(shard, "r+b") as f:  # the last byte: tensor data, never the header
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x01]))
        m.w.data.zero_()
        refused, why = False, "it loaded"
        step_dir = next(d for d in os.listdir(bad) if d.startswith("step-"))
        try:
            with Checkpointer(bad) as ck:
                ck.load(os.path.join(bad, step_dir), {"model": m})
        except InvalidCheckpoint as e:
            refused, why = True, str(e)
        out.append({"name": "corrupt_byte_refused", "kind": "data", "ok": refused, "detail": why[:300], "file": os.path.basename(shard)})
        return out


def _reshard_rank(rank: int, world: int, init: str, root: str, device: str, shape: tuple) -> None:
    """One of two ranks (sharing the GPU): 1 -> 2 as Shard(0), save, 2 -> 2 as Shard(1)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptctl import Checkpointer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        mesh = DeviceMesh(device, list(range(world)))
        full = _pattern(torch, shape)

        def module(dim: int, fill: bool):
            local = full.chunk(world, dim)[rank]
            m = torch.nn.Module()
            data = local.clone() if fill else torch.zeros_like(local)
            m.w = torch.nn.Parameter(DTensor.from_local(data.to(device), mesh, [Shard(dim)], run_check=False))
            return m, local

        res = {}
        m, want = module(0, False)
        with Checkpointer(os.path.join(root, "one")) as ck:
            ck.load_latest({"model": m}, prepare=False)
        res["1to2"] = torch.equal(m.w.to_local().detach().cpu(), want)
        src, _ = module(0, True)
        with Checkpointer(os.path.join(root, "two")) as ck:
            ck.save(1, {"model": src}).wait()
        m, want = module(1, False)
        with Checkpointer(os.path.join(root, "two")) as ck:
            ck.load_latest({"model": m}, prepare=False)
        res["2to2_shard0_to_shard1"] = torch.equal(m.w.to_local().detach().cpu(), want)
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _pattern(torch, shape: tuple):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32) * 1.5 + 0.25).reshape(shape)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
