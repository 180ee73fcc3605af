"""The S3 tests' server gives back the disk of a finished test's bucket (see moto_disk.py)."""

from __future__ import annotations

import os

import boto3

from moto_disk import drop_bucket


def _deleted_files_held() -> int:
    """Unlinked files this process still holds open: moto's spilled objects and parts."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        held += target.endswith(" (deleted)")
    return held


def test_a_dropped_bucket_closes_the_files_moto_spilled_its_objects_to(s3_url: str) -> None:
    bucket = s3_url[len("s3://"):].split("/")[0]
    s3 = boto3.client("s3")
    before = _deleted_files_held()
    blob = os.urandom(9 << 20)  # over moto's 8 MiB in-memory limit: spilled to /tmp
    for i in range(3):
        s3.put_object(Bucket=bucket, Key=f"prefix/big-{i}", Body=blob)
    upload = s3.create_multipart_upload(Bucket=bucket, Key="prefix/parts")["UploadId"]
    s3.upload_part(Bucket=bucket, Key="prefix/parts", UploadId=upload, PartNumber=1, Body=blob)
    assert _deleted_files_held() >= before + 4, "moto no longer spills large objects to /tmp"

    drop_bucket(bucket)
    assert _deleted_files_held() <= before
