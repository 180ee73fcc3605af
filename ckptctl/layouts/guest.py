"""A plugin layout as the catalog holds it: a guest whose failure fails only what it claims.

``registry.registered`` wraps every plugin layout it accepts in ``guest_layout`` (a
``plugins.Guest``): its code runs with stdout kept for ckptctl and anything it raises but an
interrupt caught (``plugins.hosted``, one warning per plugin). What a failed call then means
is decided here, per method of the layout protocol (``layouts.base.Layout``), so that a
broken plugin never fails a verb for ckptctl's own or another layout's checkpoints (a
``step_of`` that raised gave ``internal error`` in 12 of 15 verbs):

- asked whether something is its own (``step_of``, ``claims``, ``claims_alone``), it claims
  nothing: the directory is listed ``unknown``, which nothing deletes;
- asked about a checkpoint it claimed, that checkpoint fails: ``examine`` says corrupt,
  ``check`` reports the failure as a problem (verify exit 1, ``latest`` skips it), everything
  it would protect stays protected, and it records no metrics;
- bound to a root (``for_root``) and failing there, it claims nothing under that root;
- anything else (``resume``, ``removal_order``, its pointer) has no safe default: an
  operational error naming the plugin (exit 3), for the verb that asked for that checkpoint.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any, Callable

from ckptctl import plugins
from ckptctl.errors import OperationalError
from ckptctl.layouts.base import CheckpointKind, Examined
from ckptctl.layouts.checked import Checked, Problem


def guest_layout(ep: EntryPoint, layout: Any) -> Any:
    """``layout`` (a plugin's) held as a guest (see the module docstring)."""

    def failed(name: str, args: tuple, kwargs: dict, failure: plugins.GuestFailed) -> Any:
        if name == "for_root":  # under that root: its attributes answer, each call as a failed one
            return plugins.Guest(ep, layout, failed, broken=failure)
        return _failed(name, args, kwargs, failure)

    return plugins.Guest(ep, layout, failed)


def _examined(args: tuple, kwargs: dict, f: plugins.GuestFailed) -> Examined:
    return Examined("corrupt", f"{f}: ckptctl cannot judge this checkpoint without it")


def _checked(args: tuple, kwargs: dict, f: plugins.GuestFailed) -> Checked:
    level = args[1] if len(args) > 1 else kwargs.get("level", "quick")
    return Checked(level, problems=[Problem(f"{f}: this checkpoint cannot be checked", hint=f.fix)])


def _protected(args: tuple, kwargs: dict, f: plugins.GuestFailed) -> dict[str, str]:
    entries = args[0] if args else kwargs.get("entries", ())
    return {name: f"kept: {f.ep.name!r}, whose layout it is, failed to say what it protects"
            for name, _status in entries}


_FALLBACKS: dict[str, Callable[[tuple, dict, plugins.GuestFailed], Any]] = {
    "step_of": lambda a, k, f: None,
    "claims": lambda a, k, f: False,
    "claims_alone": lambda a, k, f: False,
    "examine": _examined,  # corrupt, never a partial to delete
    "check": _checked,
    "reads_on_resume": lambda a, k, f: True,  # what it cannot say it reads, counts
    "identity": lambda a, k, f: None,  # nothing recorded: checked afresh each time
    "kind_of_checkpoint": lambda a, k, f: CheckpointKind("resumable", f"not told apart ({f}); verify judges it"),
    "protected": _protected,
    "recorded_metrics": lambda a, k, f: {},
    "numbered_by": lambda a, k, f: "step",  # as a plugin without the member
}


def _failed(name: str, args: tuple, kwargs: dict, failure: plugins.GuestFailed) -> Any:
    fallback = _FALLBACKS.get(name)
    if fallback is not None:
        return fallback(args, kwargs, failure)
    raise OperationalError(str(failure), hint=failure.fix)
