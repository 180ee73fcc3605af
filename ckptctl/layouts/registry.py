"""Which layouts ckptctl knows: the built-in ones, then third-party ones by entry point.

``BUILTIN`` lists the built-in layouts, one a line (a new one is its module plus a line here),
ckptctl's own first: a ``step-N`` directory holding a ckptctl marker is ckptctl's, whatever
else it holds. ``LAYOUTS`` is every layout, read once at import: the built-in ones, then each
usable plugin in entry point order. A third-party distribution adds a layout by declaring an
entry point in the group ``ckptctl.layouts`` whose target is a layout class (instantiated with
no arguments) or instance (docs/extending.md):

    [project.entry-points."ckptctl.layouts"]
    toy = "ckptctl_toy_layout:ToyLayout"

A plugin's layout is any object with every member of the ``Layout`` protocol
(``base.MEMBERS``); it subclasses nothing. Plugins come after every built-in layout, so a
directory that a built-in layout claims stays that layout's whatever a plugin says. Each is
held as a guest (``layouts.guest``): its code runs with stdout kept for ckptctl, and a call
that raises fails only what it claims. A plugin is skipped, with one warning on stderr naming its entry point and the fix
(``ckptctl.plugins``), when it cannot be imported, when it lacks a member of the protocol, or
when its name is already taken: by a built-in layout, by any name or alias of the format
vocabulary (``format.formats``: ``--format hf`` must keep meaning the Trainer), by
``unknown``, or by an earlier plugin.
"""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint
from typing import Iterable, Sequence

from ckptctl import plugins
from ckptctl.format.formats import canonical, names_among
from ckptctl.layouts.accelerate import AccelerateLayout
from ckptctl.layouts.base import MEMBERS, UNKNOWN, Layout
from ckptctl.layouts.composer import ComposerLayout
from ckptctl.layouts.dcp import DcpLayout
from ckptctl.layouts.guest import guest_layout
from ckptctl.layouts.deepspeed import DeepSpeedLayout
from ckptctl.layouts.hf_trainer import HfTrainerLayout
from ckptctl.layouts.lightning import LightningLayout
from ckptctl.layouts.megatron import MegatronLayout
from ckptctl.layouts.native import NativeLayout
from ckptctl.layouts.nemo import NemoLayout
from ckptctl.storage.base import Storage

GROUP = "ckptctl.layouts"

# Lower case because ``--format`` is matched case-insensitively; no spaces or commas so that a
# name reads the same in ``ls``'s FORMAT column, in JSON and in a shell.
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}\Z", re.ASCII)

# The layouts the ``Checkpointer`` saves and loads: what ``load_latest``, library retention,
# the tiers and the interval statistics read (their checkpoints carry what those need: a
# manifest of every tensor, save statistics). Every verb reads every layout.
CHECKPOINTER_LAYOUTS: tuple[Layout, ...] = (NativeLayout(),)
# Their names are the shared vocabulary's (``format.formats.LAYOUT_NAMES``: ``latest --format``
# and ``convert --to`` speak the same names); tests/test_format_names.py checks they agree.
BUILTIN: tuple[Layout, ...] = (
    *CHECKPOINTER_LAYOUTS,
    DcpLayout(),
    HfTrainerLayout(),
    MegatronLayout(),
    DeepSpeedLayout(),
    LightningLayout(),
    AccelerateLayout(),
    ComposerLayout(),
    NemoLayout(),
)


def registered(builtins: Sequence[Layout], found: Iterable[EntryPoint] | None = None) -> tuple[Layout, ...]:
    """``builtins``, then each usable plugin layout of ``found`` (the installed entry points of
    ``ckptctl.layouts`` for None), in entry point order. Never raises for a plugin."""
    out = list(builtins)
    taken = {layout.name for layout in builtins}
    for ep in plugins.declared(GROUP) if found is None else found:
        layout = plugins.load(ep, _as_layout)
        if layout is None:
            continue
        why = _name_refusal(layout.name, taken)
        if why is not None:
            plugins.refuse(ep, why)
            continue
        taken.add(layout.name)
        out.append(guest_layout(ep, layout))  # its calls hosted: a failure fails only what it claims
    return tuple(out)


def _as_layout(target: object) -> Layout:
    layout = target() if isinstance(target, type) else target
    missing = [m for m in MEMBERS if not hasattr(layout, m)]
    if missing:
        raise TypeError(f"gives {type(layout).__name__}, which lacks {', '.join(missing[:6])}"
                        f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''} of the layout protocol "
                        "(ckptctl.layouts.base.Layout)")
    if not isinstance(getattr(layout, "name"), str):
        raise TypeError("its layout's `name` is not a string")
    return layout  # type: ignore[return-value]


def _name_refusal(name: str, taken: set[str]) -> str | None:
    """Why a plugin may not use ``name``, or None when it may."""
    if name in taken:
        return f"names its layout {name!r}, which another layout already has"
    if name == UNKNOWN:
        return f"names its layout {name!r}, which ckptctl uses for directories no layout claims"
    if canonical(name) is not None:
        return f"names its layout {name!r}, which ckptctl already uses for the format {canonical(name)!r}"
    if not _NAME.match(name):
        return (f"names its layout {name!r}; a layout's name is 1-64 lower-case letters, digits, "
                "'.', '_' or '-', starting with a letter or digit")
    return None


# Every layout: the built-in ones, then third-party ones, loaded once, here.
LAYOUTS: tuple[Layout, ...] = registered(BUILTIN)
FORMATS: tuple[str, ...] = tuple(layout.name for layout in LAYOUTS)  # what ``--format`` accepts


def layouts_named(formats: Sequence[str] | None) -> tuple[Layout, ...]:
    """The layouts of ``formats`` (names or aliases of ``format.formats``' vocabulary), all of
    them for None. Raises ValueError naming an unknown one, or a file format that is no layout."""
    if formats is None:
        return LAYOUTS
    wanted = names_among(formats, FORMATS)
    return tuple(layout for layout in LAYOUTS if layout.name in wanted)


def layout_named(name: str, root: Storage) -> Layout:
    """The layout called ``name``, bound to ``root``. Raises KeyError for an unknown name."""
    for layout in LAYOUTS:
        if layout.name == name:
            return layout.for_root(root)
    raise KeyError(name)


def layout_called(name: str) -> Layout | None:
    """The layout called ``name`` as a kind (what it does, not bound to a root: no pointer file
    read); None for ``unknown`` or any other name no layout has."""
    return next((layout for layout in LAYOUTS if layout.name == name), None)
