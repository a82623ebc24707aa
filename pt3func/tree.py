"""Pytree utilities: thin wrappers over optree in pt3func's own namespace.

Dicts, lists, tuples, namedtuples and `None` are nodes out of the box; register your own classes with
`register_node`. Leaves are everything else (tensors, Python scalars, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

NAMESPACE = "pt3func"

PyTree = Any
TreeSpec = optree.PyTreeSpec


def flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeSpec]:
    """Return the leaves of `tree` and its structure (`unflatten(structure, leaves)` rebuilds it)."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def unflatten(structure: TreeSpec, leaves: list[Any]) -> PyTree:
    """Rebuild a pytree of `structure` from `leaves`."""
    return optree.tree_unflatten(structure, leaves)


def leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of `tree`, in flattening order."""
    return optree.tree_leaves(tree, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def structure(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> TreeSpec:
    """The structure (treedef) of `tree`."""
    return optree.tree_structure(tree, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> PyTree:  # noqa: A001
    """Apply `fn` leaf-wise over `tree` and any `rest` trees of the same structure."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def map_with_path(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """Like `map`, but `fn(path, leaf, *rest_leaves)` also receives the leaf's path (a tuple of keys)."""
    return optree.tree_map_with_path(fn, tree, *rest, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def paths(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[Any, ...]]:
    """The path (tuple of keys) of every leaf, in flattening order."""
    return optree.tree_paths(tree, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def keystr(path: tuple[Any, ...]) -> str:
    """Render a leaf path the way users index it: `['blocks']['0']['weight']` or `[1][0]`."""
    return "".join(f"[{key!r}]" for key in path)


def register_node(cls: type, flatten_fn: Callable, unflatten_fn: Callable) -> None:
    """Register `cls` as a pytree node: `flatten_fn(x) -> (children, aux)`, `unflatten_fn(aux, children) -> x`."""
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
