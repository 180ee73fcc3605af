"""S3 clients: built from boto3's own configuration, created lazily, cached and shared.

Configuration is boto3's own and nothing else: the credential chain, ``AWS_PROFILE``, region,
``AWS_ENDPOINT_URL`` (or the ``endpoint_url=`` argument), ``AWS_RETRY_MODE`` /
``AWS_MAX_ATTEMPTS`` and ``AWS_REQUEST_CHECKSUM_CALCULATION``, from the environment or
``~/.aws/config``. Unset, retries default to botocore's "standard" mode with 10 attempts.
A malformed setting is a UsageError naming it, raised when the client is first needed
(``s3_settings``), so a bad AWS_* variable never breaks a command on local paths.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.session
from botocore.config import Config

from ckptctl.storage.s3_settings import CONFIG_ERRORS, check_environment, config_error

# Environment that changes what a client is (endpoint, identity, region, retries): clients are
# cached per distinct value so a test or a job that changes it gets a fresh one.
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_RETRY_MODE",
    "AWS_MAX_ATTEMPTS",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
)


@dataclass(frozen=True)
class Client:
    s3: Any  # a botocore S3 client; thread-safe, shared by every storage with the same config
    checksum: str | None  # "CRC32", or None where the user set when_required
    endpoint: str


_clients: dict[tuple[str | None, ...], Client] = {}
_clients_lock = threading.Lock()


def shared_client(endpoint_url: str | None) -> Client:
    # Checked on every call, not only when a client is built: a client cached under settings
    # that were fine must not hide a variable set wrong since (the cache key holds only the
    # variables that shape the client).
    check_environment(endpoint_url)
    key = (endpoint_url, *(os.environ.get(name) for name in _CLIENT_ENV))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _make_client(endpoint_url)
        return client


def _make_client(endpoint_url: str | None) -> Client:
    try:
        return _build(endpoint_url)
    except CONFIG_ERRORS as err:  # a setting from the config file: building touches no network
        raise config_error(err) from err


def _build(endpoint_url: str | None) -> Client:
    core = botocore.session.get_session()
    # An explicit Config outranks the user's settings, so pass theirs through where set.
    retries = {
        "mode": core.get_config_variable("retry_mode") or "standard",
        "total_max_attempts": core.get_config_variable("max_attempts") or 10,
    }
    config = Config(
        retries=retries,  # type: ignore[arg-type]
        connect_timeout=10,
        read_timeout=60,
        # An S3-to-S3 copy of COPY_THREADS (4) files keeps up to 16 parts and 8 GETs in flight
        # per file: 96 connections. Beyond the pool, urllib3 opens extra ones and warns on stderr.
        max_pool_connections=128,
    )
    s3 = boto3.session.Session(botocore_session=core).client(
        "s3", endpoint_url=endpoint_url, config=config
    )
    # Stores that reject flexible checksums are served by AWS_REQUEST_CHECKSUM_CALCULATION=
    # when_required, the same switch that turns off botocore's own default checksums.
    wanted = core.get_config_variable("request_checksum_calculation") == "when_supported"
    return Client(s3=s3, checksum="CRC32" if wanted else None, endpoint=s3.meta.endpoint_url)


class ClientHolder:
    """Created lazily (constructing a storage touches no network and needs no credentials)
    and shared by a storage and every ``sub()`` of it."""

    def __init__(self, endpoint_url: str | None) -> None:
        self.endpoint_url = endpoint_url
        self._client: Client | None = None

    def get(self) -> Client:
        if self._client is None:
            self._client = shared_client(self.endpoint_url)
        return self._client

    def endpoint(self) -> str:
        if self._client is not None:
            return self._client.endpoint
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or "the S3 endpoint"

