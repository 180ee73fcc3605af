"""Which copy ``load_latest`` reads across tiers: for one step the nearest tier, whatever the
number of tiers; a step missing from the first tier comes from the next."""

from __future__ import annotations

import shutil

from helpers import ckpt_dir, make_checkpoints

from ckptctl.storage import open_storage
from ckptctl.tiers.recovery import committed_across


def test_the_nearest_tier_comes_first_for_each_step(tmp_path) -> None:
    roots = [str(tmp_path / f"tier{k}") for k in range(3)]
    for root in roots:  # every tier holds steps 1 and 2; only the last holds step 3
        make_checkpoints(root, [1, 2])
    make_checkpoints(str(tmp_path / "extra"), [3])
    shutil.copytree(ckpt_dir(str(tmp_path / "extra"), 3), ckpt_dir(roots[2], 3))
    got = [(tier, name) for tier, name in committed_across([open_storage(r) for r in roots])]
    names = [name for _, name in got]
    assert names[0].endswith("3") and got[0][0] == 2, got  # newest step first, from where it is
    # Steps 2 and 1: each from tier 0 first, then 1, then 2 (a late-bound index once tagged
    # every candidate with the last tier, so resumes read S3 while local disk held the step).
    assert [tier for tier, _ in got[1:4]] == [0, 1, 2] and [tier for tier, _ in got[4:]] == [0, 1, 2], got


def test_a_step_lost_on_the_first_tier_comes_from_the_next(tmp_path) -> None:
    first, second = str(tmp_path / "nvme"), str(tmp_path / "s3-like")
    make_checkpoints(first, [1, 2])
    make_checkpoints(second, [1, 2])
    shutil.rmtree(ckpt_dir(first, 2))
    got = list(committed_across([open_storage(first), open_storage(second)]))
    assert [t for t, _ in got] == [1, 0, 1], got
