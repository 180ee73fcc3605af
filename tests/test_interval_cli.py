"""``ckptctl interval``: the numbers, the stalls taken from a root, and usage errors."""

from __future__ import annotations

import math
import os
import statistics

import pytest

from ckptctl.layouts.native_read import read_committed
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.format.marker import Marker
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints


def set_stats(path: str, **stats: float) -> None:
    """Rewrite a committed checkpoint's save statistics, re-committing it properly."""
    storage = open_storage(path)
    manifest, _ = read_committed(storage)
    manifest.stats.update(stats)
    raw = manifest.to_json()
    storage.write_atomic(MANIFEST, raw)
    storage.write_atomic(MARKER, Marker.for_manifest(manifest.step, raw).to_json())


def test_cost_and_mtbf_give_young_daly_and_waste():
    r = cli("interval", "--cost", "5m", "--mtbf", "24h", "--json")
    assert r.exit_code == 0, r.stderr
    d = r.json()
    assert d["young_s"] == pytest.approx(math.sqrt(2 * 300 * 86400))  # 7200 s
    assert round(d["daly_s"] / 60) == 117  # Daly 2006, fig. 3
    assert 0.05 < d["waste_fraction_daly"] <= d["waste_fraction_young"] < 0.1
    assert d["recommended_s"] == d["daly_s"] and d["warnings"] == [] and d["recorded"] is None
    human = cli("interval", "--cost", "5m", "--mtbf", "24h")
    assert "Young" in human.stdout and "2h" in human.stdout and "1h 57m" in human.stdout
    assert "expected time lost" in human.stdout


@pytest.mark.parametrize("cost, mtbf, seconds", [("90s", "7d", (90, 7 * 86400)), ("15m", "6h", (900, 21600)), ("1h30m", "1w", (5400, 604800))])
def test_duration_forms(cost, mtbf, seconds):
    d = cli("interval", "--cost", cost, "--mtbf", mtbf, "--json").json()
    assert (d["cost_s"], d["mtbf_s"]) == seconds


def test_root_takes_the_cost_from_recorded_stalls(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2, 3, 4])
    for s, stall in zip([1, 2, 3, 4], [4.0, 5.0, 6.0, 600.0]):
        set_stats(ckpt_dir(root, s), stall_s=stall, write_s=20.0)
    d = cli("interval", root, "--mtbf", "24h", "--json").json()
    assert d["cost_s"] == statistics.median([4.0, 5.0, 6.0, 600.0]) and d["cost_from"] == "manifests"
    assert d["recorded"]["steps"] == [4, 3, 2, 1] and d["write_s"] == 20.0
    assert d["young_s"] == pytest.approx(math.sqrt(2 * 5.5 * 86400))
    # an explicit --cost wins; the write time still comes from the root
    d = cli("interval", root, "--mtbf", "24h", "--cost", "1m", "--json").json()
    assert d["cost_s"] == 60 and d["cost_from"] == "option" and d["write_s"] == 20.0
    human = cli("interval", root, "--mtbf", "24h")
    assert "median stall of the 4 newest committed checkpoints" in human.stdout


def test_root_warns_when_the_write_is_longer_than_the_interval(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    for s in (1, 2):
        set_stats(ckpt_dir(root, s), stall_s=1.0, write_s=3600.0)
    r = cli("interval", root, "--mtbf", "1h")
    assert r.exit_code == 0
    assert "warning: the background write (1h) is longer than the interval" in r.stderr
    assert "checkpoint every 1h" in r.stdout


def test_partial_and_broken_checkpoints_are_ignored(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    set_stats(ckpt_dir(root, 1), stall_s=2.0)
    os.unlink(os.path.join(ckpt_dir(root, 2), MARKER))
    d = cli("interval", root, "--mtbf", "1d", "--json").json()
    assert d["recorded"]["steps"] == [1] and d["cost_s"] == 2.0


@pytest.mark.parametrize("args, text", [
    (["--cost", "5m"], "--mtbf is required"),
    (["--mtbf", "24h"], "give --cost DURATION, or a ROOT"),
    (["--cost", "5 minutes", "--mtbf", "1d"], "--cost: invalid duration"),
    (["--cost", "0", "--mtbf", "1d"], "--cost must be a positive duration"),
    (["--cost", "5m", "--mtbf", "-1d"], "--mtbf: invalid duration"),
])
def test_usage_errors_exit_2(args, text):
    r = cli("interval", *args)
    assert r.exit_code == 2 and text in r.stderr and "Traceback" not in r.stderr


def test_root_without_checkpoints_is_a_usage_error(tmp_path):
    r = cli("interval", str(tmp_path), "--mtbf", "1d")
    assert r.exit_code == 2 and "no committed checkpoint records a stall time" in r.stderr and "--cost" in r.stderr
