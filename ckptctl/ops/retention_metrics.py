"""The metrics retention ranks checkpoints by (``KeepBest``), read without loading any data.

* ckptctl's own checkpoints: the manifest's ``metrics``, what ``save(step, state,
  metrics=...)`` recorded (validated by ``format.manifest``; absent in older manifests).
* Hugging Face Trainer checkpoints (``checkpoint-N``): from that checkpoint's own
  ``trainer_state.json``, every number Trainer logged at its ``global_step`` (``log_history``
  entries of that step: ``eval_loss``, ``eval_accuracy``, ``loss``, ...), and ``best_metric``,
  Trainer's value of ``metric_for_best_model``, given to the checkpoint its
  ``best_model_checkpoint`` names (the newest ``trainer_state.json`` naming it wins). So
  ``--metric eval_loss`` ranks every evaluated checkpoint, and ``--metric best_metric`` ranks
  the checkpoints Trainer once called its best (the current best is protected anyway).

A file that cannot be read, or a value that is not a finite number, gives no metric: the
checkpoint then lacks it, which ``KeepBest`` never takes as a reason to delete. Other stacks
record no metrics ckptctl reads.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Iterable
from typing import Any

from ckptctl.format.manifest import MAX_METRIC_NAME, MAX_METRICS
from ckptctl.layouts import safe_load
from ckptctl.storage.base import Storage

__all__ = ["hf_trainer_metrics"]

TRAINER_STATE = "trainer_state.json"  # Trainer writes it last (layouts.hf_trainer)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _put(into: dict[str, float], name: Any, value: Any) -> None:
    f = _number(value)
    if f is None or not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME or not name.isprintable():
        return
    if name in into or len(into) < MAX_METRICS:
        into[name] = f


def hf_trainer_metrics(root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
    """Metrics of each committed Trainer checkpoint ``(name, step)`` under ``root``, by name,
    on every backend."""
    out: dict[str, dict[str, float]] = {}
    for name, step in sorted(checkpoints, key=lambda c: c[1]):  # oldest first: the newest best wins
        doc, problem = safe_load.json_file(root, f"{name}/{TRAINER_STATE}")
        mine = out.setdefault(name, {})
        if problem is not None or not isinstance(doc, dict):
            continue
        history = doc.get("log_history")
        for entry in history if isinstance(history, list) else ():
            if isinstance(entry, dict) and entry.get("step") == step:
                for key, value in entry.items():
                    if key != "step":
                        _put(mine, key, value)
        best, value = doc.get("best_model_checkpoint"), doc.get("best_metric")
        if isinstance(best, str) and best.rstrip("/") and _number(value) is not None:
            named = posixpath.basename(best.rstrip("/"))
            _put(out.setdefault(named, {}), "best_metric", value)
    return out
