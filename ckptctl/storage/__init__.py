"""Storage backends, chosen by URL scheme: a local path or ``file://`` URL, ``s3://bucket/prefix``,
and any scheme a third-party distribution registers (entry point group ``ckptctl.storage``).

Everything above this package reaches bytes through ``open_storage(url)`` and the ``Storage``
interface; nothing else imports a backend module directly.

A plugin backend is an entry point named for its scheme whose target is a ``Storage``
subclass, or any callable, taking ``(url, **kwargs)`` and returning a ``Storage``
(docs/extending.md):

    [project.entry-points."ckptctl.storage"]
    gs = "ckptctl_gcs:GcsStorage"

Plugins are looked up only for a scheme no built-in backend has, once per process, so a local
path or ``s3://`` never pays for importing them. A built-in scheme cannot be taken over, and a
plugin that fails to import is skipped with one warning naming it (``ckptctl.plugins``); its
opener and the storage it gives run as guests: what they print goes to stderr, and what they
raise is a ``StorageError`` naming the plugin.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from ckptctl import plugins
from ckptctl.errors import StorageError, UsageError
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer, check_key

__all__ = ["ObjectInfo", "Reader", "Storage", "Writer", "check_key", "open_storage", "schemes"]

GROUP = "ckptctl.storage"

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

Opener = Callable[..., Storage]  # (url, **kwargs) -> Storage


def _local(text: str, **kwargs: Any) -> Storage:
    from ckptctl.storage.local import LocalStorage

    return LocalStorage(text, **kwargs)


def _file_url(text: str, **kwargs: Any) -> Storage:
    from ckptctl.storage.local import LocalStorage

    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise UsageError(
            f"{text}: only local file:// URLs are supported (file:///absolute/path)",
            hint="mount the remote filesystem and give its local path",
        )
    return LocalStorage(unquote(parts.path), url=text, **kwargs)


def _s3(text: str, **kwargs: Any) -> Storage:
    # Imported here so that local-only users do not pay for importing boto3.
    from ckptctl.storage.s3 import S3Storage

    return S3Storage(text, **kwargs)


# The built-in backends by scheme ("" for a plain path). A new built-in backend is a line here.
BUILTIN: dict[str, Opener] = {"": _local, "file": _file_url, "s3": _s3}

_plugins: dict[str, Opener] | None = None  # scheme -> opener, read on first need


def _plugin_openers() -> dict[str, Opener]:
    """The usable ``ckptctl.storage`` plugins by scheme, loaded once per process."""
    global _plugins
    if _plugins is None:
        _plugins = registered_openers(plugins.declared(GROUP))
    return _plugins


def registered_openers(found: Any) -> dict[str, Opener]:
    """The openers of the entry points ``found`` (name: the scheme) that may be used: each one
    that imports, is callable, and names a scheme that is valid and not already taken; the
    others are skipped with a warning each."""
    out: dict[str, Opener] = {}
    for ep in found:
        scheme = ep.name.lower()
        if not _SCHEME.match(f"{scheme}://"):
            plugins.refuse(ep, f"is not a URL scheme ({ep.name!r}: a letter, then letters, digits, '+', '-' or '.')")
            continue
        if scheme in BUILTIN or scheme in out:
            plugins.refuse(ep, f"claims the scheme {scheme!r}, which another backend already has")
            continue
        opener = plugins.load(ep, _as_opener)
        if opener is not None:
            out[scheme] = _hosted_opener(ep, opener)
    return out


def _hosted_opener(ep: Any, opener: Opener) -> Opener:
    """``opener`` run as a guest (``plugins.hosted``), and the storage it gives held as one:
    whatever the plugin's code raises (but an interrupt or one of ckptctl's errors) is a
    storage error naming the plugin (exit 3), never an internal error."""

    def failed(name: str, args: tuple, kwargs: dict, failure: plugins.GuestFailed) -> Any:
        raise StorageError(str(failure), hint=failure.fix)

    def open_(url: str, **kwargs: Any) -> Storage:
        try:
            storage = plugins.hosted(ep, f"opening {url}", opener, url, **kwargs)
        except plugins.GuestFailed as failure:
            raise StorageError(str(failure), hint=failure.fix) from None
        return plugins.adopt(ep, storage, failed)

    return open_


def _as_opener(target: object) -> Opener:
    if not callable(target):
        raise TypeError(f"gives {type(target).__name__}, not a Storage subclass or a callable (url, **kwargs)")
    return target  # type: ignore[return-value]


def schemes() -> tuple[str, ...]:
    """Every URL scheme ``open_storage`` accepts (built-in first), for messages and help."""
    return tuple(s for s in BUILTIN if s) + tuple(sorted(_plugin_openers()))


def open_storage(url: str | os.PathLike[str], **kwargs: Any) -> Storage:
    """The storage rooted at ``url``. ``kwargs`` go to the backend (e.g. ``S3Storage``'s
    ``endpoint_url`` or ``multipart_threshold``). Raises UsageError for an unknown scheme."""
    text = os.fspath(url)
    if not text:
        raise UsageError("empty storage URL", hint="give a directory, file://PATH or s3://BUCKET/PREFIX")
    if "\x00" in text:  # every os call would raise ValueError ("embedded null byte")
        raise UsageError(f"{text!r}: a path or URL cannot contain a NUL byte", hint="remove it")
    match = _SCHEME.match(text)
    scheme = "" if match is None else match.group(1).lower()
    opener = BUILTIN.get(scheme) or _plugin_openers().get(scheme)
    if opener is None:
        others = "".join(f", {s}://..." for s in sorted(_plugin_openers()))
        raise UsageError(
            f"unsupported storage scheme {scheme!r} in {text}",
            hint=f"use a local path, file:///PATH or s3://BUCKET/PREFIX{others}",
        )
    storage = opener(text, **kwargs)
    if not isinstance(storage, Storage):  # a plugin's factory: fail here, clearly, not deep in a verb
        raise StorageError(
            f"the {scheme}:// backend gave {type(storage).__name__}, not a Storage, for {text}",
            hint=f"fix or uninstall the package that registers the {scheme!r} scheme ({GROUP} entry point)",
        )
    return storage
