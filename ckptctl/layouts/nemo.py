"""NVIDIA NeMo: checkpoint directories with ``step=N`` in their name, and the
``-unfinished`` markers beside them, in ``log_dir/checkpoints``.

    ROOT/llama--val_loss=1.23-step=199-consumed_samples=1600.0/
        weights/        .metadata, __R_0.distcp, common.pt, metadata.json (megatron-core dist_checkpointing)
        context/        io.json, model.yaml, ...   (NeMo 2: what rebuilds the model and the data)
    ROOT/llama--val_loss=1.23-step=199-consumed_samples=1600.0-last/      save_last: a copy or a symlink
    ROOT/llama--val_loss=1.20-step=399-consumed_samples=3200.0-unfinished  the marker of a save in flight

NeMo 1 distributed checkpoints are the same directories without ``weights/`` (the DCP files
at the top). Built from NeMo's source, not from a run (NeMo does not install beside this
project's torch): nemo/lightning/pytorch/callbacks/model_checkpoint.py (``ModelCheckpoint``;
NeMo 1: nemo/utils/callbacks/nemo_model_checkpoint.py) and nemo/lightning/resume.py
(``AutoResume``), as read from NVIDIA/NeMo at commit 8cfedd7 (2025-09), unverified against a
real run. The names are the recipes' ``{model_name}--{val_loss:.2f}-{step}-{consumed_samples}``
(nemo/collections/llm/recipes/log/default.py) with Lightning's ``metric=value`` insertion.

Commit rule: ``ModelCheckpoint._save_checkpoint`` touches ``NAME-unfinished`` beside the
checkpoint (``format_checkpoint_unfinished_marker_path``: the name without ``.ckpt`` and
``-EMA``) and meets the other ranks at a barrier *before* writing anything; the finalize
callback removes it after a barrier once every rank's save (async included) is done, and the
context is dumped before that. So a directory with its marker is a save that did not finish
(NeMo's own ``setup`` deletes those on the next start). Without the marker, the weights must
hold DCP's ``.metadata`` (written last by DCP): a directory that has no marker and no
``.metadata`` is reported corrupt, never taken for complete or deleted as abandoned.
``AutoResume`` resumes from the newest finished ``*-last`` directory (``_find_trainer_ckpt_path``),
so prune keeps every complete ``-last`` one. Resumable: ``weights/.metadata`` lists an
``optimizer.*`` key; the final save at ``max_steps`` is weights only unless
``save_optim_on_train_end``, an export.

Records are decoded as Megatron's torch_dist ones are (``dcp.load_records``: the same
megatron-core writer); ``common.pt`` is test-loaded with
``torch.load(weights_only=True)``, decoded structurally if it needs more.
Weakness: the commit record is the *absence* of a file beside the checkpoint, so a copy of the
directory without its marker reads as finished; the ``.metadata`` rule is the only guard then.
Directory names without ``step=`` (``{consumed_samples}`` only) and ``.nemo`` archives
(``save_to``: model-only tarballs named without a step) are not listed, so never deleted; a
marker left by a deleted partial stays (NeMo removes it on its next start).
"""

from __future__ import annotations

import argparse
import re
from typing import Iterable, Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.manifest import Manifest
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.checked import Checked, Level, Problem
from ckptctl.layouts.file_check import directory_problem, name_of
from ckptctl.layouts.stack import StackLayout
from ckptctl.storage.base import Storage

NAME = "nemo"
UNFINISHED = "-unfinished"  # ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX
WEIGHTS = "weights"  # nemo/lightning/ckpt_utils.py WEIGHTS_PATH
CONTEXT = "context"  # CONTEXT_PATH
METADATA = ".metadata"
# step=N as Lightning inserts it, never a *.ckpt (Lightning's files, or its sharded directories)
NAME_RE = re.compile(r"(?!.*\.ckpt\Z)(?:.*[^0-9A-Za-z])?step=([0-9]{1,18})(?:[^0-9].*)?\Z", re.ASCII | re.DOTALL)


def marker_of(name: str) -> str:
    """The ``-unfinished`` marker's name for checkpoint directory ``name`` (NeMo's rule)."""
    return name.removesuffix(".ckpt").removesuffix("-EMA") + UNFINISHED


class NemoLayout(StackLayout):
    name = NAME
    title = "NVIDIA NeMo"
    pattern = NAME_RE
    own_files = re.compile(r"(weights|context|\.metadata|common\.pt|metadata\.json|.+\.distcp)\Z")
    commit_files = (f"{WEIGHTS}/{METADATA}", METADATA)

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        return (argparse.Namespace, *safe_load.numpy_rng())

    def _weights(self, ckpt: Storage) -> tuple[Storage, str]:
        """The DCP directory of a checkpoint and its prefix: ``weights/`` (NeMo 2) or itself (NeMo 1)."""
        info = ckpt.stat(WEIGHTS)
        return (ckpt.sub(WEIGHTS), f"{WEIGHTS}/") if info is not None and info.kind == "dir" else (ckpt, "")

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        marker = marker_of(name_of(ckpt))
        if self.root is not None and self.root.stat(marker) is not None:
            return Examined("partial", f"{marker} is beside it: NeMo sets that marker before saving and removes it "
                                       "after every rank's save is done, so this save did not finish")
        weights, prefix = self._weights(ckpt)
        size = safe_load.regular_size(weights, METADATA)
        if size is None:
            return Examined("corrupt", f"no {marker} marker, so NeMo counts it finished, but {prefix}{METADATA} "
                                       "(which DCP writes last) is missing")
        if size == 0:
            return Examined("corrupt", f"{prefix}{METADATA} is 0 bytes: its write never finished")
        return Examined("committed")

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        weights, prefix = self._weights(ckpt)
        for where, sub in ((prefix, weights), (f"{CONTEXT}/", ckpt.sub(CONTEXT))):
            for c in sub.children():  # the names NeMo writes as files that kind_of leaves "other"
                if c.kind == "dir" and c.key.endswith((".yaml", METADATA)):
                    out.problems.append(directory_problem(f"{where}{c.key}"))
        if f"{prefix}{METADATA}" not in files:
            return  # the commit rule said so already
        from ckptctl.interop.dcp_io import read_metadata  # needs torch

        try:
            md = read_metadata(weights)
        except InvalidCheckpoint as e:
            out.problems.append(Problem(str(e), file=f"{prefix}{METADATA}", hint=e.hint))
            return
        if level == "load":
            from ckptctl.layouts.dcp import load_records

            load_records(weights, md, self.allowed, out)

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        from ckptctl.layouts.dcp import optimizer_listed

        weights, prefix = self._weights(ckpt)
        return optimizer_listed(weights, f"{prefix}{METADATA}", "optimizer", "weights only (save_weights_only, "
                                "or the final save without save_optim_on_train_end)")

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {n: "a NeMo -last checkpoint: AutoResume resumes from the newest finished one"
                for n, status in entries if n.endswith("-last") and status in ("committed", "broken", "link")}

    def resume(self, ckpt_path: str, step: int) -> Resume:
        # AutoResume(resume_if_exists=True) takes the newest finished *-last directory, not this
        # one; resume_from_path names exactly this checkpoint.
        return Resume(ckpt_path, f"nl.AutoResume(resume_from_path={ckpt_path!r}) (NeMo 1: "
                                 f"exp_manager.resume_from_checkpoint={ckpt_path})",
                      (f"resume.resume_from_path={ckpt_path}",))
