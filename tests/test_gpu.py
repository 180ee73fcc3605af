"""The accelerator path against a real driver: ordering of the device-to-host copies, pinned
memory we own, several GPUs, the opt-in overlap, and loads through the bounce buffers.

Skipped without CUDA (the development machines and CI have none); run on a GPU host with
``pytest tests/test_gpu.py`` (and ``scripts/gpu_smoke.py`` for the figures). The CPU-run half
of this logic is ``tests/test_staging.py``.

Each ordering test is built so that deleting the line it guards makes it fail: the producer
kernels are queued behind a ``torch.cuda._sleep`` spin of ~200 ms, so a snapshot that does not
wait for the compute stream copies the old values; the state is >= 256 MiB, so copies take
long enough that a snapshot that returns before they land shows torn data; the tensors are
changed immediately after ``save()`` returns; and two saves reuse one buffer, so a second
snapshot that copies nothing shows the first one's values.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from ckptctl import Checkpointer
from ckptctl.load.bounce import BouncePool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host (scripts/gpu_smoke.py too)"
)

MiB = 1 << 20
SPIN_MS = 200


@functools.lru_cache(maxsize=None)
def _cycles_per_ms(device: int) -> float:
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def _spin(device: int = 0, ms: float = SPIN_MS) -> None:
    """Keep ``device``'s current stream busy for about ``ms``: kernels queued after this run
    only then, long after the host has moved on."""
    with torch.cuda.device(device):
        torch.cuda._sleep(int(_cycles_per_ms(device) * ms))


class Big(nn.Module):
    """``pieces`` parameters of ``mib`` MiB each (float32), on ``device``."""

    def __init__(self, pieces: int = 4, mib: int = 64, device: "str | torch.device" = "cuda") -> None:
        super().__init__()
        n = mib * MiB // 4
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(n, device=device)) for _ in range(pieces))

    @torch.no_grad()
    def fill(self, base: float) -> None:
        for i, p in enumerate(self.w):
            p.fill_(base + i)  # distinct per parameter: a copy into the wrong slot shows


def _values(path: str, pieces: int, mib: int) -> list[torch.Tensor]:
    """Each parameter's set of distinct values in the checkpoint, loaded on the CPU."""
    model = Big(pieces, mib, device="cpu")
    with Checkpointer(os.path.dirname(path)) as ckpt:
        ckpt.load(path, {"model": model}, strict=False)  # the model only, whatever else was saved
    return [torch.unique(p.detach()) for p in model.w]


def test_snapshot_waits_for_queued_kernels_and_ignores_writes_after_return(tmp_path):
    model = Big()  # 256 MiB
    state = {"model": model}
    with Checkpointer(str(tmp_path)) as ckpt:
        model.fill(1.0)
        assert ckpt.prepare(state)
        paths = []
        for step, value in ((1, 10.0), (2, 20.0)):
            _spin()
            model.fill(value)  # queued behind the spin: the snapshot must include it
            handle = ckpt.save(step, state)
            model.fill(-1.0)  # right after save() returned: must not reach the checkpoint
            paths.append(handle.wait())
        shard = 256 * MiB
        assert ckpt.staging_pinned and ckpt.staging_pinned_bytes == shard  # exactly, no rounding up
    assert ckpt.staging_pinned_bytes == 0  # unlocked by close()
    for path, value in zip(paths, (10.0, 20.0)):
        got = _values(path, 4, 64)
        assert [g.tolist() for g in got] == [[value + i] for i in range(4)]


def test_staging_does_not_use_torchs_pinned_cache(tmp_path):
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if hasattr(torch.cuda, "host_memory_stats") else 0
    model = Big(pieces=2, mib=128)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"model": model}).wait()
        assert ckpt.staging_pinned_bytes == 256 * MiB
        if hasattr(torch.cuda, "host_memory_stats"):
            held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
            assert held - before < 64 * MiB  # our own registration, not a power-of-two cached block
    assert ckpt.staging_pinned_bytes == 0


def test_mixed_dtypes_non_contiguous_and_cpu_state_round_trip_bitwise(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    extra = {
        "bf16": torch.randn(1000, 33, device="cuda", generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, 5, device="cuda", generator=g).half(),
        "f8a": torch.randn(4096, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(4096, device="cuda", generator=g).to(torch.float8_e5m2),
        "t": torch.randn(300, 200, device="cuda", generator=g).t(),  # non-contiguous
        "strided": torch.arange(10_000, device="cuda")[::3],  # non-contiguous, int64
        "mask": torch.rand(999, device="cuda", generator=g) > 0.5,
        "cpu": torch.randn(1234),  # mixed with host tensors
        "scalar": torch.tensor(3.5, device="cuda"),
        "empty": torch.empty(0, 4, device="cuda"),
    }
    want = {k: v.cpu().clone() for k, v in extra.items()}
    with Checkpointer(str(tmp_path)) as ckpt:
        path = ckpt.save(1, {"extra": extra}).wait()
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.load(path, {"extra": back})
    for k in want:
        assert back[k].dtype == want[k].dtype and back[k].shape == want[k].shape, k
        assert torch.equal(_bits(back[k]), _bits(want[k])), k


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (float8 has no comparison kernels on every torch)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_gpu_other_than_the_current_one_are_waited_for(tmp_path):
    torch.cuda.set_device(0)  # the DDP pattern: model.to(local_rank) without set_device
    model = Big(pieces=4, mib=64, device="cuda:1")
    other = Big(pieces=2, mib=32, device="cuda:0")
    state = {"model": model, "other": {"x": other.w[0], "y": other.w[1]}}
    with Checkpointer(str(tmp_path)) as ckpt:
        for step, value in ((1, 5.0), (2, 7.0)):
            _spin(device=1)
            _spin(device=0, ms=50)
            model.fill(value)  # on cuda:1's current stream, behind its spin
            other.fill(value * 10)
            handle = ckpt.save(step, state)
            model.fill(-1.0)
            other.fill(-1.0)
            path = handle.wait()
            got = _values(path, 4, 64)
            assert [x.tolist() for x in got] == [[value + i] for i in range(4)]
            back = {"x": torch.zeros(32 * MiB // 4), "y": torch.zeros(32 * MiB // 4)}
            with Checkpointer(str(tmp_path)) as reader:
                reader.load(path, {"other": back}, strict=False)
            assert [torch.unique(back[k]).tolist() for k in ("x", "y")] == [[value * 10], [value * 10 + 1]]


def test_overlap_copies_finish_before_the_next_step_and_buffers_are_copied_at_once(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(64, 4096, device="cuda")

    def train_step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    train_step()
    state = {"model": model, "optimizer": opt}
    with Checkpointer(str(tmp_path), overlap_copies=True) as ckpt:
        for step in (1, 2):
            _spin()
            train_step()  # queued behind the spin
            torch.cuda.synchronize()
            want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            _spin()  # the copies now start only after this
            handle = ckpt.save(step, state)
            train_step()  # forward changes BatchNorm's statistics, step() the weights
            path = handle.wait()
            cpu = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 4096))
            with Checkpointer(str(tmp_path)) as reader:
                reader.load(path, {"model": cpu}, strict=False)
            got = cpu.state_dict()
            for k in want:
                assert torch.equal(got[k], want[k]), k


def test_bounce_pool_orders_uploads_on_the_callers_stream_and_unlocks_after():
    stream = torch.cuda.Stream()
    host = torch.randn(300 * MiB // 4)
    target = torch.empty_like(host, device="cuda")
    with torch.cuda.stream(stream):
        _spin()
        target.fill_(0)  # queued behind the spin on the caller's (non-default) stream
        pool = BouncePool(torch.device("cuda", 0), count=2, nbytes=64 * MiB)
        with ThreadPoolExecutor(2) as ex:  # uploads from other threads, as the reader's I/O threads
            ex.submit(pool.upload, host, target).result()
        assert pool.pinned_bytes <= 2 * 64 * MiB and pool.stats.mapped <= 2
        target.add_(1)  # after the upload, on the same stream
    pool.close()
    assert pool.pinned_bytes == 0
    torch.cuda.synchronize()
    assert torch.equal(target.cpu(), host + 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dtensor_state_round_trips_onto_cuda(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
        # from_local: no collective (gloo has no scatter of CUDA tensors); one rank holds all.
        src, dst = nn.Module(), nn.Module()
        src.w = nn.Parameter(DTensor.from_local(full.clone(), mesh, [Shard(1)], run_check=False))
        dst.w = nn.Parameter(DTensor.from_local(torch.zeros_like(full), mesh, [Shard(0)], run_check=False))
        with Checkpointer(str(tmp_path)) as ckpt:
            path = ckpt.save(1, {"model": src}).wait()
            ckpt.load(path, {"model": dst})
        assert torch.equal(_bits(dst.w.to_local().detach().cpu()), _bits(full.cpu()))
    finally:
        dist.destroy_process_group()


def test_prepare_pins_in_the_background_without_stalling_kernel_launches(tmp_path):
    model = Big(pieces=4, mib=256)  # 1 GiB: more than one registration chunk
    with Checkpointer(str(tmp_path)) as ckpt:
        model.fill(1.0)
        torch.cuda.synchronize()
        assert ckpt.prepare({"model": model})
        worst, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < 3.0:  # the training loop meanwhile: launches and syncs
            t = time.perf_counter()
            model.w[0].add_(0)
            torch.cuda.synchronize()
            worst = max(worst, time.perf_counter() - t)
        ckpt.save(1, {"model": model}).wait()
        assert ckpt.staging_pinned_bytes == 1 << 30
        # One chunk's registration at most (the old single cudaHostAlloc of 2 GiB held the
        # driver lock for the whole pin).
        assert worst < 0.5, worst
    assert ckpt.staging_pinned_bytes == 0
