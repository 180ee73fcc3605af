"""manifest.json: what a checkpoint holds. Written by the coordinator after every shard is
durable, before the marker.

Its size grows with files + tensors, never files x tensors: where each tensor's chunks live is
recorded in the shards' own headers (see ``shard.py``); the manifest says how many chunks each
tensor has so that coverage can be checked.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes, parse
from ckptctl.format.checksum import ALGORITHM
from ckptctl.format.layout import is_save_id, is_valid_shard_name, new_save_id
from ckptctl.version import tool_info

FORMAT_NAME = "ckptctl"
FORMAT_VERSION = 1
# A manifest grows with files + tensors (about 150 bytes each) plus the JSON state: 1 GiB is far
# above any real model's. The commit marker's ``manifest.size`` is bounded by the same figure.
MAX_MANIFEST_BYTES = 1 << 30
MAX_RANKS = 1 << 24
# ``metrics``: a handful of numbers a save records for retention (``KeepBest``); the bound keeps
# a hostile manifest from handing retention megabytes of names to sort.
MAX_METRICS = 256
MAX_METRIC_NAME = 128


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
    # Optional placement hints (readers may use them to open only the shards a region needs;
    # absent in older manifests): ``owner``, the rank whose file holds the whole tensor as its
    # one chunk; ``split`` = (dim, block), the file of rank r holds the chunk covering
    # [r*block, (r+1)*block) of ``dim`` (clipped to the tensor) and all of every other dim.
    owner: int | None = None
    split: tuple[int, int] | None = None

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
    state: dict[str, Any] = field(default_factory=dict)  # non-tensor state (encoded by state/tree.py)
    stats: dict[str, float] = field(default_factory=dict)  # bytes, stall_s, write_s, ...
    tool: dict[str, str] = field(default_factory=dict)
    checksum_algorithm: str = ALGORITHM
    extra: dict[str, Any] = field(default_factory=dict)  # room for per-format notes (interop)
    # The save attempt that wrote this checkpoint (16 hex digits; see ``layout.attempt_name``).
    # Optional: older manifests have none ("").
    save_id: str = ""
    # Finite numbers the job recorded at save time (``save(step, state, metrics=...)``), for
    # retention by metric. Optional: absent in older manifests and when none were given.
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def new(
        cls,
        step: int,
        world_size: int,
        files: Sequence[FileEntry],
        tensors: dict[str, TensorEntry],
        state: dict[str, Any],
        stats: dict[str, float],
        *,
        extra: dict[str, Any] | None = None,
        save_id: str | None = None,
        metrics: dict[str, float] | None = None,
    ) -> "Manifest":
        """The manifest of a checkpoint being written now: files by rank, tensors by name, and
        the ``tool`` entry every writer records (``version.tool_info``). ``save_id``: the
        attempt's id, the one its shards' attempt names carry; a fresh one when not given."""
        return cls(
            step=step,
            created=time.time(),
            world_size=world_size,
            files=sorted(files, key=lambda f: (f.rank, f.name)),
            tensors=dict(sorted(tensors.items())),
            state=state,
            stats=stats,
            tool=tool_info(),
            extra=dict(extra or {}),
            save_id=new_save_id() if save_id is None else save_id,
            metrics=check_metrics(metrics or {}),
        )

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
            "tensors": {n: _tensor_json(t) for n, t in self.tensors.items()},
            "state": self.state,
            "stats": self.stats,
            "extra": self.extra,
        }
        if self.save_id:
            doc["save_id"] = self.save_id
        if self.metrics:
            doc["metrics"] = dict(self.metrics)
        return json.dumps(doc, indent=1, allow_nan=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Manifest":
        """Parse and validate. Every problem raises InvalidCheckpoint naming ``where``.

        Forward compatible: keys this version does not know are ignored, at the top level and
        in each file and tensor entry; a higher ``version`` is refused (see ``parse``)."""
        # NaN and ±Infinity may appear inside ``state`` (a saved loss can be nan); every typed
        # field below is checked finite.
        doc = parse.load_json(raw, where, "manifest", max_bytes=MAX_MANIFEST_BYTES, allow_nonfinite=True)
        top = parse.Obj(doc, where, "manifest")
        if doc.get("format") != FORMAT_NAME:
            raise parse.invalid(where, "not a ckptctl manifest (no \"format\": \"ckptctl\")")
        parse.check_version(doc, where, "manifest", supported=FORMAT_VERSION)
        world_size = top.int("world_size", lo=1, hi=MAX_RANKS)
        files = [_file_entry(parse.Obj(f, where, f"manifest: files[{i}]"))
                 for i, f in enumerate(top.list("files"))]
        tensors = {n: _tensor_entry(parse.Obj(t, where, f"manifest: tensor {n!r}"))
                   for n, t in top.dict("tensors").items()}
        stats: dict[str, float] = {}
        for k, v in (top.dict("stats", default=None) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):  # other kinds: a newer writer's notes
                stats[k] = parse.as_float(v, lo=0.0, hi=float(parse.INT64_MAX),
                                          err=lambda why, k=k: top.bad("stats", f"entry {k!r} {why}"))
        tool = {k: v for k, v in (top.dict("tool", default=None) or {}).items() if isinstance(v, str)}
        m = cls(
            step=top.int("step", lo=0, hi=parse.INT64_MAX),
            created=top.float("created", lo=0.0, hi=parse.MAX_TIME),
            world_size=world_size,
            files=files,
            tensors=tensors,
            state=top.dict("state", default=None) or {},
            stats=stats,
            tool=tool,
            checksum_algorithm=top.str("checksum_algorithm", max_len=64, default=""),
            extra=top.dict("extra", default=None) or {},
            save_id=top.str("save_id", max_len=64, default=""),
            metrics=_metrics(top),
        )
        parse.check_state_tree(m.state, where, "manifest: 'state'")
        m._validate(where)
        return m

    def _validate(self, where: str) -> None:
        if self.checksum_algorithm != ALGORITHM:
            raise InvalidCheckpoint(
                f"{where}: unknown checksum algorithm {self.checksum_algorithm!r}",
                hint="upgrade ckptctl",
            )
        if self.save_id and not is_save_id(self.save_id):
            raise InvalidCheckpoint(f"{where}: save_id {self.save_id!r} is not 16 hex digits",
                                    hint="the manifest was altered; treat this checkpoint as untrusted")
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


def check_metrics(metrics: Any) -> dict[str, float]:
    """What ``save(..., metrics=...)`` may record: at most ``MAX_METRICS`` names of 1 to
    ``MAX_METRIC_NAME`` printable characters, each a finite number (never a bool). ``ValueError``
    names the offending entry (a caller's mistake, raised before anything is written)."""
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict of name to number, got {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"metrics has {len(metrics)} entries, more than {MAX_METRICS}")
    out: dict[str, float] = {}
    for name, v in metrics.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME or not name.isprintable():
            raise ValueError(f"metrics: name {name!r} is not 1..{MAX_METRIC_NAME} printable characters")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"metrics[{name!r}] must be a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"metrics[{name!r}] must be finite, got {f}")
        out[name] = f
    return out


def _metrics(top: parse.Obj) -> dict[str, float]:
    """The optional ``metrics`` object, every entry checked as the writer checked it."""
    doc = top.dict("metrics", max_len=MAX_METRICS, default=None) or {}
    out: dict[str, float] = {}
    for name, v in doc.items():
        if not 0 < len(name) <= MAX_METRIC_NAME or not name.isprintable():
            raise top.bad("metrics", f"has a name that is not 1..{MAX_METRIC_NAME} printable characters")
        out[name] = parse.as_float(v, lo=-math.inf, hi=math.inf,
                                   err=lambda why, n=name: top.bad("metrics", f"entry {n!r} {why}"))
    return out


def _file_entry(f: parse.Obj) -> FileEntry:
    """One ``files`` item; keys this version does not know are ignored."""
    return FileEntry(
        name=f.str("name", max_len=255),
        size=f.int("size"),
        checksum=f.str("checksum", max_len=128),
        rank=f.int("rank", hi=MAX_RANKS),
        chunks=f.int("chunks"),
    )


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "group": t.group, "chunks": t.chunks}
    if t.owner is not None:
        doc["owner"] = t.owner
    if t.split is not None:
        doc["split"] = list(t.split)
    return doc


def _tensor_entry(t: parse.Obj) -> TensorEntry:
    """One ``tensors`` value: a known dtype and a shape whose byte size fits in int64, and the
    optional placement hints (``owner``, ``split``), checked against that shape."""
    dtype = t.str("dtype", max_len=64)
    if not dtypes.is_known(dtype):
        raise t.bad("dtype", f"{dtype!r} is not a dtype this ckptctl knows")
    shape = parse.shape(t.doc.get("shape"), dtypes.itemsize(dtype), lambda why: t.bad("shape", why))
    owner = t.int("owner", hi=MAX_RANKS, default=None)
    split = t.doc.get("split")
    if split is not None:
        if not (isinstance(split, list) and len(split) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in split)
                and 0 <= split[0] < len(shape) and 1 <= split[1] <= parse.INT64_MAX):
            raise t.bad("split", f"{parse.show(split)} is not [dim, block] for shape {list(shape)}")
        split = (split[0], split[1])
    return TensorEntry(dtype, shape, t.str("group", max_len=64), t.int("chunks"), owner, split)
