"""manifest.json: what a checkpoint holds. Written by the coordinator after every shard is
durable, before the marker.

Its size grows with files + tensors, never files x tensors: where each tensor's chunks live is
recorded in the shards' own headers (see ``shard.py``); the manifest says how many chunks each
tensor has so that coverage can be checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes
from ckptctl.format.checksum import ALGORITHM
from ckptctl.format.layout import is_valid_shard_name

FORMAT_NAME = "ckptctl"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    checksum: str
    rank: int
    chunks: int  # number of tensor chunks in the file


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    group: str  # "model", "optimizer" or "other": what inspect reports bytes by
    chunks: int  # how many chunks, across all shards, hold this tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass
class Manifest:
    step: int
    created: float  # seconds since the epoch
    world_size: int
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    state: dict[str, Any] = field(default_factory=dict)  # non-tensor state (see save.jsonstate)
    stats: dict[str, float] = field(default_factory=dict)  # bytes, stall_s, write_s, ...
    tool: dict[str, str] = field(default_factory=dict)
    checksum_algorithm: str = ALGORITHM
    extra: dict[str, Any] = field(default_factory=dict)  # room for per-format notes (interop)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "tool": self.tool,
            "checksum_algorithm": self.checksum_algorithm,
            "files": [asdict(f) for f in self.files],
            "tensors": {
                n: {"dtype": t.dtype, "shape": list(t.shape), "group": t.group, "chunks": t.chunks}
                for n, t in self.tensors.items()
            },
            "state": self.state,
            "stats": self.stats,
            "extra": self.extra,
        }
        return json.dumps(doc, indent=1, allow_nan=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Manifest":
        """Parse and validate. Every problem raises InvalidCheckpoint naming ``where``."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidCheckpoint(
                f"{where}: manifest is not valid JSON ({e})",
                hint="the manifest is garbled; this checkpoint cannot be trusted",
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise InvalidCheckpoint(f"{where}: not a ckptctl manifest")
        if doc.get("version") != FORMAT_VERSION:
            raise InvalidCheckpoint(
                f"{where}: manifest version {doc.get('version')!r} is not supported (this is v1)",
                hint="upgrade ckptctl to read this checkpoint",
            )
        try:
            files = [FileEntry(**f) for f in doc["files"]]
            tensors = {
                str(n): TensorEntry(t["dtype"], tuple(int(d) for d in t["shape"]), str(t["group"]), int(t["chunks"]))
                for n, t in doc["tensors"].items()
            }
            m = cls(
                step=int(doc["step"]),
                created=float(doc["created"]),
                world_size=int(doc["world_size"]),
                files=files,
                tensors=tensors,
                state=dict(doc.get("state") or {}),
                stats=dict(doc.get("stats") or {}),
                tool=dict(doc.get("tool") or {}),
                checksum_algorithm=str(doc.get("checksum_algorithm", "")),
                extra=dict(doc.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidCheckpoint(f"{where}: manifest is missing or has a bad field ({e!r})") from None
        m._validate(where)
        return m

    def _validate(self, where: str) -> None:
        if self.checksum_algorithm != ALGORITHM:
            raise InvalidCheckpoint(
                f"{where}: unknown checksum algorithm {self.checksum_algorithm!r}",
                hint="upgrade ckptctl",
            )
        names = set()
        for f in self.files:
            # A manifest is untrusted input: a file name is one plain name inside the checkpoint.
            if not isinstance(f.name, str) or not is_valid_shard_name(f.name):
                raise InvalidCheckpoint(
                    f"{where}: refusing file name {f.name!r}: it is not a plain shard name "
                    "inside the checkpoint",
                    hint="the manifest was altered; treat this checkpoint as untrusted",
                )
            if f.name in names:
                raise InvalidCheckpoint(f"{where}: file {f.name!r} is listed twice")
            names.add(f.name)
            if not (isinstance(f.size, int) and f.size >= 0 and isinstance(f.checksum, str)):
                raise InvalidCheckpoint(f"{where}: file {f.name!r} has a bad size or checksum")
        for n, t in self.tensors.items():
            if not dtypes.is_known(t.dtype) or any(d < 0 for d in t.shape):
                raise InvalidCheckpoint(f"{where}: tensor {n!r} has a bad dtype or shape")
