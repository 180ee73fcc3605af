"""Storage backends, chosen by URL: a local path or ``file://`` URL, or ``s3://bucket/prefix``.

Everything above this package reaches bytes through ``open_storage(url)`` and the ``Storage``
interface; nothing else imports a backend module directly.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit

from ckptctl.errors import UsageError
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer, check_key

__all__ = ["ObjectInfo", "Reader", "Storage", "Writer", "check_key", "open_storage"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_storage(url: str | os.PathLike[str], **kwargs: Any) -> Storage:
    """The storage rooted at ``url``. ``kwargs`` go to the backend (e.g. ``S3Storage``'s
    ``endpoint_url`` or ``multipart_threshold``). Raises UsageError for an unknown scheme."""
    text = os.fspath(url)
    if not text:
        raise UsageError("empty storage URL", hint="give a directory, file://PATH or s3://BUCKET/PREFIX")
    if "\x00" in text:  # every os call would raise ValueError ("embedded null byte")
        raise UsageError(f"{text!r}: a path or URL cannot contain a NUL byte", hint="remove it")
    match = _SCHEME.match(text)
    if match is None:
        from ckptctl.storage.local import LocalStorage

        return LocalStorage(text, **kwargs)
    scheme = match.group(1).lower()
    if scheme == "s3":
        # Imported here so that local-only users do not pay for importing boto3.
        from ckptctl.storage.s3 import S3Storage

        return S3Storage(text, **kwargs)
    if scheme == "file":
        from ckptctl.storage.local import LocalStorage

        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise UsageError(
                f"{text}: only local file:// URLs are supported (file:///absolute/path)",
                hint="mount the remote filesystem and give its local path",
            )
        return LocalStorage(unquote(parts.path), url=text, **kwargs)
    raise UsageError(
        f"unsupported storage scheme {scheme!r} in {text}",
        hint="use a local path, file:///PATH or s3://BUCKET/PREFIX",
    )
