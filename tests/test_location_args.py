"""Location arguments that cannot name a location are usage errors (exit 2) naming the
argument, before any storage is touched (ckptctl/cli/locations.py). Each case here is one the
option fuzz (tests/test_option_fuzz.py) found ending in exit 3 or a traceback."""

from __future__ import annotations

import os

import pytest

from ckptctl.errors import StorageError, UsageError
from ckptctl.ops.transform.convert import convert
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    r = str(tmp_path_factory.mktemp("locations"))
    make_checkpoints(r, [1, 2], size=64)
    return r


def _writers(ckpt: str, root: str, dst: str) -> list[list[str]]:
    """Every verb that writes a DST, given ``dst``."""
    return [["cp", ckpt, dst], ["restore", root, dst], ["reshard", ckpt, dst, "-w", "2"], ["sync", root, dst],
            *(["convert", ckpt, dst, "--to", to] for to in ("ckptctl", "safetensors", "torch", "dcp"))]


def _usage_error_naming(args: list[str], *words: str) -> None:
    r = cli(*args)
    assert r.exit_code == 2, (args, r.exit_code, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    for word in words:
        assert word in r.stderr, (args, r.stderr)


def test_a_destination_below_a_file_is_a_usage_error(root, tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("not a directory\n")
    for dst in (str(plain / "out"), "/dev/null/x"):
        for args in _writers(ckpt_dir(root, 2), root, dst):
            _usage_error_naming(args, "DST", "is not a directory")
    assert plain.read_text() == "not a directory\n"


def test_a_destination_that_is_a_file_is_a_usage_error_where_a_directory_is_written(root, tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("not a directory\n")
    for args in _writers(ckpt_dir(root, 2), root, str(plain)):
        if args[-1] in ("torch", "safetensors"):
            continue  # these write a file: an existing one is refused without --overwrite (exit 1)
        _usage_error_naming(args, "DST", "is a file")
    assert plain.read_text() == "not a directory\n"


def test_empty_nul_and_overlong_locations_are_usage_errors(root, tmp_path):
    ckpt = ckpt_dir(root, 2)
    for dst, words in [("", ["DST is empty"]), (" ", ["DST is empty"]), (str(tmp_path / "a\x00b"), ["NUL"]),
                       (str(tmp_path / ("n" * 256)), ["too long"])]:
        for args in _writers(ckpt, root, dst):
            _usage_error_naming(args, *words)
    _usage_error_naming(["ls", root + "\x00"], "ROOT", "NUL")
    _usage_error_naming(["rm", ckpt, "\x00", "--yes"], "CKPT", "NUL")
    assert os.path.exists(os.path.join(ckpt, "COMMITTED"))  # rm refused before deleting anything


def test_a_bucket_name_botocore_refuses_is_a_usage_error(s3_url, root):
    for args in (["ls", "s3://Bad_Bucket!/x"], ["latest", "s3://a b/x"], ["cp", ckpt_dir(root, 2), "s3://Bad_Bucket!/x"]):
        _usage_error_naming(args, "is not a bucket name")


def test_undecodable_bytes_in_a_path_are_printed_back_as_they_came(root, tmp_path):
    # A real argv decodes bytes that are not UTF-8 to surrogates; printing them on a strict
    # UTF-8 stdout failed with UnicodeEncodeError (exit 3) after the copy was made.
    dst = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"\xff\xfe"))
    r = cli("cp", ckpt_dir(root, 2), dst)
    assert r.exit_code == 0, r.stderr
    assert os.path.isdir(os.path.join(os.fsencode(str(tmp_path)), b"\xff\xfe", b"step-0000000002"))


def test_library_callers_get_typed_errors_too(root):
    with pytest.raises(UsageError, match="NUL"):
        open_storage("/tmp/a\x00b")
    # DCP wraps a write failure in a BaseException, which escaped every handler as a traceback.
    with pytest.raises(StorageError, match="/dev/null/x"):
        convert(ckpt_dir(root, 2), "/dev/null/x", "dcp")
