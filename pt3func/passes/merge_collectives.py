"""Merge collectives that move the same value twice (Graph -> Graph).

DTensor redistributes an operand inside each op that reads it, and nothing remembers the result: with sequence
parallelism the normed activations, split along the sequence, are all-gathered once for q, once for k and once for
v (and again in the backward); behind a vocabulary-parallel head a pending gradient is all-reduced once for the
product that gives the weight's gradient and once for the one that gives the input's. Each such operand is a
fresh view of the same tensor (`view(%mul, [8, 16])` three times), so the collectives' inputs are different nodes
holding the same value.

This pass keeps the first of two collectives that have the same op, the same arguments (group, sizes, reduce op)
and the same input value, and makes the second's readers read the first's result. Two inputs hold the same value
when they are the same node or the same view op (`view`, `t`, `transpose`, `permute`, ...) with the same
arguments of the same value. An all-reduce sums elementwise, so it commutes with views that keep every element
once (reshapes, transposes, permutations, `unsqueeze`, ...): where two all-reduces read such views of one
contiguous tensor, each is first rewritten as the view of the tensor's all-reduce (the same bytes), so
`all_reduce(t(g))` and `all_reduce(g)` become one. Gradient reductions (`pt3func_grad_of`, which `grad_exchange`
and bucketing rewrite) are left as they are, and so are a forward's collective and a backward's: merged, the
backward would read the forward's gathered activation, kept alive in between, where it gathers its own again now
(as Megatron's sequence parallelism does, to save that memory). Within a phase the kept result lives until the
last reader of either; the collectives merged in practice read one value in neighbouring ops (q, k and v; a
product and its transpose).

Every rank's program gets the same merges: the decisions read only the graph's structure and constant arguments,
which every rank's trace of the step has alike (the collectives stay in the same order, fewer of them); no rank's
data, and nothing that differs between processes (ids, hashes of objects), is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from pt3func.analysis import is_collective
from pt3func.passes.remat import is_backward
from pt3func.trace.capture import eliminate_dead_code, mutated_args, storage_root

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default

# Views whose result is a function of their input's value (and their constant arguments) alone.
_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.alias.default, aten.detach.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
})
# Of those, the ones that keep every element exactly once: an all-reduce of the view is the view of the all-reduce.
_BIJECTIVE_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.alias.default, aten.detach.default,
})


def merge_duplicate_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Read one collective's result where another moved the same value the same way (in place); returns `gm`."""
    graph = gm.graph
    changed = _all_reduce_views_after(graph)
    values = _view_values(graph)
    first: dict[Any, fx.Node] = {}
    position = {node: i for i, node in enumerate(graph.nodes)}
    # Where each storage is written in place: a write between two collectives of one value (`h.add_(1)` between
    # two gathers of a view of h) makes the second move other numbers.
    writes: dict[fx.Node, list[int]] = {}
    for node in graph.nodes:
        for target in mutated_args(node):
            writes.setdefault(storage_root(target), []).append(position[node])
    for node in list(graph.nodes):
        wait = _mergeable_wait(node)
        if wait is None:
            continue
        key = (is_backward(node), str(node.target), _value(node.args, values), _value(node.kwargs, values))
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        kept_wait = next(iter(kept.users))
        if position[kept_wait] > position[node]:
            continue  # the first result is read only after this collective is issued: not moved here
        root = storage_root(node.args[0])
        if any(position[kept] < at < position[node] for at in writes.get(root, ())):
            continue
        wait.replace_all_uses_with(kept_wait)
        graph.erase_node(wait)
        graph.erase_node(node)
        changed = True
    if changed:
        eliminate_dead_code(graph)
        graph.lint()
        gm.recompile()
    return gm


def _view_values(graph: fx.Graph) -> dict[fx.Node, Any]:
    """Each view node's value, as `_value` compares them: what it views and how."""
    values: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS and _args_are_constant(node):
            values[node] = (str(node.target), _value(node.args, values), _value(node.kwargs, values))
    return values


def _mergeable_wait(node: fx.Node) -> fx.Node | None:
    """The wait of a collective this pass may merge: one tensor in, one tensor out, read through its one wait, not
    a gradient's reduction."""
    if not is_collective(node) or node.target._schema.is_mutable:
        return None
    if "pt3func_grad_of" in (node.meta.get("custom") or {}):
        return None
    if not isinstance(node.meta.get("val"), torch.Tensor) or not isinstance(node.args[0], fx.Node):
        return None
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is _WAIT else None


def _args_are_constant(node: fx.Node) -> bool:
    """A view of one tensor (its first argument), every other argument a constant."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), found.append)
    return bool(node.args) and isinstance(node.args[0], fx.Node) and not found


def _value(arg: Any, values: dict[fx.Node, Any]) -> Any:
    """A hashable stand-in for an argument's value: a view's node by what it views and how, any other node by its
    identity, a constant by its type and repr."""
    if isinstance(arg, fx.Node):
        return values.get(arg, ("node", arg))
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_value(a, values) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple(sorted((k, _value(v, values)) for k, v in arg.items())))
    return (type(arg).__name__, repr(arg))


def _all_reduce_views_after(graph: fx.Graph) -> bool:
    """Where two all-reduces (same arguments otherwise) read views of one value, each through views that keep every
    element once of a contiguous tensor (whose all-reduce is contiguous too, so the views apply to it as they did
    to the tensor): rewrite each `all_reduce(view(x))` as `view(all_reduce(x))`, so that they read the same value.
    The others are left as they are."""
    values = _view_values(graph)
    groups: dict[Any, list[tuple[fx.Node, list[fx.Node]]]] = {}
    for node in graph.nodes:
        if node.target is not _ALL_REDUCE or _mergeable_wait(node) is None:
            continue
        chain, source = [], node.args[0]
        while source.op == "call_function" and source.target in _BIJECTIVE_VIEWS and _args_are_constant(source) \
                and _contiguous(source.args[0]):
            chain.append(source)
            source = source.args[0]
        key = (is_backward(node), _value(source, values), _value(node.args[1:], values), _value(node.kwargs, values))
        groups.setdefault(key, []).append((node, chain))
    changed = False
    for members in groups.values():
        if len({_value(node.args[0], values) for node, _ in members}) < 2:
            continue  # one value read the same way (or one all-reduce): merged as it is
        for node, chain in members:
            if chain:
                _view_after(graph, node, chain)
                changed = True
    return changed


def _view_after(graph: fx.Graph, node: fx.Node, chain: list[fx.Node]) -> None:
    """`all_reduce(chain(x))` -> `chain(all_reduce(x))`; `chain` runs from the view the all-reduce reads to the
    view of `x`."""
    source = chain[-1].args[0]
    wait = next(iter(node.users))
    readers = list(wait.users)
    node.replace_input_with(node.args[0], source)
    node.meta["val"] = _fake(torch.empty_like, source.meta["val"])
    wait.meta["val"] = _fake(torch.empty_like, source.meta["val"])
    out = wait
    for view in reversed(chain):  # from the view of `source` outwards
        with graph.inserting_after(out):
            copy = graph.call_function(view.target, (out, *view.args[1:]), dict(view.kwargs))
        copy.meta = {**view.meta, "val": _fake(lambda x, v=view: v.target(x, *v.args[1:], **v.kwargs),
                                               out.meta["val"])}
        out = copy
    for reader in readers:
        reader.replace_input_with(wait, out)


def _contiguous(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _fake(make: Any, val: torch.Tensor) -> torch.Tensor:
    """`make(val)` in the fake mode `val` belongs to (a value of the traced program's meta)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([val])
    if mode is None:
        return make(val)
    with mode:
        return make(val)
