"""DCP's side of ``scripts/gpu_smoke.py``'s stall comparison: ``async_save`` with a reused
``DefaultStager``, and the verdict that fails a GPU run which never compared with it.

Kept apart from gpu_smoke.py so each file stays small; imported by it, never run alone.
"""

from __future__ import annotations

import inspect
import os
import shutil
import socket
import time
from typing import Any


class DcpChecks:
    """Mixed into gpu_smoke's ``Smoke`` (``torch``, ``cuda``, ``root``, ``sync``)."""

    torch: Any
    cuda: bool
    root: str

    def dcp_stalls(self, sd: dict) -> dict:
        if not self.cuda:
            return {"skipped": "cpu"}
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        params = inspect.signature(dcp.async_save).parameters
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            DefaultStager = None
        started = False
        if "no_dist" not in params and not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
            started = True
        out: dict = {}
        try:
            modes = [("sync_staging", False), ("async_staging", True)] if DefaultStager and "async_stager" in params else [("default", None)]
            for label, use_async in modes:
                try:  # one mode failing leaves the other's figures
                    out[label] = self._dcp_mode(dcp, params, sd, label, DefaultStager, StagingOptions, use_async)
                except Exception as e:  # reported beside ckptctl's figures; stall_verdict fails it
                    out[label] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if started:
                dist.destroy_process_group()
        return out

    def _dcp_mode(self, dcp, params, sd: dict, label: str, DefaultStager, StagingOptions, use_async) -> dict:
        """Three ``async_save`` calls reusing one ``DefaultStager`` (its pinned buffers are the
        point of reusing it). torch 2.11 closes a caller's stager after each stage
        (pytorch#183413, fixed by pytorch#183424): reusing it then crashes or re-pins every
        save. That is detected (its ``close`` is called by someone else than us), said, and
        the remaining saves use a fresh stager, so the column still measures DCP."""
        kw: dict = {"no_dist": True} if "no_dist" in params else {}
        closed_by_torch = [0]

        def new_stager():
            if use_async is None:
                return None
            stager = DefaultStager(StagingOptions(use_async_staging=use_async))
            close = stager.close

            def counted() -> None:
                closed_by_torch[0] += 1
                close()

            stager.close = counted  # instrumentation: who closes it, and when
            return stager

        stager, stalls, note = new_stager(), [], None
        try:
            for step in range(3):
                if stager is not None:
                    kw["async_stager"] = stager
                self.sync()
                t = time.perf_counter()
                r = dcp.async_save({"model": sd}, checkpoint_id=os.path.join(self.root, f"dcp-{label}-{step}"), **kw)
                staged = getattr(r, "staging_completion", None)
                if staged is not None:
                    staged.result()  # the training loop may not touch its tensors before this
                stalls.append(time.perf_counter() - t)
                (getattr(r, "upload_completion", None) or r).result()
                shutil.rmtree(os.path.join(self.root, f"dcp-{label}-{step}"), ignore_errors=True)
                if closed_by_torch[0]:
                    note = ("this torch closes a caller's DefaultStager after each stage (pytorch#183413, fixed by "
                            "pytorch#183424): measured with a fresh stager per save, which pins again every time")
                    closed_by_torch[0] = 0
                    stager = new_stager()
        finally:
            if stager is not None:
                stager.close()
        res = {"first_s": round(stalls[0], 4), "steady_s": round(min(stalls[1:]), 4)}
        if note:
            res["stager_reuse"] = note
        return res


def stall_verdict(cuda: bool, steady_s: float, overlap_steady_s: float, dcp: dict) -> dict:
    """The stall entry's verdict. On a GPU, DCP must have been measured: a run that never
    compared with it fails (it used to pass with ``ok: None``)."""
    ref = [d["steady_s"] for d in dcp.values() if isinstance(d, dict) and "steady_s" in d]
    if ref:
        return {"ok": steady_s <= min(ref), "overlap_vs_dcp": round(overlap_steady_s / min(ref), 3),
                "target": "ckptctl steady <= DCP's; overlap <= 0.1 x DCP's (goal, not gated)"}
    if not cuda:
        return {"ok": None}  # nothing to compare with on the CPU
    return {"ok": False, "why": "DCP could not be measured, so nothing was compared (see 'dcp')"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
