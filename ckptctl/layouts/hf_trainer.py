"""The Hugging Face ``Trainer``: ``ROOT/checkpoint-N`` directories (its ``output_dir``).

    ROOT/checkpoint-1500/
        model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json
            | pytorch_model.bin (| adapter_model.safetensors for PEFT)
        config.json, generation_config.json, training_args.bin
        optimizer.pt, scheduler.pt, scaler.pt, rng_state.pth | rng_state_R.pth
        trainer_state.json        written last

Commit rule (transformers/trainer.py, ``Trainer._save_checkpoint``): the folder is
``checkpoint-{global_step}``; the model, then optimizer and scheduler, then the RNG state are
saved, and ``trainer_state.json`` (``TrainerState.save_to_json``) after them. So a
``checkpoint-N`` without ``trainer_state.json`` is a save that did not finish (the crash of
transformers#35782 resumes from it anyway), and its ``global_step`` must be N.
``best_model_checkpoint`` in the newest complete checkpoint's ``trainer_state.json`` names the
checkpoint ``Trainer._sorted_checkpoints`` keeps out of rotation; prune protects it the same way.

Files are test-loaded with ``torch.load(weights_only=True)``; ``rng_state*.pth`` holds numpy's
RNG state, allowed explicitly. ``training_args.bin`` is a pickle of ``TrainingArguments`` (or a
subclass: TRL's ``SFTConfig``): never unpickled, decoded structurally at the load level and
named in the report. The Trainer never reads it on resume (``resume_files``), so what is wrong
with it, or with the tokenizer's files, is reported and never makes the checkpoint broken.
Resumable or export (``kind_of_checkpoint``, from file names only): ``_save_checkpoint`` writes the
optimizer (``optimizer.pt``; ``optimizer.bin`` or an ``optimizer_0/`` directory under FSDP, a
``global_stepN/`` directory under DeepSpeed), ``scheduler.pt`` and ``rng_state*.pth`` unless
``save_only_model=True``, which keeps the weights only: without any of them the checkpoint is
an export (``resume_from_checkpoint`` then restarts the optimizer from scratch).
Weakness: trainer_state.json is not written atomically (a plain ``open(..., "w")``); a
truncated one is caught here as unparsable (corrupt), never read as complete.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Iterable, Sequence

from ckptctl.layouts import safe_load
from ckptctl.layouts.base import CheckpointKind, Examined, Resume
from ckptctl.layouts.checked import Checked, Level, Problem
from ckptctl.layouts.file_check import FileKind
from ckptctl.layouts.stack import StackLayout
from ckptctl.format.manifest import MAX_METRIC_NAME, MAX_METRICS, Manifest
from ckptctl.storage.base import Storage

STATE = "trainer_state.json"
ARGS = "training_args.bin"
WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
OPTIMIZER_FILE = re.compile(r"optimizer\.(pt|bin)\Z")
OPTIMIZER_DIR = re.compile(r"(optimizer_[0-9]+|global_step[0-9]+)\Z")  # FSDP's sharded optimizer; DeepSpeed's tag
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class HfTrainerLayout(StackLayout):
    name = "hf-trainer"
    integration = "`ckptctl.integrations.trainer.SealCallback`"
    title = "Hugging Face Trainer"
    pattern = re.compile(r"checkpoint-([0-9]{1,19})\Z", re.ASCII)
    own_files = re.compile(r"(trainer_state\.json|training_args\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt|"
                           r"rng_state(_[0-9]+)?\.pth|config\.json|generation_config\.json|"
                           r"(model|adapter_model)(-[0-9]+-of-[0-9]+)?\.safetensors|"
                           r"pytorch_model(-[0-9]+-of-[0-9]+)?\.bin|.+\.index\.json)\Z")
    # What ``Trainer.train(resume_from_checkpoint=...)`` reads (``_load_from_checkpoint``,
    # ``_load_optimizer_and_scheduler``, ``_load_rng_state``, TrainerState.load_from_json):
    # the state, the config (its version is compared), the weights (or the adapter), the
    # optimizer, scheduler, scaler and RNG states, and what DeepSpeed or FSDP saved beside them.
    # Never ``training_args.bin``, the tokenizer's files, a model card or generation_config.json.
    resume_files = re.compile(r"(trainer_state\.json|config\.json|adapter_config\.json|"
                              r"(model|adapter_model)(-[0-9]+-of-[0-9]+)?\.safetensors|"
                              r"(pytorch_model|adapter_model)(-[0-9]+-of-[0-9]+)?\.bin|"
                              r"(model\.safetensors|pytorch_model\.bin)\.index\.json|optimizer\.(pt|bin)|"
                              r"rank[0-9]+-of-[0-9]+-optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_[0-9]+)?\.pth|"
                              r"(global_step[0-9]+|optimizer_[0-9]+|pytorch_model_fsdp_[0-9]+)/.+)\Z")
    claims_empty = True  # Trainer made the directory and died before writing into it
    commit_files = (STATE,)

    @property
    def allowed(self) -> tuple[object, ...]:  # type: ignore[override]
        return tuple(safe_load.numpy_rng())

    def commit_state(self, ckpt: Storage, step: int | None) -> Examined:
        if ckpt.stat(STATE) is None:
            return Examined("partial", f"no {STATE}: Trainer writes it last, so this save did not finish")
        doc, problem = safe_load.json_file(ckpt, STATE)
        if problem is not None:
            return Examined("corrupt", f"{STATE}: {problem}")
        got = doc.get("global_step") if isinstance(doc, dict) else None
        if not isinstance(got, int) or isinstance(got, bool):
            return Examined("corrupt", f"{STATE} has no integer global_step")
        if step is not None and got != step:
            return Examined("corrupt", f"{STATE} says global_step {got}, the directory says {step}; they must agree")
        return Examined("committed")

    def kind_of(self, rel: str) -> FileKind:
        if rel == ARGS:
            return "pickle"
        return super().kind_of(rel)

    def extra_checks(self, ckpt: Storage, files: Sequence[str], level: Level, out: Checked) -> None:
        names = set(files)
        for index in INDEXES:
            if index in names:
                doc, problem = safe_load.json_file(ckpt, index)
                wm = doc.get("weight_map") if isinstance(doc, dict) else None
                if problem is not None or not isinstance(wm, dict):
                    out.problems.append(Problem(problem or "no weight_map", file=index))
                    continue
                for shard in sorted({str(v) for v in wm.values()} - names):
                    out.problems.append(Problem(f"named by {index} but missing", file=shard,
                                                hint="a weight shard was lost; use an older checkpoint"))
        if not names & set(WEIGHTS) and not names & set(INDEXES):
            out.problems.append(Problem("no model weights (model.safetensors, shards with their index, "
                                        "or pytorch_model.bin)", hint="the save did not write the model"))

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        """The ``best_model_checkpoint`` named by the newest complete checkpoint; every
        checkpoint that might be it when that file does not say it readably."""
        if self.root is None:
            return {}
        done = [n for n, status in entries if status == "committed"]
        for name in sorted(done, key=lambda n: int(self.pattern.match(n).group(1)), reverse=True):  # type: ignore[union-attr]
            doc, problem = safe_load.json_file(self.root, f"{name}/{STATE}")
            best = doc.get("best_model_checkpoint") if isinstance(doc, dict) else None
            if problem is not None or not isinstance(doc, dict) or not isinstance(best, (str, type(None))):
                # Unreadable (rewritten since the catalog read it) or not a path: the best is
                # unknown, so every checkpoint that might be it stays.
                why = (f"Trainer's best_model_checkpoint is unknown: {name}/{STATE} "
                       f"{problem or 'does not hold it as a path'}; kept for safety")
                return {n: why for n, status in entries if status in ("committed", "broken")}
            if best and best.rstrip("/"):
                return {posixpath.basename(best.rstrip("/")): f"Trainer's best_model_checkpoint (in {name}/{STATE})"}
            return {}
        return {}

    def kind_of_checkpoint(self, ckpt: Storage, manifest: Manifest | None = None) -> CheckpointKind:
        for child in ckpt.children():
            if (child.kind == "file" and OPTIMIZER_FILE.match(child.key)) or (
                    child.kind == "dir" and OPTIMIZER_DIR.match(child.key)):
                return CheckpointKind("resumable", f"{child.key} holds the optimizer state")
        return CheckpointKind("export", "no optimizer.pt: model weights only (save_only_model=True)")

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"--resume_from_checkpoint {ckpt_path} (trainer.train(resume_from_checkpoint=...))",
                      ("--resume_from_checkpoint", ckpt_path))

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        """From each checkpoint's own ``trainer_state.json``: every number Trainer logged at its
        ``global_step`` (``log_history``: ``eval_loss``, ``loss``, ...), and ``best_metric``
        given to the checkpoint its ``best_model_checkpoint`` names (the newest such file wins),
        so ``--metric best_metric`` ranks the checkpoints Trainer once called its best. A file
        that cannot be read, or a value that is no finite number, gives no metric."""
        out: dict[str, dict[str, float]] = {}
        for name, step in sorted(checkpoints, key=lambda c: c[1]):  # oldest first: the newest best wins
            doc, problem = safe_load.json_file(root, f"{name}/{STATE}")
            mine = out.setdefault(name, {})
            if problem is not None or not isinstance(doc, dict):
                continue
            history = doc.get("log_history")
            for entry in history if isinstance(history, list) else ():
                if isinstance(entry, dict) and entry.get("step") == step:
                    for key, value in entry.items():
                        if key != "step":
                            _put_metric(mine, key, value)
            best, value = doc.get("best_model_checkpoint"), doc.get("best_metric")
            if isinstance(best, str) and best.rstrip("/") and _finite(value) is not None:
                _put_metric(out.setdefault(posixpath.basename(best.rstrip("/")), {}), "best_metric", value)
        return out


def _finite(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _put_metric(into: dict[str, float], name: object, value: object) -> None:
    # The manifest's bounds on metrics (format.manifest) hold for a Trainer's too: a hostile
    # trainer_state.json cannot make a prune keep thousands of names.
    f = _finite(value)
    if f is None or not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME or not name.isprintable():
        return
    if name in into or len(into) < MAX_METRICS:
        into[name] = f
