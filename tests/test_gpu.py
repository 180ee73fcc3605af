"""The accelerator path: pinned staging, the side copy stream, loads onto the GPU.

Skipped without CUDA (CI has none); run on a GPU host with ``pytest tests/test_gpu.py``.
These check ordering, not speed: that a snapshot sees every kernel queued before ``save()``
and none of the updates made after it returned.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptctl import Checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _job(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(16, 512, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _cpu_copy(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": [v.cpu().clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
    }


def _equal(a: dict, b: dict) -> bool:
    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
        torch.equal(x, y) for x, y in zip(a["optimizer"], b["optimizer"], strict=True)
    )


def test_snapshot_sees_queued_kernels_and_not_later_updates(tmp_path):
    model, opt = _job()
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.prepare({"model": model, "optimizer": opt})
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # queued on the compute stream, likely still running at save()
        expected = _cpu_copy(model, opt)  # synchronises; the values at save time
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)  # queued again, right before save: the snapshot must include it
        expected_with_last = {**expected, "model": {k: v * 3.0 for k, v in expected["model"].items()}}
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        assert ckpt._staging._pinned  # GPU state is staged in page-locked memory
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)  # after save() returned: must not reach the checkpoint
        handle.wait()

    fresh, fresh_opt = _job(seed=1)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.load_latest({"model": fresh, "optimizer": fresh_opt}, prepare=False) == 1
    assert next(fresh.parameters()).is_cuda
    assert _equal(_cpu_copy(fresh, fresh_opt), expected_with_last)


def test_gpu_checkpoint_loads_on_cpu_and_back(tmp_path):
    model, opt = _job()
    want = _cpu_copy(model, opt)
    with Checkpointer(str(tmp_path / "gpu")) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt}).wait()
    torch.manual_seed(2)
    cpu_model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-3)
    with Checkpointer(str(tmp_path / "gpu")) as ckpt:
        assert ckpt.load_latest({"model": cpu_model, "optimizer": cpu_opt}, prepare=False) == 1
    assert _equal(_cpu_copy(cpu_model, cpu_opt), want)
