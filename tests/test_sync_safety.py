"""``sync --delete`` from a source that holds no committed checkpoint (an unmounted volume)
is refused (case 17 of the trust issue): it deleted every checkpoint of DST but its newest.
Local to local and local to the moto S3 server."""

from __future__ import annotations

import os
import shutil

from helpers import cli, make_checkpoints


def _steps(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-"))


def test_sync_delete_from_an_empty_source_is_refused(tmp_path):
    src, dst = str(tmp_path / "mnt"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2, 3])
    assert cli("sync", src, dst).exit_code == 0
    shutil.rmtree(src)
    os.makedirs(src)  # the mount point of a volume that is not mounted
    for extra in ((), ("--dry-run",)):
        r = cli("sync", src, dst, "--delete", *extra)
        assert r.exit_code == 1, r.stdout + r.stderr
        assert src in r.stderr and "--allow-empty-source" in r.stderr and "no committed checkpoint" in r.stderr
        assert _steps(dst) == [1, 2, 3]
    r = cli("sync", src, dst, "--delete", "--json")
    assert r.exit_code == 1 and r.json()["error"]["type"] == "RefusedForSafety", r.stdout
    assert cli("sync", src, dst).exit_code == 0  # without --delete there is nothing to fear
    r = cli("sync", src, dst, "--delete", "--allow-empty-source")
    assert r.exit_code == 0, r.stderr
    assert _steps(dst) == [3]  # the newest that verifies is never deleted


def test_sync_delete_from_an_empty_local_source_to_s3_is_refused(tmp_path, s3_url):
    src = str(tmp_path / "nvme")
    make_checkpoints(src, [1, 2])
    assert cli("sync", src, s3_url).exit_code == 0
    shutil.rmtree(src)
    os.makedirs(src)
    r = cli("sync", src, s3_url, "--delete")
    assert r.exit_code == 1 and "--allow-empty-source" in r.stderr, r.stdout + r.stderr
    assert [c["step"] for c in cli("ls", s3_url, "--json").json()["checkpoints"]] == [1, 2]
