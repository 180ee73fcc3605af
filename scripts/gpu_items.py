"""The checks of ``scripts/gpu_smoke.py`` that answer the second reading of the GPU path, one
per item (``ITEMS``), run against the driver. Each returns the script's result entries; on
the CPU each reports ``"skipped"`` (their CPU halves are in the test suite:
tests/test_pinned_memory.py, tests/test_copy_fence.py, tests/test_staging_alignment.py).

Kept apart from gpu_smoke.py so each file stays small; imported by it, never run alone.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

MiB = 1 << 20

# Every entry name a check can produce, with the item of the second reading it answers
# (``gpu_smoke.py --list`` prints them with the script's older checks).
ITEMS: dict[str, str] = {
    "pin_failure_then_launch": "item 1: a failed cudaHostRegister leaves no error for the next launch or a transposed save",
    "rollback_after_overlapped_save": "item 2: a load right after a save with overlap_copies does not tear that checkpoint",
    "dropped_region_unregistered": "item 3: a region dropped without release() is unregistered before it is unmapped",
    "fork_child_has_no_pinned_pages": "item 4: MADV_DONTFORK: a fork()ed child does not inherit pinned staging memory",
    "fence_wait_cpu": "item 5: blocking events: CPU time of a host wait on copies (blocking vs default event)",
    "d2h_alignment": "item 6: device-to-host GB/s into destinations aligned to 4096, 512 and 2 bytes",
    "straddling_gpu_targets": "tests: odd dtypes/shapes across 1 MiB registrations, written right after save(), loaded onto GPU",
    "save_under_side_stream": "tests: a save under torch.cuda.stream(s) waits for s",
}


def _skipped(name: str, kind: str) -> list[dict]:
    return [{"name": name, "kind": kind, "ok": None, "skipped": "cpu", "item": ITEMS[name]}]


def _entry(name: str, kind: str, ok: bool | None, **extra: Any) -> dict:
    return {"name": name, "kind": kind, "ok": ok, "item": ITEMS[name], **extra}


class ItemChecks:
    """Mixed into gpu_smoke's ``Smoke`` (``torch``, ``cuda``, ``root``, ``spin``, ``params``)."""

    torch: Any
    cuda: bool
    root: str

    def pin_failure_then_launch(self) -> list[dict]:
        if not self.cuda:
            return _skipped("pin_failure_then_launch", "data")
        from ckptctl.save.shard_layout import make_layout, view
        from ckptctl.save.staging import StagingBuffer
        from ckptctl.state.capture import capture
        from ckptctl.state.pinned import CudaRegistrar

        torch = self.torch

        class BadFlags(CudaRegistrar):  # a real cudaHostRegister that fails (invalid flags)
            def register(self, ptr: int, nbytes: int) -> str | None:
                with torch.cuda.device(self.device):
                    code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0x80))
                return None if code == 0 else f"CUDA error {code}"

        state = {"t": torch.randn(512, 384, device="cuda").t(), "w": torch.randn(1000, device="cuda")}
        tensors = capture({"extra": state}, with_rng=False).tensors
        layout = make_layout(tensors)
        staging = StagingBuffer(registrar_for=BadFlags)
        error = None
        try:
            buf = staging.snapshot(layout, tensors)  # the transposed tensor's .contiguous(): a launch
            torch.ones(4, device="cuda").add_(1)  # the training's next forward
            torch.cuda.synchronize()
            wrong = [s.name for s in layout.slots if not torch.equal(view(buf, s).cpu(), tensors[s.name].data.cpu())]
        except RuntimeError as e:
            error, wrong = f"{type(e).__name__}: {e}", []
        finally:
            pinned = staging.pinned
            staging.release()
        return [_entry("pin_failure_then_launch", "data", error is None and not wrong and not pinned, error=error, wrong=wrong)]

    def rollback_after_overlapped_save(self) -> list[dict]:
        if not self.cuda:
            return _skipped("rollback_after_overlapped_save", "data")
        from ckptctl import Checkpointer

        torch = self.torch
        model = self.params(64 * MiB, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        for p in model.w:
            p.grad = torch.zeros_like(p)
        opt.step()
        state = {"model": model, "optimizer": opt}
        root = os.path.join(self.root, "rollback")

        def fill(v: float) -> None:
            with torch.no_grad():
                for i, p in enumerate(model.w):
                    p.fill_(v + i)

        with Checkpointer(root, overlap_copies=True) as ck:
            fill(1.0)
            first = ck.save(1, state).wait()
            fill(2.0)
            self.spin(1000)  # the deferred copies start after this
            handle = ck.save(2, state)
            with torch.cuda.stream(torch.cuda.Stream()):  # the roll-back, not behind the spin
                ck.load(first, state)
            torch.cuda.synchronize()
            second = handle.wait()
        back = self.params(64 * MiB, 4, "cpu")
        with Checkpointer(root) as ck:
            ck.load(second, {"model": back}, strict=False)
        got = [torch.unique(p.detach()).tolist() for p in back.w]
        return [_entry("rollback_after_overlapped_save", "data", got == [[2.0 + i] for i in range(4)], got=got)]

    def dropped_region_unregistered(self) -> list[dict]:
        if not self.cuda:
            return _skipped("dropped_region_unregistered", "resource")
        from ckptctl.state.pinned import CudaRegistrar, HostRegion, held_bytes

        region = HostRegion(64 * MiB, registrar=CudaRegistrar(0))
        keep = region.tensor[:]  # the mapping stays, so its address can be registered again
        ptr, before = keep.data_ptr(), held_bytes()
        del region
        gc.collect()
        rt = self.torch.cuda.cudart()
        code = int(rt.cudaHostRegister(ptr, 64 * MiB, 1))  # 712 (already registered) if it leaked
        if code == 0:
            rt.cudaHostUnregister(ptr)
        return [_entry("dropped_region_unregistered", "resource", code == 0 and before - held_bytes() == 64 * MiB,
                       reregister_code=code)]

    def fork_child_has_no_pinned_pages(self) -> list[dict]:
        if not self.cuda:
            return _skipped("fork_child_has_no_pinned_pages", "data")
        from ckptctl.state.pinned import CudaRegistrar, HostRegion

        region = HostRegion(64 * MiB, registrar=CudaRegistrar(0), fault_in=True)
        addr = region.tensor.data_ptr()
        pid = os.fork()
        if pid == 0:  # the child: no CUDA, only whether the pages are mapped
            with open("/proc/self/maps") as f:
                inherited = any(int(a, 16) <= addr < int(b, 16) for a, b in (ln.split()[0].split("-") for ln in f))
            os._exit(3 if inherited else 0)
        _, status = os.waitpid(pid, 0)
        pinned = region.pinned
        region.release()
        ok = pinned and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        return [_entry("fork_child_has_no_pinned_pages", "data", ok, pinned=pinned, child_status=status)]

    def fence_wait_cpu(self) -> list[dict]:
        if not self.cuda:
            return _skipped("fence_wait_cpu", "perf")
        from ckptctl.state.pinned import host_wait_event

        torch = self.torch
        out = {}
        for label, make in (("default_event", torch.cuda.Event), ("blocking_event", host_wait_event)):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                self.spin(500)
            event = make()
            event.record(stream)
            used: dict[str, float] = {}

            def wait() -> None:  # as the writer thread waits before it hashes
                cpu, wall = time.thread_time(), time.perf_counter()
                event.synchronize()
                used["cpu_s"], used["wall_s"] = round(time.thread_time() - cpu, 4), round(time.perf_counter() - wall, 4)

            t = threading.Thread(target=wait)
            t.start()
            t.join()
            out[label] = used
        b = out["blocking_event"]
        return [_entry("fence_wait_cpu", "perf", b["cpu_s"] < 0.25 * max(b["wall_s"], 1e-3), **out,
                       target="blocking: CPU < 0.25 x wall (a spinning wait is ~1 x)")]

    def d2h_alignment(self) -> list[dict]:
        if not self.cuda:
            return _skipped("d2h_alignment", "perf")
        from ckptctl.state.pinned import CudaRegistrar, HostRegion

        torch = self.torch
        count, size = 64, 4 * MiB + 1000  # many medium tensors: where partial transfers show
        region = HostRegion(count * (size + 8192), registrar=CudaRegistrar(0), fault_in=True)
        srcs = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(count)]
        res = {}
        for label, align in (("align_4096", 4096), ("align_512", 512), ("packed_plus_2", 2)):
            at, dsts = 0, []
            for _ in range(count):
                at = -(-at // align) * align if align > 2 else at + 2
                dsts.append(region.tensor[at : at + size])
                at += size
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            res[label] = round(count * size / best / 1e9, 2)
        pinned = region.pinned
        region.release()
        # A measurement for choosing CKPTCTL_STAGING_ALIGN, not a gate.
        return [_entry("d2h_alignment", "perf", None if pinned else False, GB_per_s=res, pinned=pinned,
                       note="set CKPTCTL_STAGING_ALIGN=4096 if align_4096 is clearly faster than align_512")]

    def straddling_gpu_targets(self) -> list[dict]:
        if not self.cuda:
            return _skipped("straddling_gpu_targets", "data")
        from ckptctl import Checkpointer
        from ckptctl.state import pinned

        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(1)
        src = {
            "bf16": torch.randn(3 * MiB // 2 + 7, device="cuda", generator=g).to(torch.bfloat16),
            "f32": torch.randn(1_000_003, device="cuda", generator=g),
            "i64": torch.randint(-(1 << 40), 1 << 40, (777_777,), device="cuda", generator=g),
            "scalar": torch.tensor(1.25, device="cuda"),
            "empty": torch.empty(0, 3, device="cuda"),
            "t": torch.randn(1031, 517, device="cuda", generator=g).t(),
            "strided": torch.arange(3_000_001, device="cuda")[::7],
        }
        want = {k: v.cpu().clone() for k, v in src.items()}
        chunk, pinned.REGISTER_CHUNK = pinned.REGISTER_CHUNK, MiB  # read when the buffer is mapped
        held = pinned.held_bytes()
        try:
            with Checkpointer(os.path.join(self.root, "straddle")) as ck:
                h = ck.save(1, {"extra": src})
                self.spin()
                for v in src.values():
                    v.zero_()  # a long kernel, then writes, right after save() returned
                path = h.wait()
                back = {k: torch.full_like(v, 7) for k, v in src.items()}
                back["t"] = torch.full((517, 1031), 7.0, device="cuda").t()
                ck.load(path, {"extra": back})
                torch.cuda.synchronize()
        finally:
            pinned.REGISTER_CHUNK = chunk
        bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        wrong = [k for k in want if not torch.equal(bits(back[k].cpu()), bits(want[k]))]
        return [_entry("straddling_gpu_targets", "data", not wrong and pinned.held_bytes() == held, wrong=wrong,
                       held_after_close=pinned.held_bytes() - held)]

    def save_under_side_stream(self) -> list[dict]:
        if not self.cuda:
            return _skipped("save_under_side_stream", "data")
        from ckptctl import Checkpointer

        torch = self.torch
        model = self.params(64 * MiB, 4)
        torch.cuda.synchronize()
        root = os.path.join(self.root, "side")
        with Checkpointer(root) as ck, torch.cuda.stream(torch.cuda.Stream()):
            self.spin()
            with torch.no_grad():
                for i, p in enumerate(model.w):
                    p.fill_(3.0 + i)  # on the side stream, behind the spin
            h = ck.save(1, {"model": model})
            with torch.no_grad():
                for p in model.w:
                    p.fill_(-1.0)
            path = h.wait()
        back = self.params(64 * MiB, 4, "cpu")
        with Checkpointer(root) as ck:
            ck.load(path, {"model": back})
        got = [torch.unique(p.detach()).tolist() for p in back.w]
        return [_entry("save_under_side_stream", "data", got == [[3.0 + i] for i in range(4)], got=got)]
