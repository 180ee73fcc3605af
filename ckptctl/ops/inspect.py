"""``inspect``: what a checkpoint holds, from its manifest (no tensor data is read), and whether
it is resumable or a model-only export (``content``: its layout's ``kind_of_checkpoint``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ckptctl.layouts.native import manifest_kind, read_committed
from ckptctl.storage.base import Storage


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
    content: str = "resumable"  # or "export": model weights only, no optimizer (``manifest_kind``)
    content_reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def inspect_checkpoint(ckpt: Storage, *, tensors: bool = False) -> InspectResult:
    """What the committed checkpoint ``ckpt`` holds, from its manifest; ``tensors`` lists each."""
    m, _ = read_committed(ckpt)
    kind = manifest_kind(m)
    groups: dict[str, int] = {"model": 0, "optimizer": 0, "other": 0}
    for t in m.tensors.values():
        groups[t.group] = groups.get(t.group, 0) + t.nbytes
    return InspectResult(
        url=ckpt.url,
        step=m.step,
        created=m.created,
        world_size=m.world_size,
        tensor_count=len(m.tensors),
        total_bytes=m.total_bytes,
        bytes_by_group=groups,
        state_keys=sorted(m.state),
        stats=m.stats,
        tool=m.tool,
        files=[asdict(f) for f in m.files],
        tensors=[TensorInfo(n, t.dtype, t.shape, t.nbytes, t.chunks, t.group) for n, t in m.tensors.items()] if tensors else [],
        content=kind.kind,
        content_reason=kind.reason,
    )
