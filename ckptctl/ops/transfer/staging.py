"""The names of a re-sharding restore's staging copies: hidden scratch directories under the
destination root, one per run.

A ``restore --world-size`` copies the checkpoint (checked on the way) into
``DST/.restore-staging-step-XXXXXXXXXX.<run id>/``, re-shards from there into the step
directory and removes the copy (``ops.transfer.copy``). The name is hidden and is no step
directory, so nothing that lists checkpoints (``ls``, ``latest``, ``load_latest``, prune's
checkpoint rules) ever takes it for one; the run id (a fresh save id) keeps two restores of
one step into one root from ever writing, reading or removing each other's copy. A killed run
leaves its copy behind: ``prune`` deletes it once nothing in it was modified for
``--partial-after`` (``ops.retention.scratch``), and so are the copies older versions named
without a run id (``.restore-staging-step-XXXXXXXXXX``).
"""

from __future__ import annotations

from ckptctl.format.layout import is_save_id, new_save_id, parse_step_dir, step_dir

STAGING_PREFIX = ".restore-staging-"


def new_staging_name(step: int) -> str:
    """A name no other run uses: ``.restore-staging-step-0000000200.0123456789abcdef``."""
    return f"{STAGING_PREFIX}{step_dir(step)}.{new_save_id()}"


def staging_step(name: str) -> int | None:
    """The step of a staging copy named ``name`` (this version's, or an older version's
    without a run id), or None when ``name`` is no restore's staging copy."""
    if not name.startswith(STAGING_PREFIX):
        return None
    rest = name[len(STAGING_PREFIX):]
    step_part, dot, run = rest.partition(".")
    if dot and not is_save_id(run):
        return None
    return parse_step_dir(step_part)
