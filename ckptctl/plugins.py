"""Third-party extensions, found by Python entry point: loaded once, never fatal, run as guests.

A distribution extends ckptctl by declaring entry points (``ckptctl.layouts``: checkpoint
layouts, ``ckptctl.storage``: storage backends by URL scheme; docs/extending.md). Whatever a
plugin does wrong (its import fails, it gives the wrong kind of object, its name is taken), ckptctl
goes on without it after one warning on stderr that names the entry point and the fix: a broken
package installed beside ckptctl must never stop ``ls`` or a cron ``prune`` from running.

Plugin code is a guest (``hosted``, ``Guest``): at import and in every call, what it prints goes
to stderr (stdout is ckptctl's: a path a script captures, a JSON document), and whatever it
raises, ``SystemExit`` included (``sys.exit(0)`` at import made every verb exit 0 silently), is
caught and named; only a real interrupt (KeyboardInterrupt) goes through. ckptctl's own
errors (``CkptError``) pass as they are: a layout may raise ``NotFound`` for a file deleted
while read, as the built-in ones do. The one who holds the guest decides what a failure
means (``Guest``'s ``failed``): a layout then claims nothing, or fails only what it claims;
a storage backend's call is a storage error naming the plugin.

A leaf: it imports nothing of ckptctl's but the error tree, so ``storage`` and ``layouts`` can
both use it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, Iterator, TypeVar

from ckptctl.errors import CkptError

T = TypeVar("T")


def declared(group: str) -> list[EntryPoint]:
    """The entry points installed distributions declare in ``group``, in a stable order (by
    name, then target), so that which of two clashing plugins wins does not depend on sys.path
    order. A distribution whose metadata cannot be read gives a warning and no entry point."""
    try:
        found = list(entry_points(group=group))
    except Exception as e:  # third-party metadata: any failure here is the installation's, not ours
        warn(f"could not read the installed {group!r} entry points ({_one_line(e)}); no such plugin is used",
             "reinstall the package that declares them")
        return []
    return sorted(found, key=lambda ep: (ep.name, ep.value))


def load(ep: EntryPoint, accept: Callable[[object], T]) -> T | None:
    """``accept`` applied to what ``ep`` names, or None after one warning when importing it
    fails (anything but an interrupt, ``SystemExit`` included: it is third-party code) or
    ``accept`` refuses it by raising. What the import prints goes to stderr, at the level of
    the file descriptor too (a banner printed at import corrupted ``latest``'s path)."""
    try:
        with _stdout_kept(descriptor=True):
            return accept(ep.load())
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a plugin may raise anything; it must not stop ckptctl
        refuse(ep, f"cannot be used: {type(e).__name__}: {_one_line(e)}")
        return None


class GuestFailed(Exception):
    """A plugin's code raised (not an interrupt, not a CkptError) while ckptctl called it."""

    def __init__(self, ep: EntryPoint, what: str, cause: BaseException) -> None:
        super().__init__(f"{_shown(ep)} failed in {what}: {type(cause).__name__}: {_one_line(cause)}")
        self.ep, self.what, self.cause = ep, what, cause

    @property
    def fix(self) -> str:
        return _fix(self.ep)


def hosted(ep: EntryPoint, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, plugin code, run as a guest: what it prints goes to stderr, and
    whatever it raises but an interrupt or a CkptError comes out as ``GuestFailed``, after one
    warning per plugin."""
    try:
        with _stdout_kept():
            return fn(*args, **kwargs)
    except (KeyboardInterrupt, CkptError):
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit too: a guest never ends the command
        failure = GuestFailed(ep, what, e)
        if id(ep) not in _warned:
            _warned.add(id(ep))
            warn(f"{failure}; ckptctl goes on without it for what it claims", failure.fix)
        raise failure from e


_warned: set[int] = set()  # the entry points whose failure was told already (one warning each)


class Guest:
    """A plugin's object as ckptctl holds it: every attribute read and call is ``hosted``, and
    what it returns that is the plugin's own (an instance of a class of its package, a
    generator) is held as a guest too. ``failed(name, args, kwargs, failure)`` answers for a
    call that failed: a fallback value, or an error of its own. ``isinstance`` sees the
    plugin's class (a guest layout is still an instance of the class it registered)."""

    __slots__ = ("_ep", "_obj", "_failed", "_broken")

    def __init__(self, ep: EntryPoint, obj: Any, failed: Callable[[str, tuple, dict, GuestFailed], Any], *,
                 broken: GuestFailed | None = None) -> None:
        object.__setattr__(self, "_ep", ep)
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_failed", failed)
        # Set: the plugin failed in a way that makes this object's calls meaningless (a layout
        # that could not read its root); each is answered by ``failed`` without running it.
        object.__setattr__(self, "_broken", broken)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - what isinstance() asks
        return type(object.__getattribute__(self, "_obj"))

    def __getattr__(self, name: str) -> Any:
        ep, obj, failed = self._ep, self._obj, self._failed
        try:
            value = hosted(ep, f"reading {name}", getattr, obj, name, _ABSENT)
        except GuestFailed as e:
            return failed(name, (), {}, e)
        if value is _ABSENT:  # absent: asking is allowed (a plugin written before a method existed)
            raise AttributeError(name)
        if not callable(value) or isinstance(value, type):
            return self._adopt(value)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._broken is not None:
                return failed(name, args, kwargs, self._broken)
            try:
                return self._adopt(hosted(ep, name, value, *args, **kwargs))
            except GuestFailed as e:
                return failed(name, args, kwargs, e)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        hosted(self._ep, f"setting {name}", setattr, self._obj, name, value)

    def __enter__(self) -> Any:
        inner = self.__getattr__("__enter__")()
        return self if inner is self._obj else inner

    def __exit__(self, *exc: Any) -> Any:
        return self.__getattr__("__exit__")(*exc)

    def __iter__(self) -> Iterator[Any]:
        return self._adopt(self.__getattr__("__iter__")())

    def __repr__(self) -> str:
        return f"<guest {type(self._obj).__name__} of plugin {self._ep.name!r}>"

    def _adopt(self, value: Any) -> Any:
        return adopt(self._ep, value, self._failed)


def adopt(ep: EntryPoint, value: Any, failed: Callable[[str, tuple, dict, GuestFailed], Any]) -> Any:
    """``value``, which plugin code returned, as ckptctl may hold it: the plugin's own objects
    (a bound layout, a storage, its reader) and generators as guests; anything else as it is."""
    if isinstance(value, types.GeneratorType) or (_owned(ep, type(value)) and isinstance(value, Iterator)):
        return _guest_iterator(ep, value, failed)
    if _owned(ep, type(value)) and not isinstance(value, type):
        return Guest(ep, value, failed)
    return value


_ABSENT = object()


def _guest_iterator(ep: EntryPoint, it: Iterator[Any], failed: Callable[..., Any]) -> Iterator[Any]:
    while True:
        try:
            item = hosted(ep, "iterating", next, it, _ABSENT)  # its end is no failure
        except GuestFailed as e:
            failed("iterating", (), {}, e)
            return
        if item is _ABSENT:
            return
        yield Guest(ep, item, failed) if _owned(ep, type(item)) else item


def _owned(ep: EntryPoint, cls: type) -> bool:
    """Whether instances of ``cls`` are the plugin's own objects: its class comes from the
    package the entry point names (not Python's, not ckptctl's, not numpy's)."""
    module = getattr(cls, "__module__", None) or ""
    return module.split(".")[0] == ep.value.split(":")[0].strip().split(".")[0]


# While a guest runs, sys.stdout is stderr: counted, because guests run on several threads at
# once (verify's pool); ckptctl itself prints its results from the main thread, after them.
_stdout_lock = threading.Lock()
_stdout_depth = 0
_stdout_saved: Any = None


@contextlib.contextmanager
def _stdout_kept(*, descriptor: bool = False) -> Iterator[None]:
    """Send what is printed meanwhile to stderr: ``print`` (sys.stdout), and with
    ``descriptor`` whatever writes to file descriptor 1 (used at import, before any thread)."""
    global _stdout_depth, _stdout_saved
    with _stdout_lock:
        if _stdout_depth == 0:
            _stdout_saved = sys.stdout
            sys.stdout = sys.stderr
        _stdout_depth += 1
    saved_fd = _redirect_fd() if descriptor else None
    try:
        yield
    finally:
        if saved_fd is not None:
            _restore_fd(saved_fd)
        with _stdout_lock:
            _stdout_depth -= 1
            if _stdout_depth == 0:
                sys.stdout = _stdout_saved
                _stdout_saved = None


def _redirect_fd() -> int | None:
    try:
        sys.__stdout__.flush()  # type: ignore[union-attr]
        saved = os.dup(1)
        os.dup2(2, 1)
        return saved
    except (OSError, AttributeError, ValueError):  # no such descriptor (an embedding host): Python's level only
        return None


def _restore_fd(saved: int) -> None:
    try:
        sys.__stdout__.flush()  # type: ignore[union-attr]
    except (OSError, AttributeError, ValueError):
        pass
    os.dup2(saved, 1)
    os.close(saved)


def refuse(ep: EntryPoint, why: str) -> None:
    """Warn, once, that ``ep`` is skipped and why, with the fix."""
    warn(f"{_shown(ep)} {why}; skipped", _fix(ep))


def _fix(ep: EntryPoint) -> str:
    dist = _distribution(ep)
    return (f"fix or upgrade {dist}, or uninstall it (pip uninstall {dist})" if dist
            else "fix or uninstall the package that declares it")


def warn(message: str, fix: str) -> None:
    """One line on stderr: stdout stays the command's output (``--json`` included)."""
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in f"{message} (to fix: {fix})")
    print(f"ckptctl: warning: {text}", file=sys.stderr)  # a plugin's name never drives the terminal


def _shown(ep: EntryPoint) -> str:
    dist = _distribution(ep)
    return f"plugin {ep.name!r} = {ep.value!r} (entry point group {ep.group}{', from ' + dist if dist else ''})"


def _distribution(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)  # None for an entry point not read from an installed distribution
    name = getattr(dist, "name", None) if dist is not None else None
    return name if isinstance(name, str) and name else None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(e).__name__
