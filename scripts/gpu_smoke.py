#!/usr/bin/env python
"""One prepared script for the first GPU host: is ckptctl's CUDA path right, and how fast?

    python scripts/gpu_smoke.py [--device cuda|cpu] [--json out.json] [--quick] [--gib 2] [--dir DIR]
    python scripts/gpu_smoke.py --list          # every check, and what it answers

Under 3 minutes on one H200 (a time budget skips, and fails, what is left after
``BUDGET_S``). Prints one JSON document (also written to ``--json``) that starts with the
torch, CUDA, driver-visible GPU and kernel versions; exits 0 all good, 1 wrong data, 2 a
resource or performance target missed (or the time budget ran out, or DCP could not be
measured to compare with), 3 cannot start (no CUDA, an import failed). Checks, in order:

- ordering: a producer queued behind a ~200 ms ``torch.cuda._sleep`` spin is in the snapshot,
  writes made right after ``save()`` returned are not, over two saves of one buffer;
- dtypes: a bitwise round trip of every dtype the format holds (random bytes, via the GPU),
  loaded onto GPU targets;
- the second reading's items (``scripts/gpu_items.py``): a real failed ``cudaHostRegister``
  then a launch and a transposed save; a roll-back right after an overlapped save; a dropped
  region unregistered; no pinned pages in a forked child; odd tensors straddling 1 MiB
  registrations loaded onto the GPU; a save under a side stream;
- reshard: two gloo ranks sharing the GPU load a 1-rank checkpoint as ``Shard(0)`` DTensors
  (1->2), save, load as ``Shard(1)`` (2->2); one process loads it whole (2->1); a copy with
  one flipped data byte must not load (corrupt_byte_refused);
- d2h_bandwidth: device-to-host copy into memory we page-locked ourselves; d2h_alignment:
  the same into destinations aligned to 4096, 512 and 2 bytes (chooses STAGING_ALIGN);
- fence_wait_cpu: CPU time of a host wait on copies, default vs blocking event;
- stall: ckptctl's first (after ``prepare``) and steady stall for ``--gib`` of state, also with
  ``overlap_copies=True``, and the process CPU seconds per save (save() to commit), beside
  DCP ``async_save`` with one reused pinned ``DefaultStager`` (synchronous and asynchronous
  staging; a torch that closes a caller's stager after each stage, pytorch#183413, is named
  and measured with a fresh stager per save); ``torch.cuda.synchronize()`` before every
  timer; DCP failing counts as a failure. hiccup: the slowest training step while
  ``prepare()`` maps and pins in the background;
- pinned_after_close: bytes ckptctl holds page-locked (``pinned.held_bytes``: staging and the
  load's bounce pool) after a load onto the GPU and after ``close()``.

``--device cpu`` runs the same logic without a GPU, at ``--quick`` sizes (the test suite does);
CUDA-only parts report ``"skipped"``. The host's torch may be older than ours: newer APIs
(``DefaultStager``, ``no_dist``, ``host_memory_stats``) are used only where present.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback

# Run from a checkout on a host where ckptctl is not installed: import it from here.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_items, beside this file

from gpu_dcp import DcpChecks, stall_verdict  # noqa: E402,F401 - after the path is set; stall_verdict for the tests
from gpu_items import ITEMS, ItemChecks  # noqa: E402
from gpu_reshard import ReshardChecks  # noqa: E402

BUDGET_S = 170.0
MiB, GiB = 1 << 20, 1 << 30

# Every entry the script reports, with what it answers (``--list``); the second reading's
# items come from gpu_items.ITEMS.
CHECKS: dict[str, str] = {
    "ordering": "a producer queued behind a spin is in the snapshot; writes after save() returned are not",
    "dtypes": "every dtype of the format, bitwise, saved from and loaded onto the GPU",
    **ITEMS,
    "reshard_1to2": "tests: 1 -> 2 ranks, Shard(0) DTensor targets on the GPU",
    "reshard_2to2_shard0_to_shard1": "tests: 2 -> 2 ranks, Shard(0) saved, Shard(1) DTensor targets on the GPU",
    "reshard_2to1": "2 -> 1: the whole tensor onto the GPU",
    "corrupt_byte_refused": "one flipped data byte: the load is refused",
    "d2h_bandwidth": "device-to-host GB/s into memory we page-locked",
    "hiccup": "slowest training step while prepare() pins in the background",
    "stall": "first/steady stall vs DCP (a DCP failure fails it; a non-reusable DefaultStager is named); item 5: CPU s per save",
    "pinned_after_close": "tests: pinned bytes (staging and bounce pool) after a GPU load and after close()",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", default=None, help="also write the JSON results here")
    ap.add_argument("--quick", action="store_true", help="small sizes (the test suite's CPU run)")
    ap.add_argument("--gib", type=float, default=2.0, help="state size of the stall measurement")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--list", action="store_true", help="print every check and what it answers, run nothing")
    a = ap.parse_args()
    if a.list:
        for name, what in CHECKS.items():
            print(f"{name:34} {what}")
        return 0
    report: dict = {"device": a.device, "kernel": platform.release(), "python": platform.python_version(), "checks": [], "exit": 3}
    try:
        import torch

        import ckptctl  # noqa: F401 - fail here, as "cannot start", if it does not import
        report["torch"] = torch.__version__
        report["cuda"] = torch.version.cuda
        if a.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
            report["gpu"] = torch.cuda.get_device_name(0)
        print(f"torch {report['torch']}, CUDA {report['cuda']}, kernel {report['kernel']}, {report.get('gpu', 'no GPU')}",
              file=sys.stderr)
    except Exception as e:  # reported as exit 3, whatever it was
        report["error"] = f"cannot start: {type(e).__name__}: {e}"
        return _finish(report, a.json)
    root = a.dir or _scratch(a.gib)
    smoke = Smoke(a.device, a.quick or a.device == "cpu", a.gib, root)  # on the CPU: its logic, small
    try:
        for fn, kind in ((smoke.ordering, "data"), (smoke.dtypes, "data"), (smoke.pin_failure_then_launch, "data"),
                         (smoke.rollback_after_overlapped_save, "data"), (smoke.dropped_region_unregistered, "resource"),
                         (smoke.fork_child_has_no_pinned_pages, "data"), (smoke.straddling_gpu_targets, "data"),
                         (smoke.save_under_side_stream, "data"), (smoke.reshard, "data"), (smoke.d2h_bandwidth, "perf"),
                         (smoke.d2h_alignment, "perf"), (smoke.fence_wait_cpu, "perf"), (smoke.stall_and_hiccup, "perf"),
                         (smoke.pinned_after_close, "resource")):
            smoke.run(fn, kind)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report["checks"] = smoke.checks
    report["elapsed_s"] = round(time.perf_counter() - smoke.t0, 1)
    data_bad = any(c["kind"] == "data" and c["ok"] is False for c in smoke.checks)
    perf_bad = any(c["ok"] is False for c in smoke.checks)
    report["exit"] = 1 if data_bad else 2 if perf_bad else 0
    return _finish(report, a.json)


def _finish(report: dict, path: str | None) -> int:
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
    return int(report["exit"])


class Smoke(ItemChecks, DcpChecks, ReshardChecks):
    def __init__(self, device: str, quick: bool, gib: float, root: str) -> None:
        import torch

        self.torch, self.device, self.quick, self.root = torch, device, quick, root
        self.cuda = device == "cuda"
        self.stall_bytes = 64 * MiB if quick else int(gib * GiB)
        self.checks: list[dict] = []
        self.t0 = time.perf_counter()

    def run(self, fn, kind: str) -> None:
        """Run one check (it returns its results); one that raises fails as ``kind``, with the
        traceback's tail; past the budget, the rest are skipped."""
        if time.perf_counter() - self.t0 > BUDGET_S:
            self.checks.append({"name": fn.__name__, "kind": "resource", "ok": False, "skipped": "time budget spent"})
            return
        try:
            self.checks.extend(fn())
        except Exception as e:  # reported in the JSON, the run goes on
            self.checks.append({"name": fn.__name__, "kind": kind, "ok": False, "error": f"{type(e).__name__}: {e}",
                                "trace": traceback.format_exc()[-1500:]})

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def spin(self, ms: float = 200.0) -> None:
        if self.cuda:  # on the CPU every op is synchronous: nothing to queue behind
            torch = self.torch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); torch.cuda._sleep(1_000_000); end.record(); end.synchronize()
            torch.cuda._sleep(int(1_000_000 / max(start.elapsed_time(end), 1e-3) * ms))

    def params(self, total: int, pieces: int, device: str | None = None):
        nn = self.torch.nn
        m = nn.Module()
        m.w = nn.ParameterList(nn.Parameter(self.torch.zeros(total // pieces // 4, device=device or self.device)) for _ in range(pieces))
        return m

    # --- correctness -------------------------------------------------------------------

    def ordering(self) -> list[dict]:
        from ckptctl import Checkpointer

        torch = self.torch
        pieces, total = 4, (16 * MiB if self.quick else 256 * MiB)
        model = self.params(total, pieces)
        bad = []
        with Checkpointer(os.path.join(self.root, "ordering")) as ck:
            for step, v in ((1, 10.0), (2, 20.0)):
                self.spin()
                with torch.no_grad():
                    for i, p in enumerate(model.w):
                        p.fill_(v + i)  # behind the spin: must be in the snapshot
                h = ck.save(step, {"model": model})
                with torch.no_grad():
                    for p in model.w:
                        p.fill_(-1.0)  # after save() returned: must not be
                path = h.wait()
                back = self.params(total, pieces, "cpu")
                ck.load(path, {"model": back})
                got = [torch.unique(p.detach()).tolist() for p in back.w]
                if got != [[v + i] for i in range(pieces)]:
                    bad.append({"step": step, "got": got[:4]})
            pinned = ck.staging_pinned_bytes
        want_pinned = total if self.cuda else 0
        return [{"name": "ordering", "kind": "data", "ok": not bad and pinned == want_pinned, "bytes": total,
                 "pinned_bytes": pinned, "wrong": bad}]

    def dtypes(self) -> list[dict]:
        from ckptctl import Checkpointer
        from ckptctl.format import dtypes

        torch = self.torch
        g = torch.Generator().manual_seed(0)
        names = [n for n in dtypes.names() if hasattr(torch, n)]
        state = {}
        for i, n in enumerate(names):
            dt = getattr(torch, n)
            raw = torch.randint(0, 256, (1000 + i, dt.itemsize), dtype=torch.uint8, generator=g)
            t = raw.view(dt).reshape(-1)
            if dt == torch.bool:
                t = raw[:, 0] % 2 == 1  # only 0 and 1 are valid bools
            state[n] = t.to(self.device)
        want = {n: t.cpu().clone() for n, t in state.items()}
        with Checkpointer(os.path.join(self.root, "dtypes")) as ck:
            path = ck.save(1, {"extra": state}).wait()
            back = {n: torch.empty_like(t, device=self.device) for n, t in want.items()}  # GPU targets
            ck.load(path, {"extra": back})
        wrong = [n for n in names if not torch.equal(_bits(back[n].cpu()), _bits(want[n]))]
        return [{"name": "dtypes", "kind": "data", "ok": not wrong, "count": len(names), "wrong": wrong,
                 "target_device": self.device}]

    # --- resources and speed -------------------------------------------------------------

    def d2h_bandwidth(self) -> list[dict]:
        if not self.cuda:
            return [{"name": "d2h_bandwidth", "kind": "perf", "ok": None, "skipped": "cpu"}]
        from ckptctl.state.pinned import CudaRegistrar, HostRegion

        torch, n = self.torch, (256 * MiB if self.quick else GiB)
        region = HostRegion(n, registrar=CudaRegistrar(0), fault_in=True)
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        times = []
        for _ in range(4):
            self.sync()
            t = time.perf_counter()
            region.tensor.copy_(src, non_blocking=True)
            self.sync()
            times.append(time.perf_counter() - t)
        gbs = n / min(times[1:]) / 1e9
        pinned = region.pinned
        region.release()
        return [{"name": "d2h_bandwidth", "kind": "perf", "ok": pinned and gbs >= 20.0, "GB_per_s": round(gbs, 1),
                 "pinned": pinned, "target": ">= 20 GB/s (PCIe Gen5 ~50)"}]

    def stall_and_hiccup(self) -> list[dict]:
        from ckptctl import Checkpointer

        torch, out = self.torch, []
        n = self.stall_bytes
        model = self.params(n, max(1, n // (64 * MiB)))
        # lr 0: saves change nothing. One small momentum buffer, so the optimizer has state and
        # prepare() plans (an optimizer that never stepped has no state to size).
        opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        model.w[0].grad = torch.zeros_like(model.w[0])
        opt.step()
        a = torch.randn(*((4096, 4096) if self.cuda else (128, 128)), device=self.device)

        def train_step() -> float:  # a few ms of GPU work, then the host waits for it
            t = time.perf_counter()
            for _ in range(20):
                a.copy_(torch.tanh(a @ a) * 0.01)
            self.sync()
            return time.perf_counter() - t

        base = sorted(train_step() for _ in range(11))[5]
        results = {}
        for overlap in (False, True):
            with Checkpointer(os.path.join(self.root, f"stall{int(overlap)}"), overlap_copies=overlap) as ck:
                state = {"model": model, "optimizer": opt}
                ck.prepare(state)
                steps, t = [], time.perf_counter()
                while time.perf_counter() - t < (3.0 if self.cuda else 0.3) or not steps:  # while it pins
                    steps.append(train_step())
                if not overlap:
                    hiccup = max(steps) - base
                    out.append({"name": "hiccup", "kind": "perf", "ok": hiccup < 0.25 if self.cuda else None, "step_s": round(base, 4),
                                "worst_step_during_prepare_s": round(max(steps), 4), "target": "hiccup < 0.25 s"})
                stalls, cpu = [], []
                for step in range(1, 4):
                    self.sync()
                    t, c = time.perf_counter(), time.process_time()
                    h = ck.save(step, state)
                    stalls.append(time.perf_counter() - t)
                    opt.step()
                    path = h.wait()
                    cpu.append(time.process_time() - c)  # every thread's CPU, save() to commit
                    shutil.rmtree(_local(path))  # keep the scratch disk small
                results[overlap] = {"first_s": round(stalls[0], 4), "steady_s": round(min(stalls[1:]), 4),
                                    "cpu_s_per_save": round(sum(cpu[1:]) / len(cpu[1:]), 4)}
        sd = {f"w{i}": p.detach() for i, p in enumerate(model.w)}
        dcp = self.dcp_stalls({**sd, "m0": opt.state[model.w[0]]["momentum_buffer"]})  # the same bytes
        entry = {"name": "stall", "kind": "perf", "bytes": n, "ckptctl": results[False], "ckptctl_overlap": results[True], "dcp": dcp}
        entry.update(stall_verdict(self.cuda, results[False]["steady_s"], results[True]["steady_s"], dcp))
        out.append(entry)
        return out

    def pinned_after_close(self) -> list[dict]:
        from ckptctl import Checkpointer

        torch = self.torch
        stats = getattr(torch.cuda, "host_memory_stats", None) if self.cuda else None
        cache = (lambda: stats().get("allocated_bytes.current", 0)) if stats else (lambda: 0)
        from ckptctl.state.pinned import held_bytes

        model = self.params(32 * MiB, 2)
        root = os.path.join(self.root, "pinned")
        before, base = cache(), held_bytes()  # held_bytes: staging buffers and bounce pools alike
        with Checkpointer(root) as ck:
            ck.save(1, {"model": model}).wait()
            held_saving = ck.staging_pinned_bytes
        after_close = held_bytes() - base
        peak = [0]
        done = threading.Event()

        def sample() -> None:  # the bounce pool exists only during the load: catch it there
            while not done.is_set():
                peak[0] = max(peak[0], held_bytes() - base)
                done.wait(0.0005)

        sampler = threading.Thread(target=sample, daemon=True)
        with Checkpointer(root) as ck:
            sampler.start()
            try:
                ck.load_latest({"model": model}, prepare=False)  # GPU targets: through the bounce pool
            finally:
                done.set()
                sampler.join()
            after_load = held_bytes() - base
            cache_after_load = cache()
        want = 32 * MiB if self.cuda else 0
        return [{"name": "pinned_after_close", "kind": "resource",
                 "ok": held_saving == want and after_close == 0 and after_load == 0 and cache_after_load - before <= 512 * MiB,
                 "held_while_saving": held_saving, "after_close": after_close, "after_load": after_load,
                 "peak_during_load": peak[0], "torch_host_cache_growth_after_load": cache_after_load - before}]


def _local(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _scratch(gib: float) -> str:
    """A scratch directory: in /dev/shm when it has room for a few copies of the state (the
    stall is measured until save() returns, so the disk's speed only costs wall time)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > (3 * gib + 2) * GiB:
        return tempfile.mkdtemp(prefix="ckptctl-smoke-", dir=shm)
    return tempfile.mkdtemp(prefix="ckptctl-smoke-")


def _bits(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)



if __name__ == "__main__":
    sys.exit(main())
