"""Botocore's errors, classified and translated into ckptctl's error tree."""

from __future__ import annotations

import re

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    CredentialRetrievalError,
    EndpointResolutionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)

from ckptctl.errors import CkptError, NotFound, RefusedForSafety, StorageError, UsageError


# S3's own rule for bucket names (no upper case, no underscores), stricter than botocore's.
_S3_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


def error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def http_status(err: ClientError) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_missing(err: ClientError) -> bool:
    return error_code(err) in ("404", "NoSuchKey", "NotFound")


def is_precondition_failed(err: ClientError) -> bool:
    """A conditional request (If-Match, If-None-Match) whose condition did not hold."""
    return error_code(err) == "PreconditionFailed" or http_status(err) == 412


def is_access_denied(err: ClientError) -> bool:
    return error_code(err) in _ACCESS_DENIED


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


_ACCESS_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_UNAVAILABLE = {"SlowDown", "503", "ServiceUnavailable", "RequestTimeout", "InternalError", "500"}


def s3_error(err: ClientError | BotoCoreError, shown: str, bucket: str, endpoint: str) -> CkptError:
    """Translate a botocore error about ``shown`` (an s3:// URL) into our tree: errors raised
    on this side (configuration, network) and errors the service answered."""
    if isinstance(err, ClientError):
        return _answered(err, shown, bucket)
    return _local(err, shown, endpoint)


def _local(err: BotoCoreError, shown: str, endpoint: str) -> CkptError:
    """Configuration, credentials or network: the request never got an answer."""
    if isinstance(err, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return StorageError(
            f"no AWS credentials found for {shown}",
            hint="set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or run where an instance or pod role provides them",
        )
    if isinstance(err, ProfileNotFound):
        return StorageError(
            f"{_one_line(err)} (needed for {shown})",
            hint="fix AWS_PROFILE or add the profile to ~/.aws/config",
        )
    if isinstance(err, EndpointResolutionError):
        # botocore's endpoint rules refused the URL or the settings before any request, e.g. a
        # bucket named like a directory bucket (--x-s3) without its zone: the user's to fix.
        return UsageError(
            f"{shown}: {_one_line(err)}",
            hint="fix the bucket name (a directory bucket is BASE--ZONE--x-s3, e.g. ckpts--usw2-az1--x-s3), "
            "AWS_REGION or AWS_ENDPOINT_URL",
        )
    if isinstance(err, (BotoConnectionError, HTTPClientError)):
        return StorageError(
            f"cannot reach {endpoint} for {shown}: {_one_line(err)}",
            hint="check the network, and AWS_ENDPOINT_URL for S3-compatible stores",
        )
    return StorageError(f"{shown}: {_one_line(err)}", hint="check the AWS configuration")


def _answered(err: ClientError, shown: str, bucket: str) -> CkptError:
    """An error response from the service, by its code."""
    code = error_code(err)
    message = _one_line(err.response.get("Error", {}).get("Message", "")) or code
    if is_missing(err):
        return NotFound(
            f"{shown}: no such object",
            hint="check the URL; the checkpoint may have been pruned or never committed",
        )
    if code == "NoSuchUpload":
        # Our own upload, gone before we completed it: another writer of the same object
        # superseded it (s3_uploads), or prune or a lifecycle rule aborted it as idle.
        return RefusedForSafety(
            f"{shown}: the multipart upload was aborted by another process before it completed",
            hint="another save or copy of the same checkpoint took over this object; let one run "
            "finish alone, then check the result with `ckptctl verify`",
        )
    if code == "NoSuchBucket":
        if not _S3_BUCKET_NAME.fullmatch(bucket):
            # botocore lets such names through for the stores that accept them; this one has
            # none, and S3 itself could never have one: a mistyped URL (exit 2), not an outage.
            return UsageError(
                f"bucket {bucket} does not exist, and {bucket!r} is not a name S3 allows ({shown})",
                hint="S3 bucket names are 3 to 63 lower-case letters, digits, dots and hyphens; fix the URL",
            )
        # A well-formed name the store does not have: the endpoint or account may be the wrong
        # one, which is the environment's problem like an unreachable store (exit 3).
        return StorageError(
            f"bucket {bucket} does not exist ({shown})",
            hint="create the bucket or fix the URL (and AWS_ENDPOINT_URL for other stores)",
        )
    if code in ("PermanentRedirect", "301", "AuthorizationHeaderMalformed"):
        return StorageError(
            f"bucket {bucket} is in another region ({shown}): {message}",
            hint="set AWS_REGION to the bucket's region",
        )
    if code in _ACCESS_DENIED:
        return StorageError(
            f"access denied: {shown}",
            hint="check the IAM policy (s3:ListBucket, GetObject, PutObject, DeleteObject, "
            "AbortMultipartUpload, ListBucketMultipartUploads; s3express:CreateSession for a directory bucket) "
            "for this bucket and prefix, and AWS_PROFILE",
        )
    if code in _BAD_CREDENTIALS:
        return StorageError(
            f"AWS credentials were rejected for {shown} ({code})",
            hint="refresh the session (aws sso login) or fix AWS_ACCESS_KEY_ID/SECRET",
        )
    if code in _UNAVAILABLE or http_status(err) >= 500:
        return StorageError(
            f"{shown}: S3 still failing after retries ({code}: {message})",
            hint="the store is throttling or unavailable; retry later or lower concurrency",
        )
    return StorageError(f"{shown}: {code}: {message}", hint="see the S3 error code's documentation")
