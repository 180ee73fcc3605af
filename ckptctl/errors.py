"""The exception tree. Every error knows its exit code and a hint that says what to do next.

Exit codes are part of the contract (``man/ckptctl.1``, EXIT STATUS): 0 success; 1 a checkpoint
problem was found or the tool refused for safety; 2 usage error; 3 operational error (storage,
permissions, locks).
The CLI maps these classes to messages in one table (``ckptctl.cli.errors``); library users catch
them by class.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECKPOINT = 1
EXIT_USAGE = 2
EXIT_OPERATIONAL = 3


class CkptError(Exception):
    """Base class. ``str(err)`` is one line naming what failed; ``hint`` says how to fix it."""

    exit_code: int = EXIT_CHECKPOINT

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


# --- 1: the checkpoint is bad, or the tool refused for safety -------------------------------


class CheckpointError(CkptError):
    """A checkpoint is missing, incomplete or corrupt."""


class NotFound(CheckpointError):
    """A file, object or checkpoint that should exist does not."""


class InvalidCheckpoint(CheckpointError):
    """A checkpoint failed validation: bad manifest, marker, header, checksum or path."""


class NoValidCheckpoint(CheckpointError):
    """Nothing under a root is committed and verifies."""


class SaveFailed(CheckpointError):
    """A background save did not commit. ``__cause__`` holds the underlying error."""


class RefusedForSafety(CkptError):
    """The tool would not act because acting could lose data."""


# --- 2: the caller asked for something that cannot be done ----------------------------------


class UsageError(CkptError):
    """Bad arguments or options."""

    exit_code = EXIT_USAGE


class StateError(UsageError):
    """The state passed to save/load cannot be saved or does not match the checkpoint."""


# --- 3: the environment failed ---------------------------------------------------------------


class OperationalError(CkptError):
    """Storage unreachable, permission denied, disk full, lock held, timeout."""

    exit_code = EXIT_OPERATIONAL


class StorageError(OperationalError):
    """A storage backend failed for a reason outside the checkpoint's contents."""


class LockHeld(OperationalError):
    """Another run holds the lock under the root."""


class CoordinationError(OperationalError):
    """Ranks could not agree (a rank failed or timed out)."""
