"""Arguments and environment are validated at the edge (trust issue, cases 9 and 13): a world
size beyond the documented bound, a size that is not a finite positive number of bytes, and a
malformed AWS_* setting are usage errors (exit 2) naming the option or variable, found before
any work is done, for a library user as for the command line.

The runaway cases run the real CLI in a real process under a 2 GiB data limit, so that a
regression fails (MemoryError, exit 3) instead of growing until the machine kills it.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from ckptctl.errors import UsageError
from ckptctl.format.manifest import Manifest
from ckptctl.ops.transform.reshard import plan_layout
from ckptctl.ops.transfer.copy import restore_latest
from ckptctl.settings import MAX_WORLD_SIZE
from ckptctl.storage import open_storage
from helpers import Result, ckpt_dir, cli, make_checkpoints

HUGE = "99999999999999999999999999"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    r = str(tmp_path_factory.mktemp("edge"))
    make_checkpoints(r, [1, 2])
    return r


def _limited(*args: str) -> Result:
    """The CLI in a real process whose data segment is capped at 2 GiB."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))

    p = subprocess.run([sys.executable, "-m", "ckptctl.cli", *args], capture_output=True, text=True,
                       preexec_fn=cap, timeout=300)
    return Result(p.returncode, p.stdout, p.stderr)


def _one_line_naming(r: Result, name: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# --- case 9: world sizes -------------------------------------------------------------------


def test_reshard_to_a_huge_world_size_is_exit_2_before_any_work(root, tmp_path):
    dst = tmp_path / "dst"
    r = _limited("reshard", ckpt_dir(root, 2), str(dst), "-w", HUGE)
    _one_line_naming(r, "--world-size")
    assert "1048576" in r.stderr  # the bound is said
    assert not dst.exists()


def test_restore_to_a_huge_world_size_is_exit_2_before_anything_is_copied(root, tmp_path):
    dst = tmp_path / "dst"
    r = _limited("restore", root, str(dst), "--world-size", HUGE)
    _one_line_naming(r, "--world-size")
    assert not dst.exists() or not os.listdir(dst)


def test_the_world_size_bound_holds_for_library_users(root, tmp_path):
    manifest = Manifest(step=1, created=0.0, world_size=1, files=[], tensors={})
    assert len(plan_layout(manifest, 3)) == 3
    for bad in (0, MAX_WORLD_SIZE + 1, 10**26):
        with pytest.raises(UsageError, match="--world-size"):
            plan_layout(manifest, bad)
    # restore refuses before it copies: a bad world size used to surface only after the copy
    dst = tmp_path / "dst"
    with pytest.raises(UsageError, match="--world-size"):
        restore_latest(open_storage(root), open_storage(str(dst)), world_size=0)
    assert not dst.exists() or not os.listdir(dst)


def test_the_bound_is_in_the_help_and_the_manual():
    for verb in ("reshard", "restore"):
        assert "1048576" in cli(verb, "--help").stdout
        page = open(os.path.join(os.path.dirname(__file__), "..", "man", f"ckptctl-{verb}.1")).read()
        assert "1048576" in page, verb


# --- case 13: sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["1e309", "nan", "inf", "-0", "0", "0.4", "1e-300", "", "5XB", "9" * 5000, "-5GB"])
def test_a_max_shard_size_that_is_no_size_is_exit_2_naming_it(root, tmp_path, size):
    dst = tmp_path / "out"
    r = cli("convert", ckpt_dir(root, 2), str(dst), "--to", "safetensors", "--max-shard-size", size)
    _one_line_naming(r, "--max-shard-size")
    assert len(r.stderr) < 400  # a pasted megabyte is not echoed back
    assert not dst.exists()


def test_a_max_shard_size_in_any_documented_form_still_converts(root, tmp_path):
    for i, size in enumerate(["5GB", "500MiB", "1000", "1.5gb", " 2 GiB ", "1e9"]):
        r = cli("convert", ckpt_dir(root, 2), str(tmp_path / f"out{i}"), "--to", "safetensors", "--max-shard-size", size)
        assert r.exit_code == 0, (size, r.stderr)


# --- case 13: AWS settings --------------------------------------------------------------------


@pytest.mark.parametrize("name, value", [
    ("AWS_MAX_ATTEMPTS", "x"),
    ("AWS_MAX_ATTEMPTS", ""),
    ("AWS_MAX_ATTEMPTS", "0"),
    ("AWS_MAX_ATTEMPTS", "99999999999999999999"),
    ("AWS_RETRY_MODE", "x"),
    ("AWS_ENDPOINT_URL", "garbage"),
    ("AWS_ENDPOINT_URL", "http://[::1"),
    ("AWS_ENDPOINT_URL", "http://host:99999"),
    ("AWS_ENDPOINT_URL_S3", "ftp://host"),
    ("AWS_REQUEST_CHECKSUM_CALCULATION", "sometimes"),
    ("AWS_DEFAULT_REGION", "us east"),
    ("AWS_METADATA_SERVICE_TIMEOUT", "x"),
    ("AWS_DEFAULTS_MODE", "x"),
    ("AWS_PROFILE", "no-such-profile"),
    ("AWS_CA_BUNDLE", "/nonexistent/ca.pem"),
])
def test_a_malformed_aws_setting_is_exit_2_naming_it(s3_url, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    for args in (["ls", s3_url], ["latest", s3_url, "--json"]):
        r = cli(*args)
        _one_line_naming(r, name)
    assert cli("latest", s3_url, "--json").json()["exit"] == 2


def test_a_setting_gone_bad_after_a_client_was_cached_is_still_refused(s3_url, monkeypatch):
    # A client built under good settings is cached per process; a variable set wrong since
    # (and not part of the cache key) must not slip past behind it.
    assert cli("ls", s3_url).exit_code == 0
    for name, value in [("AWS_CA_BUNDLE", "/nonexistent/ca.pem"), ("AWS_DEFAULTS_MODE", "x"),
                        ("AWS_METADATA_SERVICE_TIMEOUT", "x")]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            _one_line_naming(cli("ls", s3_url), name)


def test_a_malformed_aws_config_file_setting_is_exit_2_naming_the_file(s3_url, monkeypatch, tmp_path):
    config = tmp_path / "config"
    config.write_text("[default]\nmax_attempts = many\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    _one_line_naming(cli("ls", s3_url), str(config))


def test_valid_aws_settings_still_work_and_a_bad_one_leaves_local_paths_alone(s3_url, monkeypatch, root):
    for name, value in [("AWS_MAX_ATTEMPTS", " 3 "), ("AWS_RETRY_MODE", "adaptive"), ("AWS_RETRY_MODE", ""),
                        ("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_REQUIRED")]:
        monkeypatch.setenv(name, value)
        assert cli("ls", s3_url).exit_code == 0, (name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "x")
    assert cli("ls", root).exit_code == 0


def test_a_malformed_endpoint_argument_is_a_usage_error_for_library_users(s3_url):
    storage = open_storage(s3_url, endpoint_url="not a url")
    with pytest.raises(UsageError, match="endpoint_url"):
        storage.stat("anything")
