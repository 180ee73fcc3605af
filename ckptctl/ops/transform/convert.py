"""``convert``: read a checkpoint in any supported format and write it in another, one tensor
at a time.

Input formats, as ``layouts.classify`` finds them at the path (``source_format``):

- ``ckptctl``: a directory with ``manifest.json`` and the ``COMMITTED`` marker (verified first);
- ``dcp``: a directory with ``.metadata`` (PyTorch Distributed Checkpoint);
- ``safetensors``: a ``.safetensors`` file, or a directory with ``model.safetensors.index.json``
  or ``*.safetensors`` files;
- ``torch``: a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, or any zip of that layout),
  loaded only with ``weights_only=True``.

Outputs (``--to``): ``ckptctl`` (one shard, manifest, checksums, marker; verified), ``safetensors``
(one file, or shards plus an index), ``torch`` (one file of nested dicts), ``dcp``.

Names are ckptctl's (``model/fc.weight``, ``optimizer/state/fc.weight/exp_avg``): as they are
in ckptctl and safetensors outputs, as the nesting of dicts in torch and DCP outputs (DCP then
names the entry ``model.fc.weight`` itself; reading DCP joins its recorded nesting with ``/``). Non-tensor state travels as the ckptctl state tree: in the manifest (ckptctl), as JSON
in ``__metadata__`` (safetensors), as the nested dict itself (torch), as a string entry (dcp);
every format can hold it, so nothing is dropped on output. What a source cannot hand over (a
DCP entry that needs pickle, a ckptctl per-rank RNG state going to another format, a Trainer's
``training_args.bin``) is listed in the report's ``dropped``.

A checkpoint whose files no format reader takes whole is read through the file its layout
says holds the model weights (``Layout.model_weights``): a DeepSpeed tag's
``mp_rank_00_model_states.pt`` (``module``: the model; its other keys come along as state), its
ZeRO optimizer partitions listed as dropped.

The step (``interop.steps``): a ckptctl manifest's; otherwise what the source records of itself
(torchtitan's ``train_state`` step, a Hugging Face ``checkpoint-N`` and its
``trainer_state.json`` ``global_step``, Megatron's ``iter_NNNNNNN``, a ``step`` /
``global_step`` / ``iteration`` key of a ``.pt`` or Lightning ``.ckpt``, ckptctl's own step
metadata in an exported file). Records that disagree are refused (InvalidCheckpoint). An
explicit ``step`` (``--step``) wins over every record; the report's ``step_from`` says when the
source disagreed. A ckptctl target needs a step: a source that records none is refused
(UsageError) unless ``step`` is given, never written as step 0. Other targets record the step
where they can (safetensors metadata, a DCP entry) and go without when there is none.

A Hugging Face Trainer checkpoint comes with its training state (``interop.hf_trainer_io``):
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` under ``optimizer/``, ``scheduler/``,
``scaler/``, and ``trainer_state.json``; what is not carried is in ``dropped`` with the reason.
A ckptctl -> ckptctl conversion keeps every rank's per-rank state (RNG generators) in shard
headers of their own, unless ``--only`` or ``--strip-prefix`` reshapes the state.

``--strip-prefix``: ``ops.transform.convert_tree``.

Memory: one buffer of the largest tensor, plus one more of it when ``--dtype`` casts, plus the
source format's own temporaries (a DCP read holds one serialized tensor record).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from ckptctl.errors import UsageError
from ckptctl.format.layout import MARKER
from ckptctl.interop import steps
from ckptctl.interop.base import Source, TensorMeta
from ckptctl.interop.detect import Format, format_named
from ckptctl.interop.sources import open_foreign
from ckptctl.interop.steps import StepClue
from ckptctl.layouts.base import ModelWeights
from ckptctl.layouts.classify import classify
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.ops.transform.convert_target import prepare_dst, refuse_same, write_target
from ckptctl.ops.transform.convert_tree import filter_tree, strip_names, strip_tree, tree_of
from ckptctl.ops.transform.safety import require_verified
from ckptctl.state.buffers import TensorBuffer
from ckptctl.storage import Storage, open_storage
from ckptctl.progress import Progress

CASTS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
         "fp32": "float32", "float32": "float32"}
FLOATING = ("float64", "float32", "float16", "bfloat16")


@dataclass
class ConvertReport:
    src: str
    dst: str
    source_format: str
    target_format: str
    tensors: int = 0
    skipped_by_only: int = 0
    cast: str | None = None
    bytes: int = 0  # tensor bytes written
    step: int | None = None  # the step written (None: the target format got none)
    step_from: str = ""  # where it came from: "trainer_state.json global_step", "--step", ...
    strip_prefix: str | None = None
    renamed: int = 0  # tensors that lost --strip-prefix
    files: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)  # training state carried besides the weights
    dropped: list[str] = field(default_factory=list)
    source_checksums: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class CkptctlSource(Source):
    """A committed ckptctl checkpoint through the shared reader (chunk checksums checked).
    Its per-rank state (RNG generators, data loader positions, in the shard headers) is kept
    in ``rank_states`` for a ckptctl target, the only format that holds it."""

    kind = "ckptctl"
    has_checksums = True

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.url = storage.url
        self.reader = CheckpointReader(storage)
        m = self.reader.manifest
        self.step = m.step
        self.step_clues.append(StepClue(m.step, "manifest"))
        self.world_size = m.world_size
        self.tree = m.state
        self.tensors = {n: TensorMeta(n, t.dtype, tuple(t.shape), t.group) for n, t in m.tensors.items()}
        self.rank_states = {r: s for r, s in self.reader.rank_states().items() if s}

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.reader.read_into(ReadJob(name, out))

    def close(self) -> None:
        self.reader.close()


def source_format(path: str) -> Format:
    """The format convert reads ``path`` as: what ``layouts.classify`` finds there (ckptctl's
    own, DCP, safetensors, torch.save). Raises UsageError naming the path when it is none of
    them, and InvalidCheckpoint for a DCP directory whose save did not finish (no ``.metadata``)."""
    found = classify(path)
    fmt = found.reader_format()
    if fmt == "ckptctl" or (fmt is not None and found.local is not None):
        return fmt
    if found.local is None:
        raise UsageError(f"{path}: only ckptctl checkpoints are read from object storage",
                         hint="copy foreign checkpoints to a local directory first")
    if found.missing:
        raise UsageError(f"{path} does not exist")
    if found.is_dir:
        raise UsageError(f"{path}: no manifest.json (ckptctl), .metadata (DCP) or *.safetensors here",
                         hint="point at the checkpoint directory or file itself")
    raise UsageError(f"{path}: not a .safetensors or torch.save (.pt/.pth/.bin) file")


def open_weights(path: str, weights: ModelWeights) -> Source:
    """The model weights file of the checkpoint at ``path`` as a ``torch`` source (loaded with
    ``weights_only=True`` and the layout's allowed globals), its step from the checkpoint's
    name, and what its layout leaves out listed as dropped."""
    from ckptctl.interop.torch_io import TorchSource

    with torch.serialization.safe_globals(list(weights.allowed)):
        src = TorchSource(os.path.join(path, weights.file))
    src.step_clues.extend(steps.from_name(src.url))
    src.settle_step()
    src.dropped.extend(weights.left_out)
    return src


def open_source(path: str, fmt: Format | None = None) -> Source:
    """The checkpoint at ``path`` as a ``Source``; ``step`` is what every record of it agrees on
    (ckptctl's manifest; another tool's own records and its directory name, ``interop.steps``)."""
    fmt = fmt or source_format(path)
    if fmt != "ckptctl":
        return open_foreign(path, fmt)
    st = open_storage(path)
    if st.stat(MARKER) is None:
        from ckptctl.errors import NotFound

        raise NotFound(f"{st.url}: no {MARKER} marker, so the checkpoint is not committed",
                       hint="it is still being written or its save failed; use a committed checkpoint")
    return CkptctlSource(st)


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise UsageError(f"--max-shard-size {text!r} is not a size", hint="use e.g. 5GB, 500MiB or a number of bytes")
    return int(value * units[unit])


def convert(src_path: str, dst_path: str, to: str, *, only: Sequence[str] = (), dtype: str | None = None,
            max_shard_size: int | None = None, overwrite: bool = False, progress: Progress | None = None,
            step: int | None = None, strip_prefix: str | None = None) -> ConvertReport:
    """Convert the checkpoint at ``src_path`` into ``to`` format at ``dst_path``.

    ``step``: the step to record; it wins over what the source says (the report notes any
    difference). Without it, the source's own records must agree on one step, and a ckptctl
    target refuses a source that records none (UsageError: pass ``step``). ``strip_prefix``:
    see ``ops.transform.convert_tree``; ``only`` prefixes match the names before stripping."""
    t0 = time.perf_counter()
    to = format_named(to)  # the shared vocabulary: a name or an alias (format.formats)
    cast = None
    if dtype is not None:
        cast = CASTS.get(dtype.lower())
        if cast is None:
            raise UsageError(f"--dtype {dtype!r} is not one of bf16, fp16, fp32")
    if max_shard_size is not None and to != "safetensors":
        raise UsageError("--max-shard-size applies to --to safetensors only")
    if to in ("torch", "dcp") and "://" in dst_path and not dst_path.startswith("file://"):
        raise UsageError(f"--to {to} writes local files only, not {dst_path}",
                         hint="write to a local path, or use --to ckptctl or safetensors for object storage")
    weights = classify(src_path).model_weights()  # a DeepSpeed tag: no format reader takes it whole
    src_fmt = "torch" if weights is not None else source_format(src_path)
    refuse_same(src_path, dst_path)
    if src_fmt == "ckptctl":
        require_verified(open_storage(src_path))  # every checksum, before anything is written
    with open_weights(src_path, weights) if weights is not None else open_source(src_path, src_fmt) as src:
        report = ConvertReport(src.url, dst_path, src.kind, to, cast=cast, source_checksums=src.has_checksums,
                               strip_prefix=strip_prefix)
        report.step, report.step_from = steps.decide_step(src.step_clues, step, src.url)
        if report.step is None and to == "ckptctl":
            raise UsageError(f"{src.url}: this {src.kind} checkpoint records no training step, and a ckptctl "
                             "checkpoint needs one (a resume continues from it)",
                             hint="pass --step N, the step it was saved at")
        # Once the step is known: a ckptctl result must not land in another step's directory.
        prepare_dst(src_path, dst_path, to, overwrite, step=report.step or 0)
        keep = [m for n, m in src.tensors.items() if not only or any(n.startswith(p) for p in only)]
        report.skipped_by_only = len(src.tensors) - len(keep)
        if not keep:
            raise UsageError(f"{src.url}: no tensor name starts with {', '.join(only)}",
                             hint="run `ckptctl inspect --tensors` on the checkpoint to see the names")
        tree = filter_tree(src.tree if src.tree is not None else tree_of(list(src.tensors)), {m.name for m in keep}, only)
        new_name = {m.name: m.name for m in keep}
        if strip_prefix is not None:
            new_name = strip_names([m.name for m in keep], strip_prefix)
            tree = strip_tree(tree, strip_prefix, new_name)
            report.renamed = sum(1 for a, b in new_name.items() if a != b)
        orig = {new_name[m.name]: m.name for m in keep}
        out_metas = {new_name[m.name]: _cast_meta(TensorMeta(new_name[m.name], m.dtype, m.shape, m.group), cast) for m in keep}
        report.dropped = list(src.dropped) + list(src.skipped)
        report.carried = list(getattr(src, "carried", []))
        rank_states = _rank_states(src, to, only, strip_prefix, report.dropped)
        scratch = TensorBuffer()

        def fill(meta: TensorMeta, out: torch.Tensor) -> None:
            have = src.tensors[orig[meta.name]]
            if have.dtype == meta.dtype:
                src.read_into(have.name, out)
            else:
                tmp = scratch.view(have.dtype, have.shape)
                src.read_into(have.name, tmp)
                out.copy_(tmp)
            if progress:
                progress(out.numel() * out.element_size())

        files = write_target(to, dst_path, out_metas, fill, tree=tree, step=report.step, metadata=src.metadata,
                             max_shard_size=max_shard_size, source=src, rank_states=rank_states)
        report.files = files
        report.tensors = len(out_metas)
        report.bytes = sum(m.nbytes for m in out_metas.values())
    report.seconds = time.perf_counter() - t0
    return report


def _rank_states(src: Source, to: str, only: Sequence[str], strip_prefix: str | None, dropped: list[str]) -> dict[int, dict]:
    """The per-rank state (RNG) a ckptctl source hands to a ckptctl target, all ranks' as they
    were; what cannot come along is listed in ``dropped`` with the reason."""
    states: dict[int, dict] = getattr(src, "rank_states", {})
    if not states:
        return {}
    if to != "ckptctl":
        why = "only a ckptctl checkpoint holds it"
    elif only:
        why = "left out by --only"
    elif strip_prefix is not None:
        why = "left out by --strip-prefix (its keys name the state before renaming)"
    else:
        return states
    dropped.append(f"per-rank state (RNG) of {len(states)} rank(s) in the shard headers: {why}")
    return {}


def _cast_meta(m: TensorMeta, cast: str | None) -> TensorMeta:
    if cast is None or m.dtype not in FLOATING or m.dtype == cast:
        return m
    return TensorMeta(m.name, cast, m.shape, m.group)
