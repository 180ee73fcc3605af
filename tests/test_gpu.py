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
from ckptctl.save.shard_layout import make_layout, view
from ckptctl.save.overlap import CopyFence
from ckptctl.save.staging import StagingBuffer
from ckptctl.state import pinned
from ckptctl.state.capture import capture
from ckptctl.state.pinned import CudaRegistrar, HostRegion, held_bytes, host_wait_event

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


def test_prepare_pins_in_the_background_without_stalling_kernel_launches(tmp_path, monkeypatch):
    # 1 GiB at 256 MiB per registration: four chunks (the old test pinned exactly one chunk of
    # 1 GiB). The chunk size is read when the buffer is mapped: the Checkpointer uses this one.
    monkeypatch.setattr(pinned, "REGISTER_CHUNK", 256 * MiB)
    model = Big(pieces=4, mib=256)
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


# --- the second reading: each item's check against the driver ---------------------------------
# (``scripts/gpu_smoke.py --list`` names every check and its item; the CPU halves are
# tests/test_pinned_memory.py, tests/test_copy_fence.py and tests/test_staging_alignment.py.)


class BadFlagsRegistrar(CudaRegistrar):
    """A real ``cudaHostRegister`` that fails: flags the runtime refuses (cudaErrorInvalidValue).
    The error it leaves is the runtime's last error of the thread that called it."""

    def register(self, ptr: int, nbytes: int) -> str | None:
        with torch.cuda.device(self.device):
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0x80))
        return None if code == 0 else f"cudaHostRegister failed with CUDA error {code}"


def _odd_state(device: str = "cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    return {
        "bf16": torch.randn(3 * MiB // 2 + 7, device=device, generator=g).to(torch.bfloat16),  # odd bytes
        "f32": torch.randn(1_000_003, device=device, generator=g),
        "i64": torch.randint(-(1 << 40), 1 << 40, (777_777,), device=device, generator=g),
        "scalar": torch.tensor(1.25, device=device),
        "empty": torch.empty(0, 3, device=device),
        "t": torch.randn(1031, 517, device=device, generator=g).t(),  # non-contiguous
        "strided": torch.arange(3_000_001, device=device)[::7],
    }


def test_item1_a_failed_registration_leaves_no_error_for_the_next_launch_or_transposed_save():
    # The hazard itself, on a thread of its own: the same failing call made inline.
    def inline() -> str | None:
        t = torch.empty(MiB, dtype=torch.uint8).contiguous()
        BadFlagsRegistrar(0).register(t.data_ptr(), t.numel())
        try:
            torch.ones(4, device="cuda").add_(1)
            torch.cuda.synchronize()
        except RuntimeError as e:
            return str(e)
        return None

    with ThreadPoolExecutor(1) as ex:
        leaked = ex.submit(inline).result()
    if leaked is None:
        import warnings

        warnings.warn("this torch clears the error of a failed cudaHostRegister itself; the helper thread is belt and braces")
    staging = StagingBuffer(registrar_for=BadFlagsRegistrar)  # the pin fails, the save goes on unpinned
    state = {"t": torch.randn(512, 384, device="cuda").t(), "w": torch.randn(1000, device="cuda")}
    tensors = capture({"extra": state}, with_rng=False).tensors
    layout = make_layout(tensors)
    buf = staging.snapshot(layout, tensors)  # .contiguous() of the transposed tensor: a launch
    assert not staging.pinned and staging.held
    torch.ones(4, device="cuda").add_(1)  # the training's next forward: must not raise
    torch.cuda.synchronize()
    for slot in layout.slots:
        assert torch.equal(view(buf, slot).cpu(), tensors[slot.name].data.cpu()), slot.name
    staging.release()


def test_item2_a_roll_back_right_after_an_overlapped_save_does_not_tear_it(tmp_path):
    model = Big(pieces=4, mib=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # its params are deferred
    for p in model.w:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = {"model": model, "optimizer": opt}
    with Checkpointer(str(tmp_path), overlap_copies=True) as ckpt:
        model.fill(1.0)
        first = ckpt.save(1, state).wait()
        model.fill(2.0)
        _spin(ms=1000)  # the deferred copies start only after this
        handle = ckpt.save(2, state)
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):  # the roll-back's writes are not queued behind the spin:
            ckpt.load(first, state)  # without the settle they land before the copies read
        torch.cuda.synchronize()
        second = handle.wait()
    assert [g.tolist() for g in _values(second, 4, 64)] == [[2.0 + i] for i in range(4)]
    assert [torch.unique(p.detach()).tolist() for p in model.w] == [[1.0 + i] for i in range(4)]


def test_item3_a_dropped_region_is_unregistered_before_its_memory_goes():
    region = HostRegion(64 * MiB, registrar=CudaRegistrar(0))
    assert region.pinned
    keep = region.tensor[:]  # keeps the mapping, so the same address can be registered again
    ptr, before = keep.data_ptr(), held_bytes()
    del region
    import gc

    gc.collect()
    assert before - held_bytes() == 64 * MiB
    rt = torch.cuda.cudart()
    code = int(rt.cudaHostRegister(ptr, 64 * MiB, 1))  # 712 (already registered) if it leaked
    assert code == 0, code
    assert int(rt.cudaHostUnregister(ptr)) == 0


def test_item4_pinned_staging_is_not_inherited_by_a_forked_child():
    region = HostRegion(64 * MiB, registrar=CudaRegistrar(0), fault_in=True)
    assert region.pinned
    addr = region.tensor.data_ptr()
    pid = os.fork()
    if pid == 0:  # no CUDA here: only whether the pages are mapped at all
        with open("/proc/self/maps") as f:
            inherited = any(int(a, 16) <= addr < int(b, 16) for a, b in (ln.split()[0].split("-") for ln in f))
        os._exit(3 if inherited else 0)
    _, status = os.waitpid(pid, 0)
    region.release()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_item5_the_writer_sleeps_while_it_waits_for_deferred_copies():
    import threading

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _spin(ms=1000)
    event = host_wait_event()
    event.record(stream)
    fence = CopyFence({0: event})
    used: dict[str, float] = {}

    def writer() -> None:  # as the writer thread does before it hashes
        cpu, wall = time.thread_time(), time.perf_counter()
        fence.synchronize()
        used["cpu"], used["wall"] = time.thread_time() - cpu, time.perf_counter() - wall

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    # Spinning burns the whole wait (ratio ~1); a blocking event sleeps (ratio ~0).
    assert used["wall"] > 0.3 and used["cpu"] < 0.25 * used["wall"], used


def test_item6_odd_tensors_straddling_registration_chunks_round_trip_onto_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(pinned, "REGISTER_CHUNK", MiB)  # many chunks; slots straddle them
    held = held_bytes()
    src = _odd_state()
    want = {k: v.cpu().clone() for k, v in src.items()}
    with Checkpointer(str(tmp_path)) as ckpt:
        handle = ckpt.save(1, {"extra": src})
        _spin()
        for v in src.values():  # a long kernel, then writes, right after save() returned
            v.zero_()
        path = handle.wait()
        assert ckpt.staging_pinned
        back = {k: torch.full_like(v, 7) for k, v in src.items()}  # GPU targets
        back["t"] = torch.full((517, 1031), 7.0, device="cuda").t()  # non-contiguous GPU target
        ckpt.load(path, {"extra": back})
        torch.cuda.synchronize()
    for k in want:
        assert back[k].device.type == "cuda" and torch.equal(_bits(back[k].cpu()), _bits(want[k])), k
    assert held_bytes() == held  # staging closed, bounce pool closed


def test_item6_gpu_slots_are_aligned_in_the_pinned_buffer():
    from ckptctl.settings import STAGING_ALIGN

    tensors = capture({"extra": _odd_state()}, with_rng=False).tensors
    layout = make_layout(tensors)
    staging = StagingBuffer()
    buf = staging.snapshot(layout, tensors)
    assert staging.pinned
    for slot in layout.slots:
        if slot.end > slot.begin:
            assert view(buf, slot).data_ptr() % STAGING_ALIGN == 0, slot.name
    staging.release()


def test_a_save_under_a_non_default_stream_waits_for_that_stream(tmp_path):
    model = Big()
    torch.cuda.synchronize()  # its zeros were written on the default stream
    s = torch.cuda.Stream()
    with Checkpointer(str(tmp_path)) as ckpt, torch.cuda.stream(s):
        _spin()  # on s
        model.fill(3.0)  # on s, behind the spin: must be in the snapshot
        handle = ckpt.save(1, {"model": model})
        model.fill(-1.0)
        path = handle.wait()
    assert [g.tolist() for g in _values(path, 4, 64)] == [[3.0 + i] for i in range(4)]


def test_bounce_pool_with_chunks_smaller_than_its_buffers_uploads_bitwise():
    host = torch.randint(0, 255, (300 * MiB + 5,), dtype=torch.uint8)
    target = torch.empty_like(host, device="cuda")
    with BouncePool(torch.device("cuda", 0), count=2, nbytes=64 * MiB, register_chunk=16 * MiB) as pool:
        pool.upload(host, target)
        assert pool.stats.pinned_failures == []
    torch.cuda.synchronize()
    assert torch.equal(target.cpu(), host)
