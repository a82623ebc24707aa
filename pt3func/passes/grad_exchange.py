"""Compressed gradient exchange: rewrite every gradient reduction of a traced program (Graph -> Graph).

A gradient reduction is an `all_reduce` (data parallel) or `reduce_scatter_tensor` (FSDP) whose
`meta["custom"]` names the leaf it reduces (set by `spmd.lower.reduce_gradient`), followed by its
`wait_tensor`. Each is replaced by the format's compressed reduction: `fmt.reduce` is traced with make_fx (fake
mode) on values of the node's shape, with the group name, group size and this device's rank as constants
(the program is per device), and its graph is inlined where the collective was. Error-feedback state enters as
the program inputs of an `ExchangeState` and its new values go out through the same state's outputs; the step
counter is incremented.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from pt3func import analysis, tree
from pt3func.compress.formats import Format, Reduction, leaf_seed
from pt3func.compress.state import ExchangeState, LeafState, is_leaf_state, is_state
from pt3func.passes import replace_outputs
from pt3func.spmd.lower import GRAD_OF

_WAIT = torch.ops._c10d_functional.wait_tensor.default
# Set on every node the pass writes: its collectives still exchange a gradient (tagged GRAD_OF with the leaf, for
# analyses of gradient traffic), but they are already compressed.
COMPRESSED = "pt3func_compressed"
_KINDS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter"}
# The argument of a step a leaf label starts with: a parameter name, or args[i] for *args.
_ARG = re.compile(r"([A-Za-z_]\w*|args\[\d+\])(.*)$", re.S)


class GradExchangeError(ValueError):
    """The grad_exchange state does not fit the program (missing, not returned, wrong shapes)."""


@dataclass
class StateBinding:
    """Where an `ExchangeState`'s tensors are among a program's inputs and outputs (graph positions)."""

    format: Format
    data_axes: tuple[str, ...] | None
    step_in: int
    step_out: int | None
    # leaf path ("['fc1']['w']") -> (LeafState of input positions, LeafState of output positions or None)
    leaves: dict[str, tuple[LeafState, LeafState | None]] = field(default_factory=dict)
    phase: int = 0  # the state's phase (format.schedule()): the program is the format's `at(phase)`


def default_group_info(group_name: str) -> tuple[int, int]:
    """(size, this process's rank) of the process group registered as `group_name`."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return group.size(), dist.get_rank(group)


def gradient_reductions(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, str]]:
    """`(collective, wait, leaf label)` of every gradient reduction of `gm`, in program order."""
    found = []
    for node in gm.graph.nodes:
        if not analysis.is_collective(node) or analysis.collective_kind(node) not in _KINDS:
            continue
        label = (node.meta.get("custom") or {}).get(GRAD_OF)
        users = list(node.users)
        if label is None or len(users) != 1 or users[0].target is not _WAIT:
            continue
        if node.meta["custom"].get(COMPRESSED):
            continue
        if node.args[1] not in ("sum", "avg"):
            continue
        found.append((node, users[0], label))
    return found


def _split_label(label: str) -> tuple[str, str]:
    """`params['fc1']['w']` -> (`params`, `['fc1']['w']`)."""
    m = _ARG.match(label)
    return (m.group(1), m.group(2)) if m else (label, "")


def rewrite(
    gm: fx.GraphModule,
    fmt: Format,
    binding: StateBinding | None = None,
    *,
    name: str = "step",
    group_info: Callable[[str], tuple[int, int]] = default_group_info,
) -> fx.GraphModule:
    """Replace each gradient reduction of `gm` by `fmt`'s compressed reduction (in place); returns `gm`.

    `binding` says where the `ExchangeState` is among the inputs and outputs (None: the step has none, which
    is an error only if some leaf's format needs state). `group_info(group_name) -> (size, rank)`.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output_node.args[0])
    done: set[str] = set()
    changed = False
    phase = binding.phase if binding is not None else 0
    if fmt.schedule() and binding is None:
        raise GradExchangeError(
            f"{name}: grad_exchange ({fmt.describe()}) changes program at steps {list(fmt.schedule())}, counted by "
            f"the ExchangeState's step, but the step takes no ExchangeState. Build it with state = "
            f"exchange.init(params), pass it to the step and return it unchanged."
        )
    for collective, wait, label in gradient_reductions(gm):
        if label in done:  # a second reduction of the same leaf (e.g. over another axis) stays exact
            continue
        done.add(label)
        _, path = _split_label(label)
        x = collective.args[0]
        shape = tuple(x.meta["val"].shape)
        leaf_fmt = fmt.resolve(path, shape)
        if leaf_fmt is not None and not set(leaf_fmt.schedule()) <= set(fmt.schedule()):
            raise GradExchangeError(
                f"{name}: {label}'s format {leaf_fmt.describe()} changes program at steps "
                f"{list(leaf_fmt.schedule())}, which the top-level format {fmt.describe()} does not announce "
                f"(per_leaf cannot know them): give dense_steps / warmup_steps to the top-level format only"
            )
        leaf_fmt = None if leaf_fmt is None else leaf_fmt.at(phase)
        if leaf_fmt is None:
            continue
        kind = _KINDS[analysis.collective_kind(collective)]
        group_name = collective.args[-1]
        world, rank = group_info(group_name)
        r = Reduction(kind, collective.args[1], group_name, world, rank, tuple(wait.meta["val"].shape), leaf_seed(path))
        needed = leaf_fmt.state_shapes(shape, kind, world)
        if (needed or leaf_fmt.needs_step) and binding is None:
            raise GradExchangeError(
                f"{name}: grad_exchange ({fmt.describe()}) keeps state for {label} (error-feedback residuals, a "
                f"step counter), but the step takes no ExchangeState. Build it with state = exchange.init(params) "
                f"(or pf.compress.with_state(opt, exchange)), pass it to the step and return it unchanged."
            )
        state_in, state_out = binding.leaves.get(path, (LeafState(), None)) if binding else (LeafState(), None)
        names = list(needed)
        inputs = [x]
        stored: dict[str, tuple[int, ...]] = {}  # each state tensor's local shape, kept for its new value
        for field_name in names:
            pos = getattr(state_in, field_name)
            if pos is None:
                raise GradExchangeError(
                    f"{name}: the ExchangeState has no {field_name} for {label}, which {leaf_fmt.describe()} needs "
                    f"(gradient of local shape {list(shape)} before its {kind} over {world} ranks). Build the state "
                    f"with the same format and parameters; on a mesh of several axes pass data_axes= to init."
                )
            node = placeholders[pos]
            have = tuple(node.meta["val"].shape[1:])
            if math.prod(have) != math.prod(needed[field_name]):
                raise GradExchangeError(
                    f"{name}: the {field_name} of {label} in the ExchangeState has local shape {list(have)}, but "
                    f"the gradient entering its {kind} over {world} ranks needs {list(needed[field_name])} "
                    f"(gradient shape {list(shape)}). Was the state built for other shardings? Pass the axes that "
                    f"split the data as init(params, data_axes=...) (now {binding.data_axes})."
                )
            inputs.append(node)
            stored[field_name] = tuple(node.meta["val"].shape)
        with_step = leaf_fmt.needs_step
        if with_step:
            inputs.append(placeholders[binding.step_in])

        def compressed(x_val, *rest, _fmt=leaf_fmt, _r=r, _names=names, _shapes=needed, _stored=stored,
                       _with_step=with_step):
            state = {n: t.view(_shapes[n]) for n, t in zip(_names, rest)}
            step = rest[-1] if _with_step else None
            out, new = _fmt.reduce(x_val, state, step, _r)
            return [out, *(new[n].reshape(_stored[n]) for n in _names)]

        why = f"grad of {label} ({leaf_fmt.describe()})"
        results = _inline(gm, collective, compressed, inputs, {"pt3func": why, GRAD_OF: label, COMPRESSED: True})
        wait.replace_all_uses_with(results[0])
        gm.graph.erase_node(wait)
        gm.graph.erase_node(collective)
        if state_out is not None:
            for field_name, new_value in zip(names, results[1:]):
                pos = getattr(state_out, field_name)
                if pos is not None:
                    outs[pos] = new_value
        changed = True
    if binding is not None:
        if binding.step_out is None:
            raise GradExchangeError(
                f"{name}: the step takes an ExchangeState but does not return it; return it (unchanged) with the "
                "optimizer state, so the program can hand back the new residuals and step counter"
            )
        with gm.graph.inserting_before(output_node):
            step_in = placeholders[binding.step_in]
            new_step = gm.graph.call_function(torch.ops.aten.add.Tensor, (step_in, 1))
            new_step.meta["val"] = step_in.meta["val"] + 1
            new_step.meta["custom"] = {"pt3func": f"grad_exchange step counter ({fmt.describe()})"}
        outs[binding.step_out] = new_step
        changed = True
    if changed:
        replace_outputs(gm, outs)
    return gm


def _inline(
    gm: fx.GraphModule, before: fx.Node, fn: Callable, inputs: list[fx.Node], custom: dict[str, Any]
) -> list[fx.Node]:
    """Trace `fn` on the fake values of `inputs` and copy its graph into `gm` before `before`, each new node
    with `custom` as its `meta["custom"]`."""
    from pt3func.trace.capture import TRACE_LOCK

    with TRACE_LOCK:
        sub = make_fx(fn, tracing_mode="fake")(*[n.meta["val"] for n in inputs])
    env: dict[fx.Node, Any] = {}
    sub_inputs = iter(inputs)
    results: list[fx.Node] = []
    with gm.graph.inserting_before(before):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(sub_inputs)
            elif node.op == "output":
                results = [env[o] for o in node.args[0]]
            elif node.op == "get_attr":
                attr = getattr(sub, node.target)
                new_name = _free_attr(gm, "_grad_exchange_const")
                setattr(gm, new_name, attr)
                env[node] = gm.graph.get_attr(new_name)
                env[node].meta = dict(node.meta)
            else:
                new = gm.graph.node_copy(node, lambda n: env[n])
                new.meta = dict(node.meta)
                new.meta["custom"] = dict(custom)
                if "stack_trace" in before.meta:
                    new.meta["stack_trace"] = before.meta["stack_trace"]
                env[node] = new
    return results


def _free_attr(gm: fx.GraphModule, prefix: str) -> str:
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


# ------------------------------------------------------------------------------------------ jit plumbing


def bind(
    name: str,
    treedef: Any,
    out_treedef: Any,
    out_source: dict[int, int],
    graph_input_leaves: list[int],
    graph_output_leaves: list[int],
) -> StateBinding | None:
    """Find the `ExchangeState` among a call's leaves and the step's outputs; map it to graph positions.

    `out_source[j] = i` when output leaf j is the call's input leaf i itself (returned unchanged).
    """
    states_in = _states(tree.unflatten(treedef, list(range(treedef.num_leaves))))
    if not states_in:
        return None
    if len(states_in) > 1:
        raise GradExchangeError(f"{name}: the step takes {len(states_in)} ExchangeStates; pass exactly one")
    state_in = states_in[0]
    gin = {leaf: g for g, leaf in enumerate(graph_input_leaves)}
    gout = {leaf: g for g, leaf in enumerate(graph_output_leaves)}
    state_out = next(
        (s for s in _states(tree.unflatten(out_treedef, list(range(out_treedef.num_leaves))))
         if out_source.get(s.step) == state_in.step),
        None,
    )
    binding = StateBinding(state_in.format, state_in.data_axes, gin[state_in.step],
                           None if state_out is None else gout.get(state_out.step), phase=state_in.phase)
    out_leaves = {} if state_out is None else _leaf_states(state_out.leaves)
    for path, ls in _leaf_states(state_in.leaves).items():
        out = out_leaves.get(path)
        binding.leaves[path] = (
            LeafState(*(None if i is None else gin[i] for i in ls)),
            None if out is None else LeafState(*(None if j is None else gout.get(j) for j in out)),
        )
    return binding


def has_state(treedef: Any) -> bool:
    """Whether a call of this structure passes an `ExchangeState`."""
    return bool(_states(tree.unflatten(treedef, list(range(treedef.num_leaves)))))


def _states(skeleton: Any) -> list[ExchangeState]:
    return [x for x in tree.leaves(skeleton, is_leaf=is_state) if isinstance(x, ExchangeState)]


def _leaf_states(leaves: Any) -> dict[str, LeafState]:
    paths = tree.paths(leaves, is_leaf=is_leaf_state)
    return {tree.keystr(p): ls for p, ls in zip(paths, tree.leaves(leaves, is_leaf=is_leaf_state))}


def check_format(name: str, fmt: Format, binding: StateBinding | None) -> None:
    """The state must come from the format the program is compiled with."""
    if binding is not None and binding.format != fmt:
        raise GradExchangeError(
            f"{name}: the ExchangeState was built by {binding.format.describe()}, but pf.jit(grad_exchange=...) "
            f"is {fmt.describe()}; build the state with the same format"
        )
