"""Pytrees as flat dicts of DCP keys (`"opt_state/0/mu/fc1/w"`), and their structure as JSON for the manifest."""

from __future__ import annotations

import collections
import importlib
from collections.abc import Callable
from typing import Any

import optree

from pt3func.checkpointing.errors import CheckpointError
from pt3func.tree import NAMESPACE, PyTree

ROOT_KEY = "<root>"  # the key of a tree that is a single leaf (its path is empty)
DICT_KINDS = (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT)


def _entry_name(entry: Any) -> str:
    # NamedTuple entries carry the field name; spelling it ("mu", not "1") keeps keys readable and stable.
    field = getattr(entry, "field", None)
    return str(field if field is not None else entry.entry)


def flatten(tree: PyTree) -> tuple[dict[str, Any], Any]:
    """`tree` as `({key: leaf}, structure)`: a key joins the leaf's path with "/"; the structure is JSON-able."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, none_is_leaf=False, namespace=NAMESPACE)
    flat: dict[str, Any] = {}
    for accessor, leaf in zip(accessors, leaves):
        key = "/".join(_entry_name(e) for e in accessor) or ROOT_KEY
        if key in flat:
            raise CheckpointError(f"two leaves of the tree share the checkpoint key {key!r} (a dict key holding "
                                  f"'/', or both 1 and '1' as keys); rename one")
        flat[key] = leaf
    return flat, _encode(spec, (), tree)


def keys_and_spec(tree: PyTree) -> tuple[list[str], optree.PyTreeSpec]:
    """The checkpoint key of every leaf of `tree` in flattening order, and its treespec."""
    accessors, _, spec = optree.tree_flatten_with_accessor(tree, none_is_leaf=False, namespace=NAMESPACE)
    return ["/".join(_entry_name(e) for e in accessor) or ROOT_KEY for accessor in accessors], spec


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _child_nodes(node: Any, kind: optree.PyTreeKind, entries: list[Any]) -> list[Any]:
    """The subtrees of `node` in the treespec's order (None where they cannot be read: custom nodes)."""
    if kind in DICT_KINDS and isinstance(node, dict):
        return [node[e] for e in entries]
    if kind in (optree.PyTreeKind.LIST, optree.PyTreeKind.TUPLE, optree.PyTreeKind.NAMEDTUPLE) and node is not None:
        return list(node)
    return [None] * len(entries)


def _encode(spec: optree.PyTreeSpec, path: tuple[str, ...], node: Any = None) -> Any:
    """`spec` as JSON; `node`, the tree `spec` describes (where known), gives dicts their insertion order."""
    kind = spec.kind
    if kind == optree.PyTreeKind.LEAF:
        return "/".join(path) or ROOT_KEY
    if kind == optree.PyTreeKind.NONE:
        return None
    entries = spec.entries()
    names = list(spec.type._fields) if kind == optree.PyTreeKind.NAMEDTUPLE else [str(e) for e in entries]
    children = [_encode(child, (*path, name), sub)
                for child, name, sub in zip(spec.children(), names, _child_nodes(node, kind, entries))]
    if kind in DICT_KINDS:
        for key, name in zip(entries, names):
            if not _json_key(key):
                # The manifest keeps dict keys as JSON; refuse now, before any file is written, not in the commit.
                raise CheckpointError(
                    f"the dict key {key!r} at {'/'.join((*path, name))!r} is a {type(key).__name__}, which the "
                    f"checkpoint's manifest (JSON) cannot hold; use str, int, float, bool, None or tuples of "
                    f"them as keys (e.g. {str(key)!r})"
                )
        pairs = list(zip(entries, children))
        if isinstance(node, dict) and len(node) == len(pairs):
            # optree lists a dict's keys sorted; restore() without a target must give back the saved order (a
            # jitted step keys its programs by it, and code iterating the dict sees it).
            by_key = dict(pairs)
            pairs = [(key, by_key[key]) for key in node]
        return {"dict": [[key, child] for key, child in pairs]}
    if kind == optree.PyTreeKind.LIST:
        return {"list": children}
    if kind == optree.PyTreeKind.TUPLE:
        return {"tuple": children}
    if kind == optree.PyTreeKind.NAMEDTUPLE:
        return {"namedtuple": _type_name(spec.type), "fields": names, "children": children}
    return {"custom": _type_name(spec.type), "children": children}


def _json_key(key: Any) -> bool:
    """Whether JSON holds `key` (a tuple as a list, which `unflatten` turns back into a tuple)."""
    if isinstance(key, tuple):
        return all(_json_key(k) for k in key)
    return key is None or isinstance(key, (str, int, float))  # bool is an int


def _namedtuple_class(name: str, fields: list[str]) -> Callable[..., Any]:
    """The class `module:qualname` if it imports and has these fields, else a stand-in namedtuple."""
    module, _, qualname = name.partition(":")
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if list(cls._fields) == fields:
            return cls
    except (ImportError, AttributeError):
        pass
    # Values still come back in the right places; only isinstance checks against the original class fail.
    return collections.namedtuple(qualname.rpartition(".")[2] or "Restored", fields)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def unflatten(structure: Any, values: dict[str, Any]) -> PyTree:
    """Rebuild the tree that `flatten` described as `structure`, taking each leaf from `values` by key."""
    if structure is None:
        return None
    if isinstance(structure, str):
        return values[structure]
    if "dict" in structure:  # JSON wrote a tuple key as a list
        return {_hashable(key): unflatten(child, values) for key, child in structure["dict"]}
    if "list" in structure:
        return [unflatten(child, values) for child in structure["list"]]
    if "tuple" in structure:
        return tuple(unflatten(child, values) for child in structure["tuple"])
    if "namedtuple" in structure:
        cls = _namedtuple_class(structure["namedtuple"], structure["fields"])
        return cls(*(unflatten(child, values) for child in structure["children"]))
    raise CheckpointError(f"the checkpoint holds a custom pytree node {structure['custom']}, which only a target "
                          f"can rebuild: pass restore(target=...) with a tree of that structure")
