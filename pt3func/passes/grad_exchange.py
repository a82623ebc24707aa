"""Compressed gradient exchange: rewrite every gradient reduction of a traced program (Graph -> Graph).

A gradient reduction is an `all_reduce` (data parallel) or `reduce_scatter_tensor` (FSDP) whose
`meta["custom"]` names the leaf it reduces (set by `spmd.lower.reduce_gradient`), followed by its
`wait_tensor`. Each is replaced by the format's compressed reduction: `fmt.reduce` is traced with make_fx (fake
mode) on values of the node's shape, with the group name, group size and this device's rank as constants
(the program is per device), and its graph is inlined where the collective was. Error-feedback state enters as
the program inputs of an `ExchangeState` and its new values go out through the same state's outputs; the step
counter is incremented.

Reductions of the elementwise formats (codecs: bf16, fp16, int8, int4) are bucketed first: per leaf, each costs
its own encode, collectives and decode, which made the anchor GPT's int8 exchange launch-bound on GPUs (2,417
kernels a step). Reductions of one collective, op, group, dtype and leaf format are packed in program order
into buckets of about `pf.config.grad_exchange_bucket_bytes` of gradients by the plain bucketing pass's rule
(`bucketing.plan_buckets`), and each bucket is one compressed reduction (`Codec.reduce_bucket`) traced where its
last member was. The state stays per leaf: each leaf's residuals go in and come out as they do per leaf, and
the bucket's layout (`formats.two_phase_bucket`) makes every value the per-leaf one.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from pt3func import analysis, tree
from pt3func.compress.formats import Codec, Format, Reduction, exchange_shape, leaf_seed
from pt3func.compress.state import ExchangeState, LeafState, is_leaf_state, is_state
from pt3func.config import config
from pt3func.passes import replace_outputs
from pt3func.passes.bucketing import plan_buckets, reduction_key
from pt3func.spmd.lower import GRAD_OF

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_C10D = torch.ops._c10d_functional
# Set on every node the pass writes: its collectives still exchange a gradient (tagged GRAD_OF with the leaf, for
# analyses of gradient traffic), but they are already compressed.
COMPRESSED = "pt3func_compressed"
# On the nodes of a bucket's compressed reduction: the labels of the leaves it reduces, in bucket order.
BUCKET = "pt3func_bucket"
_KINDS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter"}
# The argument of a step a leaf label starts with: a parameter name, or args[i] for *args (tried first: the name
# alternative would match its "args" alone).
_ARG = re.compile(r"(args\[\d+\]|[A-Za-z_]\w*)(.*)$", re.S)
# spmd.lower's label for a gradient reduction of a value that is no step argument's leaf (a gradient taken of a
# value computed inside the step, `p64 = tree.map(lambda t: t.double(), params)`): every such reduction has it.
_UNLABELLED = "a parameter"


# For a state that fits no longer: residuals are per-rank values of one mesh size and layout.
_RELAYOUT_HINT = (
    " A state restored from a run of another world size or layout cannot be reused: its error-feedback residuals are "
    "each rank's own compression error, for that run's ranks and gradient shapes; re-initialise it, "
    "exchange.init(params, data_axes=...), which restarts error feedback from zero (and PowerSGD's Q from its seed)."
)


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
    # The step returns an ExchangeState, but not the one it takes: new tensors computed from it (an optimizer
    # wrapper's torch.where over its state, MultiSteps / apply_if_finite around with_state).
    rebuilt: bool = False


def _axes_of(group_name: str) -> str:
    """The mesh axes a process group spans, as as_text() names them ('dp+tp'), for error messages."""
    from pt3func.spmd.lower import _group_axis_names

    return f"axes {_group_axis_names().get(group_name, group_name)!r}"


def _reduce_other_axes_first(gm: fx.GraphModule, collective: fx.Node, data_axes: tuple[str, ...]) -> None:
    """A gradient summed over the data axes *and* others (a replicated head after a row-parallel layer is also a
    pending sum over that layer's axis): an exact all-reduce over the other axes first, then the reduction over
    the data axes alone, which the state (sized for the data axes) can compress. The sum is the same."""
    from pt3func.spmd.lower import _group_axis_names

    if analysis.collective_kind(collective) != "all_reduce" or collective.args[1] != "sum":
        return
    names = _group_axis_names()
    axes = names.get(collective.args[-1], "").split("+")
    others = [a for a in axes if a not in data_axes]
    if not others or not set(data_axes) <= set(axes):
        return
    group_of = {axis_names: group for group, axis_names in names.items()}
    data_group = group_of.get("+".join(a for a in axes if a in data_axes))
    other_group = group_of.get("+".join(others))
    if data_group is None or other_group is None:
        return  # no process group for those axes: the state-size check names the problem
    grad = collective.args[0]
    with gm.graph.inserting_before(collective):
        exact = gm.graph.call_function(_C10D.all_reduce.default, (grad, "sum", other_group))
        done = gm.graph.call_function(_WAIT, (exact,))
    for node in (exact, done):
        node.meta["val"] = grad.meta["val"]
        node.meta["custom"] = {"pt3func": f"grad_exchange: exact sum over {'+'.join(others)} first"}
    collective.args = (done, "sum", *collective.args[2:-1], data_group)


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


@dataclass
class _Member:
    """One gradient reduction to compress, with what its compressed reduction reads and writes."""

    collective: fx.Node
    wait: fx.Node
    label: str
    format: Format  # the leaf's format in this phase
    reduction: Reduction
    names: list[str]  # state fields the format keeps for this leaf, in input order
    shapes: dict[str, tuple[int, ...]]  # each state tensor as the format reads it
    stored: dict[str, tuple[int, ...]]  # each state tensor as the program stores it (its new value too)
    state_nodes: list[fx.Node]
    state_out: LeafState | None

    @property
    def nbytes(self) -> int:
        val = self.collective.args[0].meta["val"]
        return val.numel() * val.element_size()


def rewrite(
    gm: fx.GraphModule,
    fmt: Format,
    binding: StateBinding | None = None,
    *,
    name: str = "step",
    group_info: Callable[[str], tuple[int, int]] = default_group_info,
    bucket_bytes: int | None = None,
) -> fx.GraphModule:
    """Replace each gradient reduction of `gm` by `fmt`'s compressed reduction (in place); returns `gm`.

    `binding` says where the `ExchangeState` is among the inputs and outputs (None: the step has none, which
    is an error only if some leaf's format needs state). `group_info(group_name) -> (size, rank)`.

    Leaves whose format is elementwise (a codec: bf16, fp16, int8, int4) are packed into buckets of about
    `bucket_bytes` of gradients (None: `pf.config.grad_exchange_bucket_bytes`; 0: one reduction per leaf), each
    reduced by one compressed reduction (`Codec.reduce_bucket`) where its last member was reduced; see
    `_buckets`. Top-k and PowerSGD leaves are reduced one by one.
    """
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output_node.args[0])
    changed = False
    if fmt.schedule() and binding is None:
        raise GradExchangeError(
            f"{name}: grad_exchange ({fmt.describe()}) changes program at steps {list(fmt.schedule())}, counted by "
            f"the ExchangeState's step, but the step takes no ExchangeState. Build it with state = "
            f"exchange.init(params), pass it to the step and return it unchanged."
        )
    # Every gradient reduction, the ones left uncompressed too (skip_small, per_leaf None, PowerSGD's vectors): a
    # non-finite result of any of them makes the optimizer skip the step, so it must keep the state too.
    uncompressed = {wait: collective for collective, wait, _ in gradient_reductions(gm)}
    members = _members(gm, fmt, binding, name, group_info)
    bucket_bytes = config.grad_exchange_bucket_bytes if bucket_bytes is None else bucket_bytes
    step_in = None if binding is None else [n for n in gm.graph.nodes if n.op == "placeholder"][binding.step_in]
    reduced: list[tuple[fx.Node, str, str]] = []  # every gradient reduction's result, its kind and group
    state_updates: list[tuple[int, fx.Node, fx.Node]] = []  # (output position, old value, new value)
    for bucket in _buckets(gm, members, bucket_bytes or 0):
        leaf_fmt = bucket[0].format
        inputs = [m.collective.args[0] for m in bucket] + [n for m in bucket for n in m.state_nodes]
        if leaf_fmt.needs_step:
            inputs.append(step_in)
        results = _inline(gm, bucket[-1].collective, functools.partial(_reduce, bucket, leaf_fmt.needs_step),
                          inputs, _describe(bucket))
        new_states = iter(results[len(bucket):])
        for member, result in zip(bucket, results):
            member.wait.replace_all_uses_with(result)
            outs = [result if o is member.wait else o for o in outs]  # a reduced gradient returned as it is
            reduced.append((result, member.reduction.kind, member.reduction.group_name))
            del uncompressed[member.wait]
            for field_name, old_value in zip(member.names, member.state_nodes):
                new_value = next(new_states)
                pos = None if member.state_out is None else getattr(member.state_out, field_name)
                if pos is not None:
                    outs[pos] = new_value
                    state_updates.append((pos, old_value, new_value))
        for member in bucket:
            gm.graph.erase_node(member.wait)
            gm.graph.erase_node(member.collective)
        changed = True
    if binding is not None:
        if binding.step_out is None and binding.rebuilt:
            raise GradExchangeError(
                f"{name}: the step returns an ExchangeState, but not the one it takes: an optimizer wrapper "
                "(pf.optim.MultiSteps, apply_if_finite, ...) rebuilt it from new tensors (a torch.where over its "
                "state), so the program cannot tell where to write the new residuals and step counter. Put "
                "with_state outermost, e.g. pf.compress.with_state(pf.optim.MultiSteps(opt, k)"
                ".gradient_transformation(), exchange) rather than MultiSteps(with_state(opt, exchange), k) (the "
                "exchange state is updated every step either way)"
            )
        if binding.step_out is None:
            raise GradExchangeError(
                f"{name}: the step takes an ExchangeState but does not return it; return it (unchanged) with the "
                "optimizer state, so the program can hand back the new residuals and step counter"
            )
        with gm.graph.inserting_before(output_node):
            new_step = gm.graph.call_function(torch.ops.aten.add.Tensor, (step_in, 1))
            new_step.meta["val"] = step_in.meta["val"] + 1
            new_step.meta["custom"] = {"pt3func": f"grad_exchange step counter ({fmt.describe()})"}
        outs[binding.step_out] = new_step
        reduced += [(wait, _KINDS[analysis.collective_kind(c)], c.args[-1]) for wait, c in uncompressed.items()]
        if state_updates:
            _keep_state_of_non_finite_steps(gm, output_node, outs, reduced, state_updates, fmt)
        changed = True
    if changed:
        replace_outputs(gm, outs)
    return gm


def _keep_state_of_non_finite_steps(
    gm: fx.GraphModule, output_node: fx.Node, outs: list[Any], reduced: list[tuple[fx.Node, str, str]],
    state_updates: list[tuple[int, fx.Node, fx.Node]], fmt: Format,
) -> None:
    """A step whose reduced gradients are not all finite hands back the exchange state it was given (residuals,
    PowerSGD's Q; the step counter still counts it, so every rank keeps one schedule): the optimizer skips such a
    step (`pf.optim.apply_if_finite`), and a NaN residual kept from it would make every later gradient NaN.
    `reduced` is every gradient reduction's (result, kind, group), compressed or not. Every rank of the mesh
    decides alike, as the optimizer does: see `_flag_groups`."""
    groups = _flag_groups([(kind, group) for _, kind, group in reduced])
    custom = {"pt3func": f"grad_exchange: state kept when a reduced gradient is not finite ({fmt.describe()})"}
    (finite,) = _inline(gm, output_node, functools.partial(_all_finite, groups), [r for r, _, _ in reduced], custom)
    with gm.graph.inserting_before(output_node):
        for pos, old, new in state_updates:
            kept = gm.graph.call_function(torch.ops.aten.where.self, (finite, new, old))
            kept.meta["val"] = new.meta["val"]
            kept.meta["custom"] = dict(custom)
            outs[pos] = kept


def _all_finite(groups: list[str], *reduced: torch.Tensor) -> tuple[torch.Tensor]:
    flag = torch.stack([torch.isfinite(x).all() for x in reduced]).all()
    for group in groups:
        low = _C10D.wait_tensor(_C10D.all_reduce(flag.to(torch.float32), "min", group))
        flag = low > 0.5
    return (flag,)


def _flag_groups(reductions: list[tuple[str, str]]) -> list[str]:
    """The groups the "all finite" flag is combined over (one 0-d MIN all-reduce each), in the same order on
    every rank, given every gradient reduction's (kind, group).

    A rank sees only its own results: a reduce-scatter's shard, or on a mesh of several axes an all-reduce over
    the data axes of its own tensor-parallel shard (a NaN in tp rank 0's shard is not in tp rank 1's), while
    the optimizer's check covers the whole gradients. So the flag is combined over the whole mesh (one group
    spanning it where there is one, else one per axis), unless every result is an all-reduce over every axis
    already (plain data parallelism: the same everywhere, nothing to send). Groups of no known mesh (a test's
    made-up names) are combined over themselves when they reduce-scatter."""
    meshes = _live_meshes()
    seen: dict[int, tuple[Any, list[tuple[str, tuple[str, ...]]]]] = {}  # in program order: alike on every rank
    loose: set[str] = set()
    for kind, group in reductions:
        owner = next(((mesh, groups[group]) for mesh, groups in meshes if group in groups), None)
        if owner is None:
            if kind == "reduce_scatter":
                loose.add(group)
            continue
        seen.setdefault(id(owner[0]), (owner[0], []))[1].append((kind, owner[1]))
    out: list[str] = []
    for mesh, found in seen.values():
        if all(kind == "all_reduce" and set(axes) == set(mesh.axis_names) for kind, axes in found):
            continue
        out += [g for g in _whole_mesh_groups(mesh) if g not in out]
    return out + sorted(loose - set(out))


def _live_meshes() -> list[tuple[Any, dict[str, tuple[str, ...]]]]:
    """Each mesh of this process's (this rank thread's) world, with its groups' names -> the axes they span."""
    from pt3func.sharding.mesh import known_meshes

    if not dist.is_initialized():
        return []
    world = dist.group.WORLD
    out = []
    for mesh in known_meshes():
        if getattr(mesh, "_world", None) is not world:
            continue  # another world's mesh (an earlier virtual mesh), or a virtual mesh's host-side handle
        try:
            dm = mesh.device_mesh
            groups = {dm.get_group(i).group_name: (name,) for i, name in enumerate(mesh.axis_names)}
            groups.update({pg.group_name: names for names, pg in mesh._groups.items()})
            for flat_name, flat in getattr(dm, "_flatten_mapping", {}).items():
                groups[flat.get_group(0).group_name] = tuple(flat_name.split("+"))
            if getattr(mesh, "_is_world", False):  # Mesh.group of every axis is the world group then
                groups.setdefault(world.group_name, tuple(mesh.axis_names))
        except Exception:  # a mesh whose world is gone names no groups
            continue
        out.append((mesh, groups))
    return out


def _whole_mesh_groups(mesh: Any) -> list[str]:
    """Groups whose successive all-reduces span every rank of `mesh`: the one group of all its axes where
    DTensor flattened them (torch 2.13), else one per axis."""
    dm = mesh.device_mesh
    flat = getattr(dm, "_flatten_mapping", {}).get("+".join(mesh.axis_names))
    if mesh.ndim > 1 and flat is not None:
        return [flat.get_group(0).group_name]
    return [dm.get_group(i).group_name for i in range(mesh.ndim)]


def _members(
    gm: fx.GraphModule,
    fmt: Format,
    binding: StateBinding | None,
    name: str,
    group_info: Callable[[str], tuple[int, int]],
) -> list[_Member]:
    """The gradient reductions `fmt` compresses, in program order, each checked against the state."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    phase = binding.phase if binding is not None else 0
    first_group: dict[str, str] = {}  # leaf label -> the group of its first reduction
    occurrences: dict[str, int] = {}  # leaf label -> reductions of it met so far
    kept_exact: list[str] = []
    members = []
    reductions = gradient_reductions(gm)
    # Gradients of several arguments (argnums=(0, 1)): the state is keyed by argument name too, `{"a": a, "b": b}`
    # (by the path inside the one argument otherwise), so two arguments' `['w']` never share a residual.
    several = len({_split_label(label)[0] for _, _, label in reductions if label != _UNLABELLED}) > 1
    for collective, wait, label in reductions:
        computed = label == _UNLABELLED  # each such reduction is its own leaf, though all share the label
        # A leaf reduced again in the step: once per pf.grad call (micro-batches accumulated in the step), or over
        # another axis (HSDP: all-reduce over the replica axes, reduce-scatter over the shard axes).
        again = occurrences.get(label, 0) if not computed else 0
        occurrences[label] = again + 1
        first_group.setdefault(label, collective.args[-1])
        path = label if computed else _state_path(label, several, binding)
        grad = collective.args[0].meta["val"]
        shape = exchange_shape(grad.shape, grad.dtype)  # a complex gradient goes as its real view
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
        if binding is not None and binding.data_axes:
            _reduce_other_axes_first(gm, collective, binding.data_axes)
        group_name = collective.args[-1]
        world, rank = group_info(group_name)
        out_shape = exchange_shape(wait.meta["val"].shape, grad.dtype)
        # Each reduction of a leaf draws its own random stream (stochastic rounding), not the first one's again.
        seed = leaf_seed(path if not again else f"{path}#{again}")
        r = Reduction(kind, collective.args[1], group_name, world, rank, out_shape, seed)
        needed = leaf_fmt.state_shapes(shape, kind, world)
        if again and needed:
            # The state holds one residual per leaf, for its first reduction; a later reduction has none of its own,
            # so it stays exact. Feeding it the first one's residual would add the same error back twice (or into
            # another axis's sum), breaking error feedback.
            if group_name == first_group[label]:
                kept_exact.append(label)
            continue
        if computed and needed:
            raise GradExchangeError(
                f"{name}: grad_exchange ({fmt.describe()}) keeps state ({', '.join(needed)}) per leaf, but a gradient "
                f"of local shape {list(shape)} reduced here is of a value computed inside the step (e.g. a cast "
                f"params.double()), not of a step argument's leaf, so no ExchangeState entry can be keyed to it. "
                f"Differentiate the step's arguments themselves (cast inside the loss: pf.grad(lambda p: "
                f"loss(tree.map(lambda t: t.double(), p)))(params)), or use a stateless format (bf16, fp16)."
            )
        if (needed or leaf_fmt.needs_step) and binding is None:
            raise GradExchangeError(
                f"{name}: grad_exchange ({fmt.describe()}) keeps state for {label} (error-feedback residuals, a "
                f"step counter), but the step takes no ExchangeState. Build it with state = exchange.init(params) "
                f"(or pf.compress.with_state(opt, exchange)), pass it to the step and return it unchanged."
            )
        state_in, state_out = binding.leaves.get(path, (LeafState(), None)) if binding else (LeafState(), None)
        member = _Member(collective, wait, label, leaf_fmt, r, list(needed), dict(needed), {}, [], state_out)
        for field_name in member.names:
            pos = getattr(state_in, field_name)
            if pos is None:
                held = ", ".join(sorted(binding.leaves)) if binding is not None else ""
                hint = (" Gradients of several arguments are reduced here: build the state from a dict of them "
                        "keyed by the step's parameter names, init({'a': a, 'b': b})." if several else "")
                raise GradExchangeError(
                    f"{name}: the ExchangeState has no {field_name} for {label} (looked up as {path}; it holds "
                    f"{held or 'no leaves'}), which {leaf_fmt.describe()} needs (gradient of local shape "
                    f"{list(shape)} before its {kind} over {world} ranks). Build the state with the same format and "
                    f"parameters (DTensors, as the step gets them); on a mesh of several axes pass data_axes= to "
                    f"init.{hint}{_RELAYOUT_HINT}"
                )
            node = placeholders[pos]
            have = tuple(node.meta["val"].shape[1:])
            if math.prod(have) != math.prod(needed[field_name]):
                raise GradExchangeError(
                    f"{name}: the {field_name} of {label} in the ExchangeState has local shape {list(have)}, but "
                    f"the gradient entering its {kind} over {world} ranks ({_axes_of(group_name)}) needs "
                    f"{list(needed[field_name])} (gradient shape {list(shape)}). Was the state built for other "
                    f"shardings? Pass the axes that split the data as init(params, data_axes=...) (now "
                    f"{binding.data_axes}). A reduction over more axes than the data's (a replicated parameter "
                    "after a row-parallel layer is also a pending sum over that layer's axis) cannot keep state: "
                    "leave that parameter uncompressed, pf.compress.per_leaf(lambda path, shape: None if path == "
                    f"{path!r} else fmt), or use a stateless format (bf16, fp16).{_RELAYOUT_HINT}"
                )
            member.state_nodes.append(node)
            member.stored[field_name] = tuple(node.meta["val"].shape)
        members.append(member)
    if kept_exact:
        warnings.warn(
            f"{name}: grad_exchange ({fmt.describe()}) keeps error-feedback state per leaf, for its first gradient "
            f"reduction of the step, but {', '.join(dict.fromkeys(kept_exact))} "
            f"{'is' if len(set(kept_exact)) == 1 else 'are'} reduced again (a second pf.grad call: micro-batches "
            "accumulated inside the step); those later reductions are sent uncompressed (fp32). Sum the micro-batch "
            "losses under one pf.grad, accumulate across steps with pf.optim.MultiSteps, or use a stateless format "
            "(bf16, fp16, or int8 / int4 / topk with error_feedback=False), which compresses every reduction.",
            stacklevel=2,
        )
    return members


def _state_path(label: str, several: bool, binding: StateBinding | None) -> str:
    """Where the state keeps the leaf `label` (`params['fc1']['w']`): under the argument's name too
    (`['params']['fc1']['w']`, a state built from `{"a": a, "b": b}` for argnums=(0, 1)) where the state holds
    that path, or gradients of several arguments are reduced here (their `['w']`s must not share a residual);
    else the path inside the argument (`['fc1']['w']`). Decided by the state: with b frozen or detached only
    a's gradients are reduced, but the state README tells to build for argnums=(0, 1) is still keyed by name."""
    arg, path = _split_label(label)
    keyed = f"[{arg!r}]{path}"
    if several or (binding is not None and keyed in binding.leaves and path not in binding.leaves):
        return keyed
    return path


def _buckets(gm: fx.GraphModule, members: list[_Member], bucket_bytes: int) -> list[list[_Member]]:
    """The members grouped into the compressed reductions to trace, in program order of their last member.

    Codec leaves (elementwise formats) of one collective, op, group, dtype and leaf format are packed greedily,
    in program order, by the plain bucketing pass's rule (`bucketing.plan_buckets`): a leaf joins while the
    bucket holds under `bucket_bytes` of gradients and no member's reduced gradient is read before the leaf's
    own reduction, so the bucket, reduced where its last member was, has every gradient it needs and delivers
    every result before its first reader. Leaves of other formats (and all, with `bucket_bytes` 0) are alone.
    """
    by_collective = {m.collective: m for m in members}
    packable = [(m.collective, m.wait) for m in members if bucket_bytes and _packs(m.format)]
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    planned = plan_buckets(packable, bucket_bytes, order,
                           key=lambda c: (reduction_key(c), by_collective[c].format))
    buckets = [[by_collective[c] for c, _ in pairs] for pairs in planned]
    packed = {c for c, _ in packable}
    buckets += [[m] for m in members if m.collective not in packed]
    return sorted(buckets, key=lambda b: order[b[-1].collective])


def _packs(fmt: Format) -> bool:
    """Whether leaves of `fmt` go into buckets: the elementwise formats, and top-k selecting per bucket."""
    return isinstance(fmt, Codec) or bool(getattr(fmt, "bucketed", False))


def _reduce(bucket: list[_Member], with_step: bool, *flat: torch.Tensor) -> list[torch.Tensor]:
    """The compressed reduction of `bucket` (traced): inputs are the gradients, then each member's state
    tensors, then the step counter if the format reads it; outputs the results, then the new state tensors."""
    rest = iter(flat[len(bucket):])
    # Complex gradients as their real views (see `exchange_shape`); their results are viewed back below.
    xs = [torch.view_as_real(x) if x.is_complex() else x for x in flat[:len(bucket)]]
    states = [{n: next(rest).view(m.shapes[n]) for n in m.names} for m in bucket]
    step = next(rest) if with_step else None
    fmt = bucket[0].format
    if len(bucket) == 1:
        out, new = fmt.reduce(xs[0], states[0], step, bucket[0].reduction)
        outs, news = [out], [new]
    else:
        outs, news = fmt.reduce_bucket(xs, states, step, [m.reduction for m in bucket])
    outs = [torch.view_as_complex(out.contiguous()) if x.is_complex() else out for out, x in zip(outs, flat)]
    return [*outs, *(new[n].reshape(m.stored[n]) for m, new in zip(bucket, news) for n in m.names)]


def _describe(bucket: list[_Member]) -> dict[str, Any]:
    """The `meta["custom"]` of a bucket's nodes: its reason in `as_text()` names every leaf it reduces."""
    what = bucket[0].format.describe()
    if len(bucket) == 1:
        label = bucket[0].label
        return {"pt3func": f"grad of {label} ({what})", GRAD_OF: label, COMPRESSED: True}
    labels = [m.label for m in bucket]
    size = analysis.format_bytes(sum(m.nbytes for m in bucket))
    return {
        "pt3func": f"grad of {len(bucket)} leaves in one bucket, {size} of gradients ({what}): " + ", ".join(labels),
        GRAD_OF: ", ".join(labels),
        COMPRESSED: True,
        BUCKET: labels,
    }


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
    states_out = _states(tree.unflatten(out_treedef, list(range(out_treedef.num_leaves))))
    state_out = next((s for s in states_out if out_source.get(s.step) == state_in.step), None)
    binding = StateBinding(state_in.format, state_in.data_axes, gin[state_in.step],
                           None if state_out is None else gout.get(state_out.step), phase=state_in.phase,
                           rebuilt=state_out is None and any(s.format == state_in.format for s in states_out))
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
