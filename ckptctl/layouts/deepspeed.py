"""DeepSpeed: ``ROOT/global_stepN`` directories (the default tag) and the ``latest`` file.

    ROOT/latest                                         the tag of the newest save
    ROOT/global_step1000/
        mp_rank_00_model_states.pt                      (ZeRO-3: zero_pp_rank_D_mp_rank_00_model_states.pt)
        [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   one per data-parallel rank (ZeRO)

Commit rule (deepspeed/runtime/engine.py, ``DeepSpeedEngine.save_checkpoint``): the tag
defaults to ``global_step{global_steps}``; every rank writes its model and optimizer state
files, then rank 0 writes the tag into ``ROOT/latest`` (``save_latest``), and only after that
do the ranks meet at the final barrier. ``load_checkpoint(ROOT)`` reads ``latest``. So a tag
is complete when it is at or below the tag ``latest`` names and its model-state files are
present; a tag newer than ``latest`` is a save that did not finish. ``latest``'s target is
never deleted by prune.

Resumable or export (``kind_of_checkpoint``): ``save_checkpoint`` writes the optimizer into
``*_optim_states.pt`` under ZeRO, into ``mp_rank_00_model_states.pt``'s ``optimizer`` otherwise;
a tag with neither (an engine without an optimizer) is an export. A model-states file that
cannot be read safely says nothing and counts as resumable (verify judges it).

Weakness, said plainly: ``latest`` is written *before* the final barrier, so when rank 0 is
fast and another rank dies, ``latest`` names a tag whose other files are missing or 0 bytes
(diffusion-pipe#159). That is why every file must also be present, non-empty and pass its
CRC-32 checks (``verify``), and why ``latest`` (the command) checks them before answering.
A root without ``latest`` has no commit record at all: its tags are reported as broken (never
deleted as "abandoned"). Optimizer-states files hold DeepSpeed classes (``ZeroStageEnum``,
``LossScaler``) that torch's weights-only loader does not build: their pickles are decoded
structurally (parsed, never run); ``fragment_address`` is built as a ``SimpleNamespace``
(``FRAGMENT_ADDRESS``), so most of them test-load.
"""

from __future__ import annotations

import argparse
import copy
import os
import posixpath
import re
import types
from typing import Iterable, Sequence

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, ModelWeights, Resume
from ckptctl.layouts.checked import Checked, Level, Problem
from ckptctl.layouts.file_check import name_of
from ckptctl.layouts.stack import StackLayout, optimizer_in_file, undetermined
from ckptctl.format.manifest import Manifest
from ckptctl.layouts.files import local_path_of
from ckptctl.layouts.inspected import ForeignInspect
from ckptctl.storage.base import Storage

LATEST = "latest"
# ``deepspeed.utils.tensor_fragment.fragment_address``: a two-int dataclass (``numel``,
# ``start``), in every ZeRO-1/2 and bf16 optimizer-states file: ``state_dict()`` of
# deepspeed/runtime/zero/stage_1_and_2.py (and runtime/bf16_optimizer.py) saves
# ``param_slice_mappings``, one per parameter. It pickles as NEWOBJ + BUILD of a plain
# ``__dict__`` (no ``__setstate__``, no ``__reduce__``), so nothing runs when one is built: here
# torch's weights-only unpickler builds a ``SimpleNamespace`` in its place (attributes only),
# the files test-load. Found on real DeepSpeed 0.19
# files (tests/test_deepspeed_megatron.py).
FRAGMENT_ADDRESS = ((types.SimpleNamespace, "deepspeed.utils.tensor_fragment.fragment_address"),)
MODEL = re.compile(r"(zero_pp_rank_[0-9]+_)?mp_rank_[0-9]{2}_model_states\.pt\Z")
OPTIM = re.compile(r"(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]{2})_optim_states\.pt\Z")


class DeepSpeedLayout(StackLayout):
    name = "deepspeed"
    title = "DeepSpeed"
    pattern = re.compile(r"global_step([0-9]{1,19})\Z", re.ASCII)
    own_files = re.compile(r"((zero_pp_rank_[0-9]+_)?mp_rank_[0-9]{2}_model_states\.pt|"
                           r"(bf16_)?zero_pp_rank_[0-9]+_mp_rank_[0-9]{2}_optim_states\.pt|"
                           r"layer_[0-9]+-model_[0-9]+-model_states\.pt)\Z")
    claims_empty = True
    pointer_file = LATEST
    commit_files = ("mp_rank_00_model_states.pt",)

    def __init__(self) -> None:
        super().__init__()
        self.latest: str | None = None
        self.latest_problem: str | None = f"no `{LATEST}` file at the root"

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        return (argparse.Namespace, *FRAGMENT_ADDRESS, *safe_load.numpy_rng())

    def read_root(self, root: Storage) -> None:
        text = safe_load.read_pointer(root, LATEST, 256)
        if text is None:
            self.latest, self.latest_problem = None, f"no `{LATEST}` file at the root: DeepSpeed's commit record is missing"
            return
        if text and "/" not in text and text not in (".", ".."):
            self.latest, self.latest_problem = text, None
        else:
            self.latest, self.latest_problem = None, f"`{LATEST}` holds {text[:40]!r}, not a tag"

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        if self.latest is None:
            return Examined("corrupt", f"{self.latest_problem}; left alone, not taken for an abandoned save")
        tag = name_of(ckpt)
        m = self.pattern.match(self.latest)
        if tag != self.latest and (m is None or step is None or step > int(m.group(1))):
            return Examined("partial", f"newer than the tag `{LATEST}` names ({self.latest}): DeepSpeed writes it after "
                                       "the files, so this save did not finish")
        names = [c.key for c in ckpt.children()]
        if not any(MODEL.match(n) for n in names):
            return Examined("corrupt", "no *model_states.pt file although `latest` covers this tag")
        return Examined("committed")

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        ranks: dict[str, set[int]] = {}
        for rel in files:
            m = OPTIM.match(rel)
            if m is not None:
                ranks.setdefault(m.group(3), set()).add(int(m.group(2)))
        for mp, dps in sorted(ranks.items()):
            missing = sorted(set(range(max(dps) + 1)) - dps)
            if missing:
                out.problems.append(Problem(f"optimizer states of data-parallel rank(s) {missing} (mp_rank {mp}) are missing",
                                            hint="a rank's save did not finish; use an older tag"))

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        names = sorted(c.key for c in ckpt.children())
        optim = [n for n in names if OPTIM.match(n)]
        if optim:
            return CheckpointKind("resumable", f"{optim[0]} holds the optimizer state (ZeRO)")
        model = next((n for n in names if MODEL.match(n)), None)
        if model is None:
            return undetermined("no *model_states.pt")
        return optimizer_in_file(ckpt, model, self.allowed, f"no *_optim_states.pt and no optimizer in {model}: "
                                                           "model weights only")

    def model_weights(self, ckpt: Storage) -> ModelWeights:
        """``mp_rank_00_model_states.pt``: its ``module`` is the whole model's state dict under
        ZeRO-0/1/2 (and its ``optimizer`` the optimizer's without ZeRO). Under ZeRO-3, pipeline
        or tensor parallelism no one file holds the model: a UsageError naming DeepSpeed's
        own consolidation, whose output convert then reads."""
        names = sorted(c.key for c in ckpt.children() if c.kind == "file")
        models = [n for n in names if MODEL.match(n)]
        whole = "`python ROOT/zero_to_fp32.py ROOT OUT` (DeepSpeed writes it beside its tags) consolidates the weights"
        if not models:
            raise InvalidCheckpoint(f"{ckpt.url}: no *model_states.pt, which every rank's save writes first",
                                    hint="the save did not finish: convert an older tag (`ckptctl ls ROOT`)")
        if any(n.startswith("zero_pp_rank_") for n in models):
            raise UsageError(f"{ckpt.url}: a ZeRO-3 tag; its weights are partitioned across the optimizer states "
                             "of every rank, no one file holds them", hint=f"{whole}; convert that output")
        if any(n.startswith("layer_") for n in names) or models != [self.commit_files[0]]:
            raise UsageError(f"{ckpt.url}: a pipeline or tensor parallel tag ({len(models)} model states files"
                             f"{', and layer_* files' if any(n.startswith('layer_') for n in names) else ''}); "
                             "convert reads a model held whole in mp_rank_00_model_states.pt",
                             hint=f"{whole}; convert that output")
        optim = [n for n in names if OPTIM.match(n)]
        return ModelWeights(models[0], self.allowed, tuple(
            f"{n}: rank {OPTIM.match(n).group(2)}'s ZeRO optimizer partition (fp32 master weights, Adam state), "  # type: ignore[union-attr]
            "not converted: DeepSpeed's own classes, never unpickled; resume from the tag itself" for n in optim))

    def inspect(self, ckpt: Storage, *, tensors: bool = False) -> ForeignInspect:
        """The model states files read as ``torch.save`` files (their tensors under ``module``
        are the model); the ZeRO optimizer partitions counted by their tensor records, never
        unpickled (they hold DeepSpeed's own classes, ``LossScaler``)."""
        import torch

        from ckptctl.interop import torch_zip
        from ckptctl.interop.torch_io import TorchSource

        path = local_path_of(ckpt, "inspect", "a DeepSpeed checkpoint")
        names = sorted(c.key for c in ckpt.children() if c.kind == "file")
        groups = {"model": 0, "optimizer": 0, "other": 0}
        shown: list[dict] = []
        keys: set[str] = set()
        step: int | None = None
        count = 0
        for name in (n for n in names if MODEL.match(n)):
            with torch.serialization.safe_globals(list(self.allowed)), TorchSource(posixpath.join(path, name)) as src:
                src.settle_step()
                step = step if step is not None else src.step
                keys.update(src.tree if isinstance(src.tree, dict) else ())
                for m in src.tensors.values():
                    groups[m.group] = groups.get(m.group, 0) + m.nbytes
                    count += 1
                    if tensors:
                        shown.append({"name": m.name, "dtype": m.dtype, "shape": list(m.shape), "bytes": m.nbytes,
                                      "group": m.group, "file": name})
        optim = [n for n in names if OPTIM.match(n)]
        for name in optim:
            with open(posixpath.join(path, name), "rb") as f:  # the zip directory only
                records = [m for m in torch_zip.members(f, os.fstat(f.fileno()).st_size) if "/data/" in m.name]
            groups["optimizer"] += sum(m.size for m in records)
            count += len(records)
        m = self.pattern.match(name_of(ckpt))
        kind = self.kind_of_checkpoint(ckpt)
        return ForeignInspect(
            url=ckpt.url, format="deepspeed", step=step if step is not None else int(m.group(1)) if m else None,
            tensor_count=count, total_bytes=sum(c.size for c in ckpt.children() if c.kind == "file"),
            bytes_by_group=groups, state_keys=sorted(keys), metadata={"optimizer": (
                f"ZeRO partitions in {len(optim)} file(s), counted by their tensor records (never unpickled)")} if optim else {},
            dropped=[], tensors=shown, content=kind.kind, content_reason=kind.reason)

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {} if self.latest is None else {self.latest: f"`{LATEST}` names it (load_checkpoint resumes from it)"}

    def pointer_for(self, name: str, step: int) -> tuple[str, bytes] | None:
        return LATEST, name.encode("utf-8")  # as save_latest writes it: the tag, no newline

    def pointer_step(self, raw: bytes) -> int | None:
        m = self.pattern.match(raw[:256].decode("utf-8", "replace").strip())
        return int(m.group(1)) if m is not None else None

    def assuming_pointer(self, name: str, step: int) -> "DeepSpeedLayout":
        current = self.pointer_step(self.latest.encode()) if self.latest is not None else None
        if current is not None and current >= step:
            return self
        bound = copy.copy(self)
        bound.latest, bound.latest_problem = name, None
        return bound

    def pointer_target(self) -> tuple[str, str, int | None] | None:
        if self.latest is None:
            return None
        m = self.pattern.match(self.latest)
        return LATEST, self.latest, (int(m.group(1)) if m is not None else None)

    def resume(self, ckpt_path: str, step: int) -> Resume:
        # DeepSpeed has no command line of its own: the arguments map to
        # ``engine.load_checkpoint(load_dir, tag=tag)``, whose default (no tag) reads ``latest``.
        # So the root resumes exactly this tag only while ``latest`` names it.
        root, tag = posixpath.split(ckpt_path.rstrip("/"))
        exact = self.latest == tag
        return Resume(root, f"engine.load_checkpoint({root!r}, tag={tag!r})", ("--load_dir", root, "--tag", tag),
                      exact, None if exact else f"{LATEST} names {self.latest!r}")

