"""Third-party extensions, found by Python entry point: loaded once, never fatal.

A distribution extends ckptctl by declaring entry points (``ckptctl.layouts``: checkpoint
layouts, ``ckptctl.storage``: storage backends by URL scheme; docs/extending.md). Whatever a
plugin does wrong (its import fails, it gives the wrong kind of object, its name is taken), ckptctl
goes on without it after one warning on stderr that names the entry point and the fix: a broken
package installed beside ckptctl must never stop ``ls`` or a cron ``prune`` from running.

A leaf: it imports nothing of ckptctl's, so ``storage`` and ``layouts`` can both use it.
"""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, TypeVar

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
    fails (any exception: it is third-party code) or ``accept`` refuses it by raising."""
    try:
        return accept(ep.load())
    except Exception as e:  # noqa: BLE001 - a plugin may raise anything; it must not stop ckptctl
        refuse(ep, f"cannot be used: {type(e).__name__}: {_one_line(e)}")
        return None


def refuse(ep: EntryPoint, why: str) -> None:
    """Warn, once, that ``ep`` is skipped and why, with the fix."""
    dist = _distribution(ep)
    fix = (f"fix or upgrade {dist}, or uninstall it (pip uninstall {dist})" if dist
           else "fix or uninstall the package that declares it")
    warn(f"{_shown(ep)} {why}; skipped", fix)


def warn(message: str, fix: str) -> None:
    """One line on stderr: stdout stays the command's output (``--json`` included)."""
    print(f"ckptctl: warning: {message} (to fix: {fix})", file=sys.stderr)


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
