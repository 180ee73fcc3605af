"""Which layouts ckptctl knows: the built-in ones, then third-party ones by entry point.

``layouts.catalog`` lists its built-in layouts (ckptctl's own first) and asks ``registered``
once, at import, for the full tuple every verb uses (``catalog.LAYOUTS``). A third-party
distribution adds a layout by declaring an entry point in the group ``ckptctl.layouts`` whose
target is a layout class (instantiated with no arguments) or instance (docs/extending.md):

    [project.entry-points."ckptctl.layouts"]
    toy = "ckptctl_toy_layout:ToyLayout"

Plugins come after every built-in layout, so a directory that a built-in layout claims stays
that layout's whatever a plugin says. Each is held as a guest (``layouts.guest``): its code
runs with stdout kept for ckptctl, and a call that raises fails only what it claims. A plugin is skipped, with one warning on stderr naming
its entry point and the fix (``ckptctl.plugins``), when it cannot be imported, when it is no
``StackLayout``, or when its name is already taken: by a built-in layout, by any name or alias
of the format vocabulary (``format.formats``: ``--format hf`` must keep meaning the Trainer),
by ``unknown``, or by an earlier plugin.
"""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint
from typing import Iterable, Sequence

from ckptctl import plugins
from ckptctl.format.formats import canonical
from ckptctl.layouts.base import UNKNOWN, Layout
from ckptctl.layouts.guest import guest_layout
from ckptctl.layouts.stack import StackLayout

GROUP = "ckptctl.layouts"

# Lower case because ``--format`` is matched case-insensitively; no spaces or commas so that a
# name reads the same in ``ls``'s FORMAT column, in JSON and in a shell.
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}\Z", re.ASCII)


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
    # The verbs still ask other tools' layouts for StackLayout's methods (check, removal_order,
    # commit_files, pointers, resume); a plugin that is only a ``base.Layout`` would list and
    # then fail in them. When every verb asks ``Layout`` alone, this relaxes to that protocol.
    if not isinstance(layout, StackLayout):
        raise TypeError(f"gives {type(layout).__name__}, not a subclass of ckptctl.layouts.stack.StackLayout")
    if not isinstance(layout.name, str):
        raise TypeError("its layout has no name (set the class attribute `name`)")
    return layout


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
