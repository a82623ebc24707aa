"""Pytree utilities: thin wrappers over optree in pt3func's own namespace.

Dicts, lists, tuples, namedtuples and `None` are nodes out of the box; register your own classes with
`register_node`. Leaves are everything else (tensors, Python scalars, ...). Classes registered with
`torch.utils._pytree` (Hugging Face's `ModelOutput`s) are adopted the first time `pf.jit` or `pf.vmap` meets one
(`adopt_torch_nodes`).
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


_ADOPTED: set[type] = set()


def adopt_torch_nodes(leaves: list[Any]) -> bool:
    """Register as nodes here the types among `leaves` that `torch.utils._pytree` knows as nodes (Hugging Face
    registers its `ModelOutput`s there, not with optree), so their tensors are leaves rather than one opaque
    object. Returns True when something new was registered (flatten again)."""
    from torch.utils import _pytree

    known = _pytree.SUPPORTED_NODES
    adopted = False
    for leaf in leaves:
        cls = type(leaf)
        node = known.get(cls) if cls not in _ADOPTED else None
        if node is None:
            continue
        _ADOPTED.add(cls)
        register_node(cls, _torch_flatten(node), _torch_unflatten(node))
        adopted = True
    return adopted


def _torch_flatten(node: Any) -> Callable:
    with_keys = getattr(node, "flatten_with_keys_fn", None)

    def flatten_fn(x: Any) -> tuple[Any, ...]:
        if with_keys is None:
            children, context = node.flatten_fn(x)
            return children, context
        keyed, context = with_keys(x)
        entries = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k, _ in keyed]
        return [child for _, child in keyed], context, entries

    return flatten_fn


def _torch_unflatten(node: Any) -> Callable:
    return lambda context, children: node.unflatten_fn(list(children), context)

