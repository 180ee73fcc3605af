"""torchtitan and ``torch.distributed.checkpoint`` (DCP): ``ROOT/step-N`` directories.

    ROOT/step-1000/
        __0_0.distcp ... __R_0.distcp   each rank's records
        .metadata                       written last: to .metadata.tmp, fsync, then renamed

Commit rule (torch/distributed/checkpoint/filesystem.py, ``FileSystemWriter.finish``): the
coordinator pickles the global metadata to ``.metadata.tmp`` and renames it to ``.metadata``
after every rank's files are written, so ``.metadata`` present means the save finished;
torchtitan (torchtitan/components/checkpoint.py) names the directories ``step-{step}`` and
itself only resumes from a ``step-N`` holding ``.metadata``. A checkpoint is complete when
``.metadata`` is present and every storage record it lists names a file that is present with
the record's bytes inside it. torchtitan may write its last step as Hugging Face safetensors
instead (``model.safetensors.index.json`` + shards): complete when the index and every shard
it names are present.

A directory of any name holding ``.metadata`` or ``*.distcp`` is DCP's too (``alone_files``:
``dcp.save`` takes any directory), checked the same way when named alone.

``.metadata`` is read with ckptctl's restricted unpickler (``interop.dcp_io.read_metadata``),
and at every level each tensor's chunks must cover it exactly once, each with its record
(``coverage_findings``);
records are test-loaded with ``torch.load(weights_only=True)``, one at a time; a record that
needs a class outside the allow-list (torchtitan's ``train_state`` holds ``io.BytesIO`` values)
is decoded structurally (``pickle_scan``), and one decoded neither way fails the load level.
Resumable or export (``kind_of_checkpoint``): torchtitan saves ``model`` (flattened), ``optimizer``,
``lr_scheduler``, ``dataloader`` and ``train_state`` at every step but its last, which holds
the model only by default (``checkpoint.last_save_model_only``) and which torchtitan's own
resume then refuses (``Missing key ... dataloader``). So a step is an export when ``.metadata``
lists tensors only and none under an optimizer (``optimizer``/``optim``): model weights and
nothing else; anything else a resume reads (optimizer state, or a non-tensor entry such as
``train_state``, ``dataloader`` or a step) makes it resumable. The Hugging Face safetensors
form of the last step is an export.
Weakness: DCP records no checksums, so a flipped bit in a tensor that still decodes is not
seen; ``ckptctl convert --to ckptctl`` gives a checkpoint that has them.
"""

from __future__ import annotations

import io
import os
import re
from typing import Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.layouts import pickle_scan, safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.checked import Checked, Level, Problem
from ckptctl.layouts.stack import StackLayout, finding_in, undetermined
from ckptctl.format.geometry import box, coverage_problems
from ckptctl.format.manifest import Manifest
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import open_file

METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
OPTIMIZER_KEYS = frozenset({"optimizer", "optim", "optimizers"})  # the first component of a key
MAX_NOT_LOADED = 5  # records decoded structurally (or not at all), named one by one


class DcpLayout(StackLayout):
    name = "dcp"
    integration = "`dcp.save(..., storage_writer=ckptctl.integrations.dcp.Writer(path))`"
    title = "torchtitan / torch DCP"
    pattern = re.compile(r"step-([0-9]{1,19})\Z", re.ASCII)
    own_files = re.compile(r"(\.metadata(\.tmp)?|__[0-9]+\.metadata(\.tmp)?|.+\.distcp|"
                           r"model\.safetensors\.index\.json|model-[0-9]+-of-[0-9]+\.safetensors)\Z")
    commit_files = (METADATA, HF_INDEX)
    # ``dcp.save(checkpoint_id=DIR)`` takes any directory: one named alone is still DCP's, by
    # the files only DCP writes (its safetensors form is any Hugging Face export's, so not).
    alone_files = re.compile(r"(\.metadata|.+\.distcp)\Z")

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        size = safe_load.regular_size(ckpt, METADATA)
        if size is not None:
            if size == 0:
                return Examined("corrupt", f"{METADATA} is 0 bytes: its write never finished")
            return Examined("committed")
        if ckpt.stat(METADATA) is not None:
            return Examined("corrupt", f"{METADATA} is not a regular file")
        if safe_load.regular_size(ckpt, HF_INDEX) is not None:
            return _hf_index_state(ckpt)
        return Examined("partial", f"no {METADATA}: DCP writes it last (to {METADATA}.tmp, then renamed), "
                                   "so this save did not finish")

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        if safe_load.regular_size(ckpt, METADATA) is None:
            return
        from ckptctl.interop.dcp_io import read_metadata  # needs torch

        try:
            md = read_metadata(ckpt)  # every record: a plain file here, its bytes inside it
        except InvalidCheckpoint as e:
            out.problems.append(finding_in(ckpt, METADATA, e, e.hint))
            return
        out.problems.extend(coverage_findings(md))
        if level == "load":
            self._load_records(ckpt, md, out)

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        if safe_load.regular_size(ckpt, METADATA) is None:
            if safe_load.regular_size(ckpt, HF_INDEX) is not None:
                return CheckpointKind("export", f"{HF_INDEX}: Hugging Face weights only (torchtitan's last step "
                                                "saved for inference)")
            return undetermined(f"no {METADATA}")
        from ckptctl.interop.dcp_io import read_metadata  # needs torch

        try:
            md = read_metadata(ckpt)
        except InvalidCheckpoint as e:
            return undetermined(f"{METADATA} unreadable ({str(e)[:120]})")
        return metadata_kind(md)

    def _load_records(self, ckpt: Storage, md: object, out: Checked) -> None:
        load_records(ckpt, md, self.allowed, out)

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"torchtitan: --checkpoint.load_step {step} (with --checkpoint.folder its root); "
                                 f"torch: dcp.load(state_dict, checkpoint_id={ckpt_path!r})",
                      ("--checkpoint.load_step", str(step)))


def coverage_findings(md: object) -> list[Problem]:
    """Each tensor's saved chunks must cover it exactly once (``format.geometry``) and each
    chunk must have a storage record: ``read_metadata`` checks every record stays inside its
    file, not that the records add up to the tensors. From ``.metadata`` only, no data read."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    found: list[Problem] = []
    records = getattr(md, "storage_data", None) or {}
    for fqn, meta in (getattr(md, "state_dict_metadata", None) or {}).items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        for gap in coverage_problems(tuple(meta.size), [box(c.offsets, c.sizes) for c in meta.chunks]):
            hint = "a rank's .distcp file or its entries are missing" if gap.kind == "volume" else None
            found.append(Problem(f"tensor {fqn}: {gap.message}", file=METADATA, hint=hint))
        for c in meta.chunks:
            if MetadataIndex(fqn, c.offsets) not in records:
                found.append(Problem(f"tensor {fqn}: chunk at {list(c.offsets)} has no storage record", file=METADATA))
    return found


def metadata_kind(md: object) -> CheckpointKind:
    """Resumable or export from a DCP ``.metadata``'s ``state_dict_metadata`` (its keys and
    whether each entry is a tensor): see the module's docstring."""
    entries = getattr(md, "state_dict_metadata", None) or {}
    beyond: list[str] = []  # the first components of what is more than model weights
    for fqn, entry in entries.items():
        top = str(fqn).split(".", 1)[0]
        is_tensor = type(entry).__name__ == "TensorStorageMetadata"
        if (top in OPTIMIZER_KEYS or not is_tensor) and top not in beyond:
            beyond.append(top)
    if beyond:
        return CheckpointKind("resumable", f"{METADATA} lists {', '.join(beyond[:5])}"
                                           + (f" and {len(beyond) - 5} more" if len(beyond) > 5 else ""))
    return CheckpointKind("export", f"{METADATA} lists {len(entries)} model tensors and no optimizer, dataloader or "
                                    "train_state (torchtitan's model-only last step)")


def optimizer_listed(ckpt: Storage, shown: str, prefix: str, export: str) -> CheckpointKind:
    """Resumable when the DCP ``.metadata`` of ``ckpt`` (``shown`` in the reason) lists a key
    starting with ``prefix`` (megatron-core's sharded optimizer state: Megatron's torch_dist,
    NeMo), else an export (``export`` says why); not told apart when it cannot be read."""
    from ckptctl.interop.dcp_io import read_metadata  # needs torch

    try:
        md = read_metadata(ckpt)
    except InvalidCheckpoint as e:
        return undetermined(f"{shown} unreadable ({str(e)[:120]})")
    keys = getattr(md, "state_dict_metadata", None) or {}
    optim = next((k for k in keys if str(k).startswith(prefix)), None)
    if optim is not None:
        return CheckpointKind("resumable", f"{shown} lists the optimizer state ({str(optim)[:80]}, ...)")
    return CheckpointKind("export", f"{shown} lists no {prefix}* key: {export}")


def load_records(ckpt: Storage, md: object, allowed: Sequence[object], out: Checked) -> None:
    """Decode every storage record of a DCP checkpoint (``md`` checked by ``read_metadata``):
    ``torch.load(weights_only=True)`` of each record's bytes, one at a time; a record that needs
    a class outside ``allowed`` is decoded structurally (``pickle_scan``). A record decoded
    neither way goes to ``out.not_loaded``, which fails the load level.
    Megatron's torch_dist checkpoints are DCP-format and are decoded here too."""
    not_decoded = structural = 0
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        if getattr(info, "transform_descriptors", None):
            # compressed or otherwise transformed bytes: nothing here can decode them
            out.not_loaded.append("records written through a storage transform (compression): not decoded")
            return
        rel = os.fspath(info.relative_path)
        f = open_file(ckpt, rel)  # checked regular by read_metadata; never blocks
        if f is None:
            out.problems.append(Problem(safe_load.NOT_PLAIN, file=rel))
            return
        with f:
            f.seek(info.offset)
            raw = f.read(info.length)
        out.bytes_read += len(raw)
        problem, missed, decoded = _load_bytes(raw, allowed)
        where = f"{rel} (record {getattr(index, 'fqn', '?')})"
        if problem is not None:
            out.problems.append(Problem(problem, file=where))
        elif missed is not None:
            not_decoded += 1
            if not_decoded <= MAX_NOT_LOADED:
                out.not_loaded.append(f"{where}: {missed}")
        elif decoded is not None:
            structural += 1
            if structural <= MAX_NOT_LOADED:
                out.structural.append(f"{where}: {decoded}")
    if not_decoded > MAX_NOT_LOADED:
        out.not_loaded.append(f"... and {not_decoded - MAX_NOT_LOADED} more records not decoded")
    if structural > MAX_NOT_LOADED:
        out.structural.append(f"... and {structural - MAX_NOT_LOADED} more records decoded structurally")


def _load_bytes(raw: bytes, allowed: Sequence[object]) -> tuple[str | None, str | None, str | None]:
    """Decode one DCP record (a ``torch.save`` of a tensor or a value) from its bytes. Returns
    (problem, not_decoded, structural) as ``safe_load.torch_file``. torch's refusal is never
    taken to mean "a class outside the allow-list": a zeroed record is refused the same way, so
    every refused record is decoded structurally, which tells the two apart."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        return None, None, None
    except pickle.UnpicklingError:
        scan = pickle_scan.scan_torch_bytes(raw)
        return (None, *safe_load.structural_text(scan))
    except (RuntimeError, EOFError, ValueError, KeyError, TypeError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return f"does not load: {first}", None, None


def _hf_index_state(ckpt: Storage) -> Examined:
    doc, problem = safe_load.json_file(ckpt, HF_INDEX)
    if problem is not None:
        return Examined("corrupt", f"{HF_INDEX}: {problem}")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return Examined("corrupt", f"{HF_INDEX}: no weight_map")
    for shard in sorted({str(v) for v in weight_map.values()}):
        if "/" in shard or shard in ("", ".", "..") or safe_load.regular_size(ckpt, shard) is None:
            return Examined("corrupt", f"{HF_INDEX} names {shard!r}, which is missing")
    return Examined("committed")
