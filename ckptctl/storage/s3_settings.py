"""The AWS settings an S3 client is built from, checked before it is built.

botocore reads these from the environment (and ``~/.aws/config``) and reports a malformed one
in its own way: ``AWS_MAX_ATTEMPTS=x`` was a bare ValueError from deep inside client creation
(an "internal error", exit 3), ``AWS_RETRY_MODE=x`` or a bad region read as a storage failure
(exit 3). A setting is the user's to fix, so each is a UsageError (exit 2) that names the
variable, its value and what it accepts. Only settings botocore or ckptctl actually read are
checked, and only as strictly as botocore itself would refuse them, with two bounds of our
own: attempts (a typo of 99999999999999999999 retried an unreachable store for ever) and
timeouts.

Values from the config file cannot be checked by name here; botocore's own complaint about
them is turned into a UsageError that names the file (``config_error``).
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import botocore.exceptions

from ckptctl.errors import UsageError

MAX_ATTEMPTS = 100  # AWS_MAX_ATTEMPTS above this only stretches an outage's wait (backoff up to 20 s each)

# Variable -> the values botocore accepts (it compares them as given).
_CHOICES: dict[str, tuple[str, ...]] = {
    "AWS_RETRY_MODE": ("legacy", "standard", "adaptive"),
    "AWS_DEFAULTS_MODE": ("legacy", "auto", "standard", "in-region", "cross-region", "mobile"),
    "AWS_REQUEST_CHECKSUM_CALCULATION": ("when_supported", "when_required"),
    "AWS_RESPONSE_CHECKSUM_VALIDATION": ("when_supported", "when_required"),
    "AWS_ACCOUNT_ID_ENDPOINT_MODE": ("preferred", "disabled", "required"),
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT": ("legacy", "regional"),
    "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": ("ipv4", "ipv6"),
}
# Choices botocore lower-cases before comparing.
_ANY_CASE = {"AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE"}

# Variable -> (minimum, maximum) of the whole number botocore reads with int().
_WHOLE: dict[str, tuple[int, int]] = {
    "AWS_MAX_ATTEMPTS": (1, MAX_ATTEMPTS),
    "AWS_METADATA_SERVICE_TIMEOUT": (1, 3600),
    "AWS_METADATA_SERVICE_NUM_ATTEMPTS": (1, MAX_ATTEMPTS),
    "AWS_REQUEST_MIN_COMPRESSION_SIZE_BYTES": (1, 1 << 20),
    "AWS_CSM_PORT": (0, 65535),
}

_URLS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_EC2_METADATA_SERVICE_ENDPOINT")

# botocore's own rule for a region name (botocore.utils.validate_region_name).
_REGION = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?")

# botocore's complaints about a configuration it was given (never about the network or the
# store); ValueError is what it raises for int() of a malformed number and a bad endpoint URL.
# By name: older botocore releases (boto3>=1.34 is allowed) lack some of them.
_CONFIG_ERROR_NAMES = (
    "ConfigParseError", "InvalidChecksumConfigError", "InvalidConfigError", "InvalidDefaultsMode",
    "InvalidEndpointConfigurationError", "InvalidEndpointDiscoveryConfigurationError", "InvalidIMDSEndpointError",
    "InvalidIMDSEndpointModeError", "InvalidProxiesConfigError", "InvalidRegionError", "InvalidRetryConfigurationError",
    "InvalidS3AddressingStyleError", "InvalidS3UsEast1RegionalEndpointConfigError",
    "InvalidSTSRegionalEndpointsConfigError", "ProfileNotFound",
)
CONFIG_ERRORS: tuple[type[Exception], ...] = (
    *(getattr(botocore.exceptions, name) for name in _CONFIG_ERROR_NAMES if hasattr(botocore.exceptions, name)),
    ValueError,
)


def check_environment(endpoint_url: str | None = None) -> None:
    """Raise UsageError naming the first malformed AWS_* variable (or ``endpoint_url``, the
    argument a library user passed). Unset variables are botocore's defaults."""
    env = os.environ
    for name, choices in _CHOICES.items():
        value = env.get(name)
        if value is None or (value == "" and name == "AWS_RETRY_MODE"):  # '' is the default mode
            continue
        if (value.lower() if name in _ANY_CASE else value) not in choices:
            raise _bad(name, value, f"one of {', '.join(choices)}")
    for name, (lo, hi) in _WHOLE.items():
        value = env.get(name)
        if value is not None:
            _whole(name, value, lo, hi)
    for name in _URLS:
        value = env.get(name)
        if value:  # empty: botocore takes no endpoint from it
            _url(name, value)
    if endpoint_url is not None:
        _url("endpoint_url", endpoint_url)
    region = env.get("AWS_DEFAULT_REGION")
    if region and not _REGION.fullmatch(region):
        raise _bad("AWS_DEFAULT_REGION", region, "a region name such as us-east-1 (letters, digits and dashes)")
    bundle = env.get("AWS_CA_BUNDLE")
    if bundle and not os.path.exists(bundle):
        raise _bad("AWS_CA_BUNDLE", bundle, "the path of an existing CA certificate bundle", what="names no file")


def config_error(err: Exception) -> UsageError:
    """botocore's complaint about its configuration (a CONFIG_ERRORS one) as a usage error
    naming where the setting lives."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, botocore.exceptions.ProfileNotFound):
        name = "AWS_PROFILE" if os.environ.get("AWS_PROFILE") else "AWS_DEFAULT_PROFILE"
        return UsageError(f"{first} (environment variable {name})",
                          hint=f"fix {name}, or add the profile to {_config_file()}")
    return UsageError(f"invalid AWS configuration: {first}",
                      hint=f"fix the setting in {_config_file()} (AWS_CONFIG_FILE) or its AWS_* environment variable")


def _config_file() -> str:
    return os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"


def _whole(name: str, value: str, lo: int, hi: int) -> None:
    accepted = f"a whole number from {lo} to {hi}"
    text = value.strip()
    if not re.fullmatch(r"[+-]?\d{1,20}", text):
        raise _bad(name, value, accepted, what="is not a whole number")
    if not lo <= int(text) <= hi:
        raise _bad(name, value, accepted, what=f"is outside {lo}..{hi}")


def _url(name: str, value: str) -> None:
    accepted = "an http:// or https:// URL such as http://localhost:9000"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (raises ValueError for a port out of range or not a number)
    except ValueError:
        raise _bad(name, value, accepted, what="is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        raise _bad(name, value, accepted, what="is not an http(s) URL")


def _bad(name: str, value: str, accepted: str, *, what: str = "is not valid") -> UsageError:
    shown = repr(value) if len(value) <= 60 else repr(value[:60]) + f"... ({len(value)} characters)"
    where = "argument" if name == "endpoint_url" else "environment variable"
    unset = "" if name == "endpoint_url" else ", or unset it"
    return UsageError(f"{where} {name}={shown} {what}", hint=f"set {name} to {accepted}{unset}")
