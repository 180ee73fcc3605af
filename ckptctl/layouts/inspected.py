"""What ``inspect`` shows of one checkpoint: the typed results of a layout's ``inspect``.

``InspectResult``: a checkpoint whose manifest says what it holds (ckptctl's own: no tensor data
read). ``ForeignInspect``: one read through another tool's format reader (DCP, safetensors,
``torch.save``), which knows tensors and state keys but records no checksums. Their JSON is
``ckptctl inspect --json``'s (``format`` is present only in the second).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ckptctl.format.manifest import Manifest


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    chunks: int
    group: str


@dataclass
class InspectResult:
    url: str
    step: int
    created: float
    world_size: int
    tensor_count: int
    total_bytes: int  # on storage, headers included
    bytes_by_group: dict[str, int]  # tensor bytes: model / optimizer / other
    state_keys: list[str]
    stats: dict[str, float]
    tool: dict[str, str]
    files: list[dict]
    tensors: list[TensorInfo] = field(default_factory=list)
    content: str = "resumable"  # or "export": model weights only, no optimizer
    content_reason: str = ""
    numbered_by: str = "step"  # what ``step`` counts (``layouts.base.Numbering``)

    def to_dict(self) -> dict:
        return asdict(self)


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
    content: str | None = None  # "resumable" or "export" when a layout's checkpoint tells
    content_reason: str | None = None
    numbered_by: str = "step"  # what ``step`` counts: accelerate's checkpoint_N is a "save index"

    def to_dict(self) -> dict:
        return asdict(self)


Inspected = InspectResult | ForeignInspect


def inspect_manifest(url: str, m: Manifest, content: str, reason: str, *, tensors: bool = False) -> InspectResult:
    """What the checkpoint at ``url`` holds, from its committed manifest ``m`` alone (no
    tensor data read); ``content``: resumable or export, and why; ``tensors`` lists each."""
    groups: dict[str, int] = {"model": 0, "optimizer": 0, "other": 0}
    for t in m.tensors.values():
        groups[t.group] = groups.get(t.group, 0) + t.nbytes
    return InspectResult(
        url=url, step=m.step, created=m.created, world_size=m.world_size, tensor_count=len(m.tensors),
        total_bytes=m.total_bytes, bytes_by_group=groups, state_keys=sorted(m.state), stats=m.stats, tool=m.tool,
        files=[asdict(f) for f in m.files],
        tensors=[TensorInfo(n, t.dtype, t.shape, t.nbytes, t.chunks, t.group) for n, t in m.tensors.items()]
        if tensors else [],
        content=content, content_reason=reason,
    )
