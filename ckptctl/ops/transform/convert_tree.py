"""The names and the structure ``convert`` writes: ``--only`` filtering and ``--strip-prefix``.

A state travels as ckptctl's encoded tree (``state.tree``: nested dicts, tensors as
``{"__tensor__": name}``) plus flat tensor names, which are the tree's paths joined with ``/``
(``model/fc.weight``). Both are rewritten together here, so a safetensors output's names, its
``ckptctl.state`` metadata and a torch or DCP output's nesting always agree.

``--strip-prefix P`` (for handing weights to inference code that expects ``fc.weight``, not
``model/fc.weight``): every tensor and every value whose path starts with P loses P and moves
up to where the rest of its path puts it; everything else keeps its name and place (pass
``--only P`` as well to leave it out). Two names that would become one are refused
(``UsageError`` naming both), as is a name that would become empty.
"""

from __future__ import annotations

from typing import Any, Sequence

from ckptctl.errors import UsageError
from ckptctl.interop.base import rename_refs
from ckptctl.state import tree as statetree


def tree_of(names: list[str]) -> dict:
    """Structure for a source that has only flat names: split on ``/`` as ckptctl joins them."""
    root: dict = {}
    for n in names:
        parts = [_unescape(p) for p in n.split("/")]
        node = root
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict) or statetree.TENSOR in nxt:
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = {statetree.TENSOR: n}
    return root


def filter_tree(doc: Any, keep: set[str], only: Sequence[str]) -> Any:
    """Drop references to tensors not kept. With ``--only``, non-tensor values are kept only
    under the top-level keys the prefixes name (the model's config, not the optimizer's)."""
    tops = {p.split("/", 1)[0] for p in only}

    def walk(node: Any, depth: int, top: str | None) -> tuple[bool, Any]:
        if isinstance(node, dict) and statetree.TENSOR in node and len(node) == 1:
            return node[statetree.TENSOR] in keep, node
        if isinstance(node, dict) and len(node) == 1 and (statetree.TUPLE in node or statetree.ITEMS in node):
            return (not only or top in tops), node  # tuples and odd-keyed dicts stay whole
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                ok, val = walk(v, depth + 1, k if depth == 0 else top)
                if ok:
                    out[k] = val
            return bool(out) or not node, out
        if isinstance(node, list):
            kept = [walk(v, depth + 1, top) for v in node]
            if any(statetree.tensor_refs(v) for v in node):
                return True, [v for ok, v in kept if ok]
            return (not only or top in tops), node
        return (not only or top in tops), node

    return walk(doc, 0, None)[1]


def strip_names(names: Sequence[str], prefix: str) -> dict[str, str]:
    """Old name -> new name under ``--strip-prefix prefix``; refuses collisions and empty names."""
    if not prefix:
        raise UsageError("--strip-prefix is empty", hint="give the prefix to remove, e.g. --strip-prefix model/")
    out: dict[str, str] = {}
    by_new: dict[str, str] = {}
    for n in names:
        new = n[len(prefix):] if n.startswith(prefix) else n
        if not new:
            raise UsageError(f"--strip-prefix {prefix!r} would leave tensor {n!r} without a name",
                             hint="strip a shorter prefix, ending at a '/' or '.'")
        if new in by_new:
            raise UsageError(f"--strip-prefix {prefix!r}: tensors {by_new[new]!r} and {n!r} would both be named {new!r}",
                             hint=f"add --only {prefix} to keep only the tensors under it, or strip a longer prefix")
        by_new[new] = n
        out[n] = new
    return out


def strip_tree(doc: Any, prefix: str, renamed: dict[str, str]) -> Any:
    """The tree with the paths under ``prefix`` moved up and references renamed (``renamed``
    from ``strip_names``). Refuses a value landing where another already is."""
    doc = rename_refs(doc, lambda n: renamed.get(n, n))
    if not isinstance(doc, dict) or _is_leaf(doc):
        return doc
    leaves: list[tuple[tuple[str, ...], Any]] = []
    _flatten(doc, (), leaves)
    root: dict = {}
    placed: dict[tuple[str, ...], str] = {}  # new path -> old path shown, for messages
    for path, value in leaves:
        joined = statetree.join(path)
        new = tuple(_unescape(p) for p in joined[len(prefix):].split("/")) if joined.startswith(prefix) else path
        if not new or new == ("",):
            raise UsageError(f"--strip-prefix {prefix!r} would leave state key {joined!r} without a name",
                             hint="strip a shorter prefix, ending at a '/' or '.'")
        for i in range(1, len(new) + 1):
            clash = placed.get(new[:i])
            if clash is not None or (i == len(new) and _holds(root, new)):
                other = repr(clash) if clash is not None else "another key"
                raise UsageError(f"--strip-prefix {prefix!r}: state key {joined!r} would collide with {other} "
                                 f"at {statetree.join(new[:i])!r}",
                                 hint=f"add --only {prefix} to keep only what is under it, or strip a longer prefix")
        node = root
        for p in new[:-1]:
            node = node.setdefault(p, {})
        node[new[-1]] = value
        placed[new] = joined
    return root


def _is_leaf(node: Any) -> bool:
    return not isinstance(node, dict) or (len(node) == 1 and bool({statetree.TENSOR, statetree.TUPLE, statetree.ITEMS} & node.keys()))


def _flatten(node: Any, path: tuple[str, ...], out: list[tuple[tuple[str, ...], Any]]) -> None:
    if _is_leaf(node) or not node:  # an empty dict is a value of its own
        out.append((path, node))
        return
    for k, v in node.items():
        _flatten(v, path + (k,), out)


def _holds(root: dict, path: tuple[str, ...]) -> bool:
    node: Any = root
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def _unescape(part: str) -> str:
    return part.replace("%2F", "/").replace("%25", "%")
