"""A data dependency that orders ops without changing values: `where(never, 0, x)`.

A compiler may run an op as early as its inputs exist, and Inductor does, fusing it into whatever kernel reads
the same inputs. Passes that need an op to run *after* some value `t` exists (recomputation after the
backward reached it, a composite backward op after its gradient, one loss chunk after the previous one) read
one of the op's inputs through `read_after(never_after(t), x)`: `never` is `isnan(e) & isinf(e)` of one
element `e` of `t`, always False and never folded by a compiler, so the select passes `x` through bit for bit
while depending on `t`. It fuses into its consumer's kernel as one scalar load (an extern kernel such as a
matmul reads it materialised: a copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten


def _custom(node: fx.Node) -> dict:
    return node.meta.get("custom") or {}


def tag_like(node: fx.Node) -> str:
    """The default tag of a fence node: that of the op it serves, marked as a fence (analyses then count it on
    the same side, forward or backward, as that op)."""
    return f"{_custom(node).get('pt3func')} (fence)"


def _meta(node: fx.Node, like: fx.Node, val: torch.Tensor, tag: Callable[[fx.Node], str]) -> None:
    node.meta = {"custom": {**_custom(like), "pt3func": tag(like)}, "val": val}
    if "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]


def _fake_mode(val: torch.Tensor) -> contextlib.AbstractContextManager:
    mode = detect_fake_mode([val])
    return mode if mode is not None else contextlib.nullcontext()


def never_after(graph: fx.Graph, token: fx.Node, at: fx.Node, tag: Callable[[fx.Node], str] = tag_like) -> fx.Node:
    """A 0-d bool, always False, computed from one element of `token` (inserted at the graph's insert point;
    the new nodes are tagged `tag(at)`)."""
    val = token.meta["val"]
    element = token
    with _fake_mode(val):
        elem_val = val
        for _ in range(val.dim()):
            element = graph.call_function(aten.select.int, (element, 0, 0))
            elem_val = elem_val.select(0, 0)
            _meta(element, at, elem_val, tag)
        nan = graph.call_function(aten.isnan.default, (element,))
        _meta(nan, at, torch.isnan(elem_val), tag)
        inf = graph.call_function(aten.isinf.default, (element,))
        _meta(inf, at, torch.isinf(elem_val), tag)
        never = graph.call_function(aten.logical_and.default, (nan, inf))
        _meta(never, at, torch.logical_and(torch.isnan(elem_val), torch.isinf(elem_val)), tag)
    return never


def read_after(
    graph: fx.Graph, never: fx.Node, value: fx.Node, at: fx.Node, tag: Callable[[fx.Node], str] = tag_like
) -> fx.Node:
    """`value`, read through `where(never, 0, value)`: the same values, after `never`'s token exists."""
    val = value.meta["val"]
    zero = False if val.dtype == torch.bool else 0
    node = graph.call_function(aten.where.ScalarSelf, (never, zero, value))
    with _fake_mode(val):
        _meta(node, at, torch.where(never.meta["val"], zero, val), tag)
    return node
