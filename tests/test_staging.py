"""The GPU path's logic, run on the CPU: host memory we own (map, fault in, page-lock in
chunks, unlock, unmap, fall back), grouping copies by source device, the pinning device, and
the load path's bounce buffers.

Page-locking goes through our own ``Registrar`` interface; here a recording registrar stands
in for ``cudaHostRegister`` (dependency injection of the one CUDA call, nothing of ckptctl is
replaced), so the whole ownership sequence runs without a GPU. ``tests/test_gpu.py`` runs the
same paths against the driver on a GPU host.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptctl.load.bounce import BouncePool
from ckptctl.save.shard_layout import make_layout, view
from ckptctl.save.overlap import hold_steps, overlap_plan, stepped_by_optimizers
from ckptctl.save.staging import HOST, StagingBuffer, group_by_device, pin_device
from ckptctl.state.capture import capture
from ckptctl.state.pinned import HostRegion, split_at

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


class RecordingRegistrar:
    """Keeps the set of registered (pointer, size) ranges, as the driver would; fails the
    ``fail_at``-th register call (0-based) when asked, with a reason like CUDA's."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.live: dict[int, int] = {}
        self.log: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> str | None:
        with self.lock:
            n, self.calls = self.calls, self.calls + 1
            if n == self.fail_at:
                return "cudaHostRegister failed with CUDA error 2"
            assert ptr not in self.live
            self.live[ptr] = nbytes
            self.log.append(("register", ptr, nbytes))
        return None

    def unregister(self, ptr: int) -> str | None:
        with self.lock:
            size = self.live.pop(ptr, None)
            if size is None:
                return "cudaHostUnregister failed with CUDA error 1"  # never registered: a bug of ours
            self.log.append(("unregister", ptr, size))
        return None

    @property
    def locked_bytes(self) -> int:
        return sum(self.live.values())


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


# --- host memory we own --------------------------------------------------------------------


def test_pin_failure_unlocks_what_was_locked_warns_once_and_stays_usable(caplog):
    caplog.set_level(logging.DEBUG, logger="ckptctl")
    regions = []
    for _ in range(2):
        reg = RecordingRegistrar(fail_at=2)
        region = HostRegion(5 * MiB, registrar=reg, chunk=2 * MiB)
        assert not region.pinned and region.pinned_bytes == 0 and region.boundaries == ()
        assert "CUDA error 2" in (region.failure or "")
        assert reg.live == {}  # the two chunks locked before the failure were unlocked
        assert [k for k, *_ in reg.log] == ["register", "register", "unregister", "unregister"]
        region.tensor.fill_(7)  # ordinary memory: still a working buffer
        assert int(region.tensor.sum()) == 7 * 5 * MiB
        regions.append(region)
    said = [r for r in caplog.records if "could not page-lock" in r.getMessage()]
    assert len(said) == 2 and sum(r.levelno == logging.WARNING for r in said) <= 1


def test_region_is_exactly_the_size_locked_in_chunks_and_unlocked_and_unmapped_on_release():
    reg = RecordingRegistrar()
    n = 5 * MiB + 3  # not a power of two, not a multiple of a page: nothing is rounded up
    region = HostRegion(n, registrar=reg, chunk=2 * MiB, fault_in=True)
    base = region.tensor.data_ptr()
    assert region.tensor.numel() == n and region.pinned and region.pinned_bytes == n
    assert [(p - base, s) for _, p, s in reg.log] == [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, MiB + 3)]
    assert region.boundaries == (2 * MiB, 4 * MiB)
    assert reg.locked_bytes == n and _mapped(base)
    region.release()
    assert reg.live == {} and region.pinned_bytes == 0 and not region.pinned
    assert [k for k, *_ in reg.log].count("unregister") == 3
    assert not _mapped(base)  # nobody kept a view: unmapped at once
    region.release()  # idempotent: nothing left to unlock
    assert [k for k, *_ in reg.log].count("unregister") == 3


def test_a_live_view_keeps_the_mapping_until_it_is_dropped():
    region = HostRegion(3 * MiB, registrar=RecordingRegistrar())
    kept = region.tensor[MiB:]
    kept.fill_(1)
    region.release()
    assert _mapped(kept.data_ptr()) and int(kept.sum()) == 2 * MiB  # never read unmapped memory
    addr = kept.data_ptr()
    del kept
    assert not _mapped(addr)


def test_split_at_cuts_a_copy_at_every_registration_boundary_inside_it():
    b = (10, 20, 30)
    assert split_at(0, 10, b) == [(0, 10)]
    assert split_at(5, 25, b) == [(5, 10), (10, 20), (20, 25)]
    assert split_at(10, 20, b) == [(10, 20)]
    assert split_at(31, 40, b) == [(31, 40)]
    assert split_at(3, 4, ()) == [(3, 4)]


# --- which device, which group -------------------------------------------------------------


def test_copies_are_grouped_by_source_device_in_layout_order():
    state = {f"t{i}": torch.full((i + 1,), i, dtype=torch.float32) for i in range(6)}
    layout = make_layout(capture(state, with_rng=False).tensors)
    where = {
        "t0": torch.device("cuda", 1),
        "t1": torch.device("cpu"),
        "t2": torch.device("cuda", 0),
        "t3": torch.device("cuda", 1),
        "t4": torch.device("mps"),  # no side stream for other accelerators: copied synchronously
        "t5": torch.device("cuda", 0),
    }
    groups = group_by_device(layout.slots, where)
    assert {k: [s.name for s in v] for k, v in groups.items()} == {
        1: ["t0", "t3"],
        HOST: ["t1", "t4"],
        0: ["t2", "t5"],
    }
    for slots in groups.values():
        assert [s.begin for s in slots] == sorted(s.begin for s in slots)


def test_pinning_device_follows_the_tensors_then_local_rank_then_the_current_device():
    cuda3, cpu = torch.device("cuda", 3), torch.device("cpu")
    assert pin_device([cpu, cuda3], local_rank="1", device_count=4, current=0) == 3
    # DDP's model.to(local_rank) without set_device: the current device is 0 on every rank.
    assert pin_device([cpu], local_rank="2", device_count=4, current=0) == 2
    assert pin_device([], local_rank="2", device_count=4, current=0) == 2
    assert pin_device([], local_rank="7", device_count=4, current=1) == 1  # no such device
    assert pin_device([], local_rank="x", device_count=4, current=1) == 1
    assert pin_device([], local_rank=None, device_count=4, current=1) == 1


# --- the staging buffer owns its pinned memory ---------------------------------------------


def _pinned_layout(state: dict):
    captured = capture(state, with_rng=False)
    # CPU tensors staged as if they came from a GPU: the pinned path's ownership, without one.
    return dataclasses.replace(make_layout(captured.tensors), needs_pinned=True), captured.tensors


def test_staging_pins_exactly_the_layout_regrows_and_unlocks_everything_on_release():
    regs: list[tuple[int, RecordingRegistrar]] = []

    def registrar_for(device: int) -> RecordingRegistrar:
        regs.append((device, RecordingRegistrar()))
        return regs[-1][1]

    staging = StagingBuffer(registrar_for=registrar_for)
    small = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.arange(777, dtype=torch.int16)}
    layout, tensors = _pinned_layout(small)
    assert layout.nbytes == 4000 + 1554
    buf = staging.snapshot(layout, tensors)
    assert len(regs) == 1 and regs[0][0] == 0
    assert staging.pinned and staging.pinned_bytes == layout.nbytes == regs[0][1].locked_bytes
    for slot in layout.slots:
        assert torch.equal(view(buf, slot), tensors[slot.name].data)
    staging.snapshot(layout, tensors)
    assert len(regs) == 1  # reused: no second pin

    big = {**small, "c": torch.ones(3 * MiB + 1, dtype=torch.uint8)}
    layout2, tensors2 = _pinned_layout(big)
    buf2 = staging.snapshot(layout2, tensors2)
    assert regs[0][1].live == {}  # the old buffer was unlocked before the new one was locked
    assert len(regs) == 2 and regs[1][1].locked_bytes == staging.pinned_bytes == layout2.nbytes
    for slot in layout2.slots:
        assert torch.equal(view(buf2, slot), tensors2[slot.name].data)
    staging.release()
    assert all(r.live == {} for _, r in regs) and staging.pinned_bytes == 0 and not staging.held


def test_staging_falls_back_to_ordinary_memory_when_pinning_fails_and_does_not_retry():
    regs: list[RecordingRegistrar] = []

    def registrar_for(device: int) -> RecordingRegistrar:
        regs.append(RecordingRegistrar(fail_at=0))
        return regs[-1]

    staging = StagingBuffer(registrar_for=registrar_for)
    layout, tensors = _pinned_layout({"w": torch.randn(300, 7), "s": torch.arange(5)})
    for _ in range(2):
        buf = staging.snapshot(layout, tensors)
        for slot in layout.slots:
            assert torch.equal(view(buf, slot), tensors[slot.name].data)
    assert not staging.pinned and staging.pinned_bytes == 0 and staging.held
    assert len(regs) == 1  # the failure is not retried on every save
    staging.release()


def test_a_preparation_released_before_it_finished_still_unlocks_its_buffer():
    regs: list[RecordingRegistrar] = []

    def registrar_for(device: int) -> RecordingRegistrar:
        regs.append(RecordingRegistrar())
        return regs[-1]

    staging = StagingBuffer(registrar_for=registrar_for)
    layout, tensors = _pinned_layout({"w": torch.ones(64 * MiB, dtype=torch.uint8)})
    assert staging.prepare(layout, tensors)
    staging.release()
    deadline = time.monotonic() + 30
    while (not regs or not regs[0].log or regs[0].live) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert regs and regs[0].log and regs[0].live == {}
    assert [k for k, *_ in regs[0].log] == ["register", "unregister"]


def test_prepared_pinned_buffer_is_the_one_the_snapshot_uses():
    reg = RecordingRegistrar()
    staging = StagingBuffer(registrar_for=lambda device: reg)
    layout, tensors = _pinned_layout({"w": torch.randn(1000), "m": torch.randn(10, 10).t()})  # a transposed source
    assert staging.prepare(layout, tensors)
    buf = staging.reserve(layout, tensors)
    assert reg.locked_bytes == layout.nbytes
    assert staging.snapshot(layout, tensors).data_ptr() == buf.data_ptr()
    for slot in layout.slots:
        assert torch.equal(view(buf, slot), tensors[slot.name].data)
    staging.release()
    assert reg.live == {}


# --- the opt-in overlap: which copies may stay in flight --------------------------------------


def test_only_what_an_optimizer_of_the_state_steps_may_be_copied_late():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    frozen = torch.nn.Linear(4, 4)  # in the state, stepped by no optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    state = {"model": model, "frozen": frozen, "optimizer": opt, "extra": {"t": torch.ones(3)}}
    tensors = capture(state, with_rng=False).tensors
    late = stepped_by_optimizers(state, tensors)
    params = {f"model/{k}" for k, _ in model.named_parameters()}
    assert params <= late
    assert any(n.startswith("optimizer/") and "exp_avg" in n for n in late)
    assert not any(n.startswith(("frozen/", "extra/")) for n in late)
    assert not any("running_" in n or "num_batches" in n for n in late)  # forward changes them
    assert late - params <= {n for n in tensors if n.startswith("optimizer/")}
    # Nothing of it is on a GPU here: the overlap defers nothing and holds no optimizer.
    assert overlap_plan(state, tensors) == (frozenset(), [])
    assert stepped_by_optimizers({"model": model}, capture({"model": model}, with_rng=False).tensors) == frozenset()


class CountingFence:
    """A fence (``CopyFence``'s interface) without CUDA events: counts how often a step was held."""

    def __init__(self) -> None:
        self.held = 0

    def hold_streams(self) -> None:
        self.held += 1


def test_the_step_hold_fires_once_and_its_removal_is_left_to_the_caller():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fence = CountingFence()
    handles = hold_steps([opt], fence)
    opt.register_step_pre_hook(lambda *_: None)  # the job's own hook, after ours
    for _ in range(3):  # a hook that removed itself here: "OrderedDict mutated during iteration"
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert fence.held == 1
    for h in handles:
        h.remove()
    opt.step()
    assert fence.held == 1


# --- load bounce buffers -------------------------------------------------------------------


def test_bounce_pool_reuses_a_few_buffers_for_chunked_uploads_and_unlocks_them_on_close():
    reg = RecordingRegistrar()
    pool = BouncePool("cpu", count=2, nbytes=MiB, registrar=reg)
    src = torch.randn(11 * MiB // 8, dtype=torch.float64).reshape(-1, 8)  # 11 MiB: 11 chunks
    dst = torch.empty_like(src)
    pool.upload(src, dst)
    assert torch.equal(dst, src)
    s = pool.stats
    # Copies on the CPU are done when they return: one buffer, reused for every later chunk.
    assert (s.mapped, s.chunks, s.bytes, s.uploads, s.reuses) == (1, 11, 11 * MiB, 1, 10)
    assert pool.pinned_bytes == reg.locked_bytes == MiB

    target = torch.empty(64, 48, dtype=torch.bfloat16).t()  # a non-contiguous target
    host = torch.randn(48, 64).to(torch.bfloat16)
    pool.upload(host, target)
    assert torch.equal(target, host)
    with pytest.raises(ValueError, match="does not fit"):
        pool.upload(torch.zeros(3), torch.zeros(4))

    pool.close()
    assert reg.live == {} and pool.pinned_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.upload(src, dst)


def test_bounce_pool_from_many_threads_never_maps_more_than_count():
    reg = RecordingRegistrar()
    with BouncePool("cpu", count=2, nbytes=256 << 10, registrar=reg) as pool:
        sources = [torch.full((300_000 + i,), float(i)) for i in range(8)]
        targets = [torch.empty_like(t) for t in sources]
        threads = [threading.Thread(target=pool.upload, args=(s, t)) for s, t in zip(sources, targets)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(s, t) for s, t in zip(sources, targets))
        assert pool.stats.mapped <= 2 and len(reg.log) <= 2
    assert reg.live == {}


# --- dtypes a checkpoint cannot hold ------------------------------------------------------


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float8_e4m3fnuz", "float4_e2m1fn_x2"])
def test_unsupported_low_precision_dtypes_are_refused_naming_the_key(tmp_path, name):
    from ckptctl import Checkpointer
    from ckptctl.errors import StateError

    if not hasattr(torch, name):
        pytest.skip(f"this torch has no {name}")
    t = torch.zeros(4, dtype=torch.uint8).view(getattr(torch, name))
    with Checkpointer(str(tmp_path)) as ckpt, pytest.raises(StateError, match="scales") as e:
        ckpt.save(1, {"model": {"scales": t}})
    assert e.value.hint


# --- the GPU smoke script's logic --------------------------------------------------------


def test_gpu_smoke_script_runs_its_logic_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--device", "cpu", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["exit"] == 0 and report["device"] == "cpu"
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("ordering", "dtypes", "corrupt_byte_refused", "pinned_after_close"):
        assert checks[name]["ok"], checks[name]
    assert checks["dtypes"]["count"] >= 10
    # --list names exactly what runs, and the report says which torch, CUDA and kernel ran it
    assert set(checks) == set(_listed_checks(tmp_path))
    assert report["torch"] and "kernel" in report and "cuda" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_gpu_smoke_script_cannot_start_without_cuda(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--device", "cuda", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["exit"] == 3 and "cuda" in report["error"].lower() and report["checks"] == []


def _smoke_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _listed_checks(cwd: Path) -> dict[str, str]:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--list"],
                          capture_output=True, text=True, timeout=120, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}


def test_gpu_smoke_lists_every_check_with_the_item_it_answers(tmp_path):
    listed = _listed_checks(tmp_path)
    for item in range(1, 7):  # every item of the second reading has a check on the GPU
        assert any(f"item {item}:" in line for line in listed.values()), item


def test_gpu_smoke_fails_a_gpu_run_that_never_compared_with_dcp():
    verdict = _smoke_module().stall_verdict
    assert verdict(True, 0.5, 0.05, {"sync_staging": {"error": "RuntimeError: closed"}})["ok"] is False
    assert verdict(True, 0.5, 0.05, {})["ok"] is False
    assert verdict(False, 0.5, 0.05, {"skipped": "cpu"})["ok"] is None
    ok = verdict(True, 0.5, 0.05, {"sync_staging": {"error": "x"}, "async_staging": {"first_s": 2.0, "steady_s": 1.0}})
    assert ok["ok"] is True and ok["overlap_vs_dcp"] == 0.05


def test_views_whose_values_are_not_their_bytes_save_and_load_as_their_values(tmp_path) -> None:
    """A conjugate or negative view (``t.conj()``, ``torch._neg_view``) holds other values
    than its bytes; the snapshot's and the load's memcpys must not copy the raw bytes."""
    from ckptctl import Checkpointer

    z = torch.randn(64, 8, dtype=torch.complex64)
    state = {"model": {"conj": z.conj(), "neg": torch._neg_view(z), "plain": torch.randn(16)}}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state["model"].items()}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state).wait()
        target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
        assert ck.load_latest(target) == 1
    for k, v in expected.items():
        assert torch.equal(target["model"][k], v), k
