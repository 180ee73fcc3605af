"""``inspect`` for checkpoints written by other tools (DCP, safetensors, torch.save), and
``verify`` for the file formats (safetensors, torch.save): structure and a test-load of every
tensor, one at a time (DCP directories are verified by their layout, ``layouts.dcp``).

None of these formats records checksums, so ``verify`` cannot tell a flipped bit from a real
value; it says so plainly in its report (``note``) instead of reporting a clean bill of health
it cannot back. Converting with ``ckptctl convert --to ckptctl`` gives the checkpoint checksums.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch

from ckptctl.errors import CkptError
from ckptctl.interop.base import Source
from ckptctl.interop.detect import foreign_format
from ckptctl.ops.transform.convert import open_source
from ckptctl.state.buffers import TensorBuffer
from ckptctl.ops.verify.checkpoint import Level, Problem, VerifyReport
from ckptctl.progress import Progress

NO_CHECKSUMS = "{fmt} records no checksums: corruption that still decodes cannot be detected; " \
               "structure and coverage were checked{loaded}. `ckptctl convert --to ckptctl` adds checksums."


@dataclass
class ForeignInspect:
    url: str
    format: str
    step: int | None
    tensor_count: int
    total_bytes: int  # on disk
    bytes_by_group: dict[str, int]
    state_keys: list[str]
    metadata: dict[str, str]
    dropped: list[str]
    checksums: bool = False
    tensors: list[dict] = field(default_factory=list)
    content: str | None = None  # "resumable" or "export" when a layout's checkpoint tells (ops.verbs.inspect_path)
    content_reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def inspect_foreign(path: str, *, tensors: bool = False) -> ForeignInspect:
    with open_source(path) as src:
        groups: dict[str, int] = {"model": 0, "optimizer": 0, "other": 0}
        for m in src.tensors.values():
            groups[m.group] = groups.get(m.group, 0) + m.nbytes
        keys = sorted(src.tree) if isinstance(src.tree, dict) else []
        return ForeignInspect(
            url=path, format=src.kind, step=src.step, tensor_count=len(src.tensors), total_bytes=_disk_bytes(path),
            bytes_by_group=groups, state_keys=keys, metadata=dict(src.metadata), dropped=list(src.dropped),
            tensors=[{"name": m.name, "dtype": m.dtype, "shape": list(m.shape), "bytes": m.nbytes, "group": m.group}
                     for m in src.tensors.values()] if tensors else [],
        )


def verify_foreign(path: str, level: Level = "checksums", progress: Progress | None = None) -> VerifyReport:
    """Structure (headers, index), then, unless ``quick``, every tensor read and decoded one at
    a time. Problems go in the report; nothing raises for them. For the file formats only
    (safetensors, torch.save): a DCP directory, named alone or under a root, is the DCP
    layout's checkpoint, verified by that layout's check (``ops.verify.layouts``)."""
    t0 = time.perf_counter()
    fmt = foreign_format(path) or "?"
    report = VerifyReport(path, level)
    loaded = ""
    try:
        with open_source(path) as src:
            report.step, report.tensors = src.step, len(src.tensors)
            report.files = _file_count(path)
            for d in src.dropped:
                report.problems.append(Problem(f"cannot be read safely: {d}"))
            if level != "quick":
                loaded = _test_load(src, report, progress)
    except CkptError as e:
        report.problems.append(Problem(str(e), hint=e.hint))
    report.note = NO_CHECKSUMS.format(fmt=fmt, loaded=loaded)
    report.seconds = time.perf_counter() - t0
    return report


def _test_load(src: Source, report: VerifyReport, progress: Progress | None) -> str:
    buf = TensorBuffer()
    for m in src.tensors.values():
        out = buf.view(m.dtype, m.shape)
        try:
            src.read_into(m.name, out)
        except (CkptError, RuntimeError, OSError, ValueError) as e:
            report.problems.append(Problem(f"does not load: {str(e).splitlines()[0][:300]}", tensor=m.name))
            continue
        if m.dtype == "bool" and out.numel() and bool((out.view(torch.uint8) > 1).any()):
            report.problems.append(Problem("bool tensor holds bytes other than 0 and 1", tensor=m.name))
        report.bytes_read += m.nbytes
        if progress:
            progress(m.nbytes)
    return " and every tensor test-loaded"


def _disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))


def _file_count(path: str) -> int:
    return 1 if os.path.isfile(path) else sum(1 for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
