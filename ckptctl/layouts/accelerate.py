"""Hugging Face Accelerate: the directories ``Accelerator.save_state`` writes.

    ROOT/checkpoint_0/ ... ROOT/checkpoint_7/       automatic_checkpoint_naming=True: ROOT is
                                                    ``project_dir/checkpoints``, N the save count
        model.safetensors | pytorch_model.bin       one per prepared model (model_1.safetensors, ...)
        optimizer.bin, scheduler.bin                one per prepared optimizer / scheduler (_1, ...)
        sampler.bin, dl_state_dict.bin              only for a seedable sampler / stateful loader
        scaler.pt                                   mixed precision only
        random_states_R.pkl                         one per process R: python, numpy, torch RNG
        custom_checkpoint_I.pkl                     one per ``register_for_checkpointing`` object

Explicit ``save_state(output_dir)`` directories are read too when named like accelerate's
examples name them: ``checkpoint_N``, ``step_N``, ``epoch_N`` (accelerate's
examples/complete_nlp_example.py). A ``checkpoint-N`` (hyphen) is the Trainer's name and is
read by that layout: save to an underscore name to have it read as accelerate's.

Commit rule (accelerate/accelerator.py, ``Accelerator.save_state``; accelerate/checkpointing.py,
``save_accelerator_state``): there is no marker and no file written after every process is
done. The main process writes, in this order, the models, optimizers, schedulers, samplers,
the scaler, then its own ``random_states_0.pkl`` (each with a plain ``torch.save`` /
``safetensors`` write in place); every other process writes only its ``random_states_R.pkl``;
the main process then writes the custom objects. So ``random_states_0.pkl``, a whole
``torch.save`` archive, with model weights beside it, is the commit record used here: without
it the save did not finish (the case of a ``save_state`` killed after ``model.safetensors``).
Weakness, said plainly: the other processes' RNG files and the custom objects come with no
commit record at all. A hole in ``random_states_R`` or ``custom_checkpoint_I`` numbering is
caught (the save did not finish); a missing *last* one is caught by ``verify`` only by
comparing with the previous complete save of the root, which must hold no file name this one
lacks (a changed accelerator config, e.g. fewer processes, then fails verify with that
reason). A root's first save has nothing to compare with.

Files are test-loaded with ``torch.load(weights_only=True)`` allowing numpy's RNG state
(``random_states_*.pkl`` are ``torch.save`` archives of python's, numpy's and torch's RNG
state); ``sampler.bin`` pickles accelerate's ``SeedableRandomSampler`` with its dataset and
``custom_checkpoint_*.pkl`` whatever the user's object returns: when torch refuses them they
are decoded structurally (parsed, never unpickled), and fail the load level only when their
stream is broken.
FSDP and DeepSpeed ``save_state`` directories (``pytorch_model_fsdp_0/``, ``pytorch_model/``)
are recognised by name; their contents are checked file by file only.
"""

from __future__ import annotations

import re
from typing import Sequence

from ckptctl.format.manifest import Manifest
from ckptctl.format.seal import SEAL
from ckptctl.layouts import safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, Numbering, Resume
from ckptctl.layouts.checked import Checked, Level, Problem
from ckptctl.layouts.file_check import FileKind, name_of
from ckptctl.layouts.stack import StackLayout
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import open_file

NAME = "accelerate"
RNG0 = "random_states_0.pkl"
RNG = re.compile(r"random_states_([0-9]{1,9})\.pkl\Z")
CUSTOM = re.compile(r"custom_checkpoint_([0-9]{1,9})\.pkl\Z")
# Model weights as save_state writes them: safetensors or torch.save per model, FSDP's and
# DeepSpeed's own sub-directories (their checkpoint engines write inside).
MODEL = re.compile(r"(model(_[0-9]+)?\.safetensors|pytorch_model(_[0-9]+)?\.bin|"
                   r"pytorch_model_fsdp_[0-9]+(\.bin)?|pytorch_model(_[0-9]+)?)\Z")
FILE_SUFFIX = re.compile(r"\.(pkl|bin|pt|safetensors)\Z")  # OWN names save_state writes as files
OPTIMIZER = re.compile(r"(optimizer(_[0-9]+)?\.bin|optimizer_[0-9]+)\Z")
OWN = re.compile(r"(random_states_[0-9]+\.pkl|custom_checkpoint_[0-9]+\.pkl|"
                 r"(optimizer|scheduler|sampler|dl_state_dict)(_[0-9]+)?\.bin|optimizer_[0-9]+|scaler\.pt|"
                 r"model(_[0-9]+)?\.safetensors|pytorch_model(_[0-9]+)?\.bin|pytorch_model_fsdp_[0-9]+(\.bin)?|"
                 r"pytorch_model(_[0-9]+)?)\Z")


class AccelerateLayout(StackLayout):
    name = NAME
    integration = "`ckptctl.integrations.accelerate.seal_saves(accelerator)`"
    title = "Hugging Face Accelerate (save_state)"
    pattern = re.compile(r"(?:checkpoint|step|epoch)_([0-9]{1,19})\Z", re.ASCII)
    own_files = OWN
    commit_files = (RNG0,)  # deleted first: a delete cut short leaves a partial, never a "complete" one

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        return tuple(safe_load.numpy_rng())

    def numbered_by(self, name: str) -> Numbering:
        # The ``step`` in random_states_0.pkl is the gradient accumulation counter, reset every
        # epoch: accelerate records no training step, so checkpoint_N (automatic naming: N is
        # ``ProjectConfiguration.iteration``, one more per save) stays a save index.
        if name.startswith("checkpoint_"):
            return "save index"
        return "epoch" if name.startswith("epoch_") else "step"

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        if not names:
            # automatic naming makes checkpoint_N, waits for every process, then writes into it:
            # an empty one is a save that died there. step_N / epoch_N are the user's names.
            return name_of(ckpt).startswith("checkpoint_")
        return any(OWN.match(n) for n in names)

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        children = ckpt.children()
        names = {c.key for c in children}
        for c in children:  # save_state writes files under file names, directories (FSDP, DeepSpeed) under bare ones
            if OWN.match(c.key) and (c.kind == "file") != bool(FILE_SUFFIX.search(c.key)):
                return Examined("corrupt", f"{c.key} is a {c.kind}, which save_state never writes under that name")
        if RNG0 not in names:
            return Examined("partial", f"no {RNG0}: accelerate's save_state writes it after the model, optimizer, "
                                       "scheduler and sampler files, so this save did not finish")
        f = open_file(ckpt, RNG0)
        if f is None:
            return Examined("corrupt", f"{RNG0} is not a regular file")
        with f:
            if f.size == 0:
                return Examined("partial", f"{RNG0} is 0 bytes: save_state's last write did not finish")
            head = f.read(4)
            legacy = head[:2] == b"\x80\x02"  # a bare pickle (torch.save of old accelerate versions)
            if not legacy and head != b"PK\x03\x04":
                # A cut write still starts as torch.save starts its archive: this one never did.
                return Examined("corrupt", f"{RNG0} is neither a torch.save archive nor a legacy torch.save pickle "
                                           f"(it starts with {head.hex()}): not what save_state writes")
            ended = None if legacy else safe_load.archive_end_of(f)
            if ended is not None and ended[0] == "partial":
                return Examined("partial", f"{RNG0} is not a whole torch.save archive (no zip directory at its end): "
                                           "save_state's last write did not finish")
            if ended is not None:
                return Examined("corrupt", f"{RNG0}: {ended[1]}")
        if not any(MODEL.match(n) for n in names):
            return Examined("corrupt", f"{RNG0} is there but no model weights (model.safetensors or pytorch_model.bin), "
                                       "which save_state writes first")
        for what, rx in (("random_states", RNG), ("custom_checkpoint", CUSTOM)):
            have = {int(m.group(1)) for n in names if (m := rx.match(n))}
            if have and max(have) + 1 != len(have):
                # the first few missing numbers, found without walking up to a hostile maximum
                holes = [i for i in range(min(max(have), len(have) + 5)) if i not in have][:5]
                return Examined("partial", f"{what}_{{{','.join(map(str, holes))}}}.pkl missing while "
                                           f"{what}_{max(have)}.pkl is there: a process's save did not finish")
        return Examined("committed")

    def kind_of(self, rel: str) -> FileKind:
        if rel.endswith(".pkl") or rel == "scaler.pt":
            return "torch"  # torch.save archives despite the suffix (checkpointing.py)
        return super().kind_of(rel)

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        own = {f for f in files if "/" not in f and OWN.match(f) and not MODEL.match(f)}
        before = self._previous(ckpt)
        if before is None:
            return
        prev, their = before
        for missing in sorted(their - own - {RNG0}):  # RNG0's absence is the commit rule's to say
            out.problems.append(Problem(
                f"missing, though {prev} (the previous complete save_state of this root) has it: save_state writes "
                "every such file for the accelerator's config, so this save did not finish",
                file=missing, hint=f"resume from {prev}; if the job's config changed since (fewer processes, no "
                                   "scheduler), this save cannot be told complete"))

    def _previous(self, ckpt: Storage) -> tuple[str, set[str]] | None:
        """The newest complete save of the same naming below this one under the root, and its
        own file names (models left out: safe_serialization may change); None when none."""
        me = name_of(ckpt)
        step = self.step_in_name(me)
        if self.root is None or step is None:
            return None
        prefix = me[: me.rindex("_") + 1]
        older = sorted(((s, c.key) for c in self.root.children()
                        if c.kind == "dir" and c.key.startswith(prefix) and (s := self.step_in_name(c.key)) is not None
                        and s < step), reverse=True)
        for _s, name in older:
            sub = self.root.sub(name)
            if self.commit_state(sub, _s).status == "committed":
                return name, {c.key for c in sub.children() if OWN.match(c.key) and not MODEL.match(c.key)} - {SEAL}
        return None

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        names = sorted(c.key for c in ckpt.children())
        optim = [n for n in names if OPTIMIZER.match(n)]
        if optim:
            return CheckpointKind("resumable", f"holds {', '.join(optim[:3])}")
        return CheckpointKind("export", "no optimizer*.bin: save_state of a model without a prepared optimizer")

    def resume(self, ckpt_path: str, step: int) -> Resume:
        # load_state() without a path picks the highest-numbered folder, complete or not; with
        # the path it loads exactly this one. accelerate's examples take it as --resume_from_checkpoint.
        return Resume(ckpt_path, f"accelerator.load_state({ckpt_path!r}) (accelerate's examples: "
                                 "--resume_from_checkpoint PATH)", ("--resume_from_checkpoint", ckpt_path))
