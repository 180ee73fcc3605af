"""The names in the CLI's JSON: one name per idea across verbs (schema 2), and the older names
printed again for scripts that still read them (``CKPTCTL_JSON_SCHEMA=1``).

Schema 2 settled what schema 1 said two ways:

- ``layout``: which stack's layout a checkpoint follows (ckptctl-layouts(7)); schema 1 said
  ``format`` in ``latest``, ``repoint`` and foreign entries of ``verify``. ``format`` now only
  ever means a file format, as ``convert --to`` and ``inspect`` of a single file use it;
- ``bytes``: a size; schema 1 also printed ``size`` (prune items, inspect files),
  ``total_bytes`` (inspect) and ``bytes_copied`` (cp, restore);
- ``status``: what a checkpoint is (committed, partial, ...); schema 1 said ``kind`` in
  prune's items;
- ``url``: where a thing is; schema 1 said ``target`` in seal.

The library's result objects keep their attribute names (``CopyResult.bytes_copied``); this
table is applied once, where a verb prints its document, so each verb's code builds its
document the one way. The table is also the list of what changed, for man/ckptctl-json.7.
"""

from __future__ import annotations

from typing import Any

SCHEMA = 2  # the "schema" field of every JSON document the CLI prints by default
SCHEMA_ENV = "CKPTCTL_JSON_SCHEMA"

# verb -> (where, old name, new name); "where" is a dotted path from the document's top, with
# "[]" for every element of a list ("" is the top level).
RENAMED_IN_2: dict[str, tuple[tuple[str, str, str], ...]] = {
    "latest": (("", "format", "layout"),),
    "repoint": (("", "format", "layout"),),
    "verify": (("checkpoints[]", "format", "layout"),),
    "prune": (("plan.items[]", "kind", "status"), ("plan.items[]", "size", "bytes")),
    "inspect": (("", "total_bytes", "bytes"), ("files[]", "size", "bytes")),
    "cp": (("", "bytes_copied", "bytes"),),
    "restore": (("copy", "bytes_copied", "bytes"),),
    "seal": (("", "target", "url"),),
}


def requested_schema() -> int:
    """The schema a user asked for with CKPTCTL_JSON_SCHEMA (1 or 2), else the current one."""
    # Imported here: the settings raise on a malformed variable when first imported, which
    # cli.common.check_environment turns into exit 2 before this module is used.
    from ckptctl.settings import env_int

    return env_int(SCHEMA_ENV, SCHEMA, minimum=1, maximum=SCHEMA)


def named(verb: str, doc: dict[str, Any], schema: int) -> dict[str, Any]:
    """``doc`` as ``verb`` prints it in ``schema``: in 2 each old name becomes the new one (a
    value the document already holds under the new name wins); in 1 the new name's value is
    also printed under the old name, as schema 1 printed both where it had both."""
    for where, old, new in RENAMED_IN_2.get(verb, ()):
        for obj in objects_at(doc, where):
            if schema >= 2 and old in obj:
                _rename(obj, old, new)
            elif schema < 2 and new in obj and old not in obj:
                obj[old] = obj[new]
    return doc


def _rename(obj: dict[str, Any], old: str, new: str) -> None:
    """Rename ``old`` to ``new`` in place, where ``old`` stood (or drop ``old`` when ``new`` is
    there already: both held the same value in schema 1)."""
    items = list(obj.items())
    had_new = new in obj
    obj.clear()
    for key, value in items:
        if key == old:
            if not had_new:
                obj[new] = value
        else:
            obj[key] = value


def objects_at(doc: Any, where: str) -> list[dict[str, Any]]:
    found = [doc]
    for part in filter(None, where.split(".")):
        each = part.endswith("[]")
        key = part[:-2] if each else part
        nxt: list[Any] = []
        for obj in found:
            value = obj.get(key) if isinstance(obj, dict) else None
            if each and isinstance(value, list):
                nxt += value
            elif not each and value is not None:
                nxt.append(value)
        found = nxt
    return [o for o in found if isinstance(o, dict)]
