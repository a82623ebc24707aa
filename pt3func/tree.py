"""Pytree utilities: thin wrappers over optree in pt3func's own namespace.

Dicts, lists, tuples, namedtuples and `None` are nodes out of the box; register your own classes with
`register_node`. Leaves are everything else (tensors, Python scalars, ...). Classes registered with
`torch.utils._pytree` (Hugging Face's `ModelOutput`s) are adopted the first time `pf.jit` or `pf.vmap` meets one
(`adopt_torch_nodes`; `pf.grad` adopts them too).

A prefix tree (a weight-decay mask, shardings, vmap axes) is broadcast onto a full tree with `broadcast_prefix`,
which pairs the entries of dicts by key.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
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


class PrefixError(ValueError):
    """A tree is not a pytree prefix of another; `path` is where they first differ."""

    def __init__(self, path: tuple[Any, ...], detail: str) -> None:
        super().__init__(f"at {keystr(path) or 'the root'}: {detail}")
        self.path = path


# Dict nodes are matched by key: optree flattens a dict in sorted-key order but an OrderedDict (a state_dict) in
# insertion order, so pairing their children by position put a `{"weight": ..., "bias": ...}` prefix's entries on
# the wrong leaves of an `OrderedDict(weight=..., bias=...)`.
_DICTS = (dict, OrderedDict, defaultdict)


def broadcast_prefix(
    prefix: PyTree, full: PyTree, is_leaf: Callable[[Any], bool] | None = None, none_is_leaf: bool = False
) -> list[Any]:
    """One entry of `prefix` per leaf of `full` (in `full`'s flattening order): each leaf of `prefix` covers every
    leaf of the subtree of `full` at its path, as in JAX. Dict-like nodes (dict, OrderedDict, defaultdict) are
    matched by key, whatever their order or type; other nodes must have the same type and arity. Raises
    `PrefixError` naming the first path where `prefix` is not a prefix of `full` (shapes, not values)."""
    ns = NAMESPACE
    prefix_leaves, prefix_spec = optree.tree_flatten(prefix, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=ns)
    if prefix_spec == optree.tree_structure(full, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=ns):
        return prefix_leaves  # the same structure, dict key orders included: nothing to broadcast
    out: list[Any] = []
    _broadcast_into(out, prefix, full, (), is_leaf, none_is_leaf)
    return out


def _broadcast_into(
    out: list[Any], prefix: Any, full: Any, path: tuple[Any, ...], is_leaf: Callable[[Any], bool] | None,
    none_is_leaf: bool,
) -> None:
    ns = NAMESPACE
    if optree.tree_is_leaf(prefix, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=ns):
        out.extend([prefix] * optree.tree_structure(full, is_leaf=is_leaf, none_is_leaf=none_is_leaf,
                                                    namespace=ns).num_leaves)
        return
    if optree.tree_is_leaf(full, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=ns):
        raise PrefixError(path, f"the prefix has {_describe(prefix)} where the value has {_describe(full)}")
    p_children, p_meta, p_entries, _ = optree.tree_flatten_one_level(prefix, is_leaf=is_leaf,
                                                                     none_is_leaf=none_is_leaf, namespace=ns)
    f_children, f_meta, f_entries, _ = optree.tree_flatten_one_level(full, is_leaf=is_leaf,
                                                                     none_is_leaf=none_is_leaf, namespace=ns)
    if type(prefix) in _DICTS and type(full) in _DICTS:
        if set(p_entries) != set(f_entries):
            missing = [k for k in f_entries if k not in p_entries]
            extra = [k for k in p_entries if k not in f_entries]
            detail = f"the prefix has keys {_keys(p_entries)} where the value has keys {_keys(f_entries)}"
            detail += f"; missing from the prefix: {missing}" if missing else ""
            detail += f"; not in the value: {extra}" if extra else ""
            raise PrefixError(path, detail)
        by_key = dict(zip(p_entries, p_children))
        p_children = [by_key[k] for k in f_entries]
    elif type(prefix) is not type(full) or len(p_children) != len(f_children) or not _same(p_meta, f_meta):
        raise PrefixError(path, f"the prefix has {_describe(prefix)} where the value has {_describe(full)}")
    for entry, p_child, f_child in zip(f_entries, p_children, f_children):
        _broadcast_into(out, p_child, f_child, (*path, entry), is_leaf, none_is_leaf)


def _same(a: Any, b: Any) -> bool:
    """A custom node's metadata compared as optree does, tolerating metadata whose `==` is not a bool."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (ambiguous truth value: compare identity)
        return a is b


def _keys(entries: Any) -> list[Any]:
    return sorted(entries, key=repr)


def _describe(x: Any) -> str:
    """A short description of a subtree: types, keys, lengths and shapes, never a tensor's values."""
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):
        return f"a {type(x).__name__} of shape {tuple(shape)}"
    if type(x) in _DICTS:
        return f"a {type(x).__name__} with keys {_keys(x.keys())}"
    if hasattr(x, "_fields"):  # a namedtuple
        return f"a {type(x).__name__} with fields {tuple(x._fields)}"
    if type(x) in (list, tuple):
        return f"a {type(x).__name__} of {len(x)}"
    if x is None:
        return "None"
    text = repr(x)
    return text if len(text) <= 60 else f"a {type(x).__name__}"


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


def flatten_adopting(tree: PyTree) -> tuple[list[Any], TreeSpec]:
    """`flatten`, after adopting the `torch.utils._pytree` classes among the leaves (`adopt_torch_nodes`)."""
    leaves_, structure_ = flatten(tree)
    while adopt_torch_nodes(leaves_):
        leaves_, structure_ = flatten(tree)
    return leaves_, structure_


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

