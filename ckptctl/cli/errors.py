"""The one table that turns library errors into a message and an exit code.

Each error class already knows its exit code (ckptctl.errors); this table adds the short label
a person sees first. The most specific class wins.
"""

from __future__ import annotations

from ckptctl import errors as e

LABELS: list[tuple[type[e.CkptError], str]] = [
    (e.LockHeld, "locked"),
    (e.CoordinationError, "ranks disagree"),
    (e.StorageError, "storage error"),
    (e.OperationalError, "operational error"),
    (e.StateError, "state mismatch"),
    (e.UsageError, "usage error"),
    (e.RefusedForSafety, "refused"),
    (e.NoValidCheckpoint, "no valid checkpoint"),
    (e.SaveFailed, "save failed"),
    (e.NotFound, "not found"),
    (e.InvalidCheckpoint, "invalid checkpoint"),
    (e.CkptError, "error"),
]


def describe(err: e.CkptError) -> tuple[str, int]:
    """``("invalid checkpoint: /x/step-1: ... (hint: ...)", 1)``."""
    label = next(lbl for cls, lbl in LABELS if isinstance(err, cls))
    text = f"{label}: {err}"
    if err.hint:
        text += f" (hint: {err.hint})"
    return text, err.exit_code
