"""Pytree-aware autodiff and vectorisation: `grad`, `value_and_grad`, `vmap`.

Gradients go through `torch.autograd.grad`, not `torch.func.grad`, on purpose: autograd is what
make_fx records into the whole-step program, and it is the path that sees DTensor redistributions and
functional collectives (torch.func.grad does not), so the same code works eagerly, under `pf.jit`,
and on sharded values.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from pt3func import tree
from pt3func._compat import is_plain_shard
from pt3func.spmd import lower
from pt3func.spmd.partial_sums import gradients_of


def _as_argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


_NESTING = threading.local()  # per thread: a virtual mesh's ranks are threads, each differentiating its own step


def differentiation_depth() -> int:
    """How many `value_and_grad` calls are running their function or backward on this thread right now."""
    return getattr(_NESTING, "depth", 0)


# The leaves `value_and_grad` made to differentiate (by id), alive while anything holds them: a nested call's are
# in its caller's graph, and they are not a closure's parameter.
_PREPARED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _reaches_other_leaves(value: torch.Tensor) -> bool:
    """Whether `value`'s autograd graph reads a leaf that requires grad and was not made by `value_and_grad`: a
    closure's parameter, which an outer autograd call (torch's own backward) will want a gradient for."""
    seen: set[Any] = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None and _PREPARED.get(id(variable)) is not variable:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """Return a function computing `fn`'s value and its gradient with respect to `args[argnums]`.

    `fn` must return a scalar tensor (or `(scalar, aux)` with `has_aux=True`). The gradient has the
    structure of the differentiated argument (a tuple of them when `argnums` is a sequence); leaves that
    are not floating-point tensors get `None`. Returns `(value, grads)` or `((value, aux), grads)`.
    Nests (grad of grad) and works inside `pf.jit`.
    """
    nums = _as_argnums(argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if torch._C._functorch.maybe_current_level() is not None:
            # Inside torch.func.vmap (pf.vmap) autograd.grad is unavailable; torch.func.grad is the
            # transform that composes there.
            return _functorch_value_and_grad(fn, nums, has_aux, argnums, args, kwargs)
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{getattr(fn, '__name__', fn)}: pf.grad / pf.value_and_grad inside torch.inference_mode(): "
                "nothing is recorded for a backward there (the gradient would be all zeros); leave inference mode "
                "(torch.no_grad() is fine: the gradient is computed with grad enabled)"
            )
        for i in nums:
            if i >= len(args):
                raise TypeError(
                    f"{getattr(fn, '__name__', fn)}: argnums={argnums} asks for positional argument {i}, "
                    f"but only {len(args)} were given"
                )
        diff_leaves, spec = tree.flatten(tuple(args[i] for i in nums))
        # Nested differentiation keeps the gradient's graph: an outer grad tracks these leaves, or (the inner grad
        # of a gradient penalty, taken over the data) the tensors `fn` closes over.
        depth = differentiation_depth()
        create_graph = torch.is_grad_enabled() and (
            depth > 0 or any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in diff_leaves)
        )
        _NESTING.depth = depth + 1
        try:
            return _value_and_grad_call(fn, nums, has_aux, argnums, args, kwargs, diff_leaves, spec, create_graph)
        finally:
            _NESTING.depth = depth

    return wrapped


def _value_and_grad_call(
    fn: Callable[..., Any], nums: tuple[int, ...], has_aux: bool, argnums: Any, args: tuple, kwargs: dict,
    diff_leaves: list[Any], spec: Any, create_graph: bool,
) -> Any:
    grad_enabled = torch.is_grad_enabled()
    with torch.enable_grad():
        prepared = [
            (leaf if create_graph and leaf.requires_grad else leaf.detach().requires_grad_())
            if _differentiable(leaf)
            else leaf
            for leaf in diff_leaves
        ]
        if get_proxy_mode() is None:
            for p, leaf in zip(prepared, diff_leaves):
                if _differentiable(p) and p is not leaf:  # made here (a caller's tensor stays the caller's)
                    _PREPARED[id(p)] = p
        used = prepared
        if any(isinstance(p, DTensor) for p in prepared):
            lower.copy_labels(diff_leaves, prepared)
            others = tree.leaves(([a for k, a in enumerate(args) if k not in nums], kwargs))
            used = lower.gather_sharded_params(prepared, others)
        new_args = list(args)
        for i, sub in zip(nums, tree.unflatten(spec, used)):
            new_args[i] = sub
        out = fn(*new_args, **kwargs)
        value, aux = out if has_aux else (out, None)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = type(value).__name__ if not isinstance(value, torch.Tensor) else f"shape {tuple(value.shape)}"
            raise TypeError(
                f"{getattr(fn, '__name__', fn)} must return a scalar tensor to be differentiated, got {got}"
                + (" (did you mean has_aux=True?)" if isinstance(value, tuple) else "")
            )
        wrt = [p for p in prepared if _differentiable(p)]
        if (grad_enabled and not create_graph and value.requires_grad and get_proxy_mode() is None
                and _reaches_other_leaves(value)):
            create_graph = True  # torch's own backward of a loss built on this gradient (outside pf.jit)
        for p in wrt:
            if isinstance(p, DTensor):
                # Reduce each gradient the moment the backward produces it (as DDP's buckets do), so
                # its collective is issued while the rest of the backward still runs.
                p.register_hook(functools.partial(lower.reduce_gradient, like=p))
        shapes = {tuple(p.shape) for p in wrt if isinstance(p, DTensor)}
        with lower.reason(f"backward of value_and_grad({getattr(fn, '__name__', 'fn')})"), gradients_of(shapes):
            if value.requires_grad:
                grads = torch.autograd.grad(value, wrt, allow_unused=True, create_graph=create_graph) if wrt else ()
            else:  # `fn` does not read what is differentiated: zero gradients (below), as torch.func and JAX give
                grads = (None,) * len(wrt)
    grads_iter = iter(grads)
    grad_leaves = []
    for p in prepared:
        if _differentiable(p):
            g = next(grads_iter)
            grad_leaves.append(torch.zeros_like(p) if g is None else lower.reduce_gradient(g, p))
        else:
            grad_leaves.append(None)
    grad_tree = tree.unflatten(spec, grad_leaves)
    grad_out = grad_tree[0] if isinstance(argnums, int) else grad_tree
    if not create_graph:
        value = value.detach()
    return ((value, aux) if has_aux else value), grad_out


def _functorch_value_and_grad(
    fn: Callable[..., Any], nums: tuple[int, ...], has_aux: bool, argnums: Any, args: tuple, kwargs: dict
) -> Any:
    diff_leaves, spec = tree.flatten(tuple(args[i] for i in nums))
    positions = [k for k, leaf in enumerate(diff_leaves) if _differentiable(leaf)]

    def flat_fn(*wrt: torch.Tensor) -> Any:
        leaves = list(diff_leaves)
        for k, value in zip(positions, wrt):
            leaves[k] = value
        new_args = list(args)
        for i, sub in zip(nums, tree.unflatten(spec, leaves)):
            new_args[i] = sub
        out = fn(*new_args, **kwargs)
        return (out[0], (out[0], out[1])) if has_aux else (out, (out,))

    grads, (value, *aux) = torch.func.grad(flat_fn, argnums=tuple(range(len(positions))), has_aux=True)(
        *[diff_leaves[k] for k in positions]
    )
    grad_leaves: list[Any] = [None] * len(diff_leaves)
    for k, g in zip(positions, grads):
        grad_leaves[k] = g
    grad_tree = tree.unflatten(spec, grad_leaves)
    grad_out = grad_tree[0] if isinstance(argnums, int) else grad_tree
    return ((value, aux[0]) if has_aux else value), grad_out


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Return a function computing the gradient of scalar-valued `fn` (see `value_and_grad`)."""
    vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped


def _leaf_axes(axes: Any, args: tuple[Any, ...]) -> list[int | None]:
    """Broadcast an `in_axes` prefix tree over `args`, one axis (or None) per leaf."""
    if axes is None or isinstance(axes, int):
        per_arg: Sequence[Any] = [axes] * len(args)
    else:
        per_arg = list(axes)
        if len(per_arg) != len(args):
            raise ValueError(f"vmap in_axes has {len(per_arg)} entries but the function got {len(args)} arguments")
    out: list[int | None] = []
    for arg, ax in zip(args, per_arg):
        if ax is None or isinstance(ax, int):
            out.extend([ax] * len(tree.leaves(arg)))
        else:
            full = optree.tree_broadcast_prefix(ax, arg, none_is_leaf=True, namespace=tree.NAMESPACE)
            arg_leaves = optree.tree_leaves(arg, none_is_leaf=True, namespace=tree.NAMESPACE)
            axes_leaves = optree.tree_leaves(full, none_is_leaf=True, namespace=tree.NAMESPACE)
            out.extend(a for a, leaf in zip(axes_leaves, arg_leaves) if leaf is not None)
    return out


def vmap(fn: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, randomness: str = "error") -> Callable[..., Any]:
    """Vectorise `fn` over a batch axis, like `jax.vmap`, over pt3func pytrees.

    `in_axes` is an int, None, or a per-argument sequence of pytree prefixes of ints/None; `out_axes`
    an int, None or a pytree prefix of the output (None: an output the same for every example, returned once;
    an output that varies over the examples there raises). Keyword arguments are passed to every example
    unmapped, as `torch.func.vmap` does. Built on `torch.func.vmap`; `randomness` is passed to it.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree.flatten(args)
        axes = [ax if isinstance(leaf, torch.Tensor) else None for ax, leaf in zip(_leaf_axes(in_axes, args), leaves)]
        if all(ax is None for ax in axes):
            raise ValueError("vmap needs at least one tensor argument with a batch axis (in_axes are all None)")
        out_spec: list[Any] = []

        def flat_fn(*flat: Any) -> tuple[Any, ...]:
            out = fn(*tree.unflatten(spec, list(flat)), **kwargs)
            out_leaves, s = tree.flatten(out)
            while tree.adopt_torch_nodes(out_leaves):  # a Hugging Face ModelOutput: its tensors are outputs
                out_leaves, s = tree.flatten(out)
            out_spec.append(s)
            _check_unmapped_outputs(fn, out, out_axes)
            return tuple(out_leaves)

        vectorised = torch.func.vmap(flat_fn, in_dims=tuple(axes), out_dims=0, randomness=randomness)
        shards = _vmap_on_shards(leaves, axes)
        flat_out = None if shards is None else shards(vectorised)
        if flat_out is None:
            flat_out = vectorised(*leaves)
        structure = out_spec[-1]
        out_tree = tree.unflatten(structure, list(flat_out))
        if out_axes == 0:
            return out_tree
        if isinstance(out_axes, int) or out_axes is None:
            return tree.map(lambda x: x[0] if out_axes is None else torch.movedim(x, 0, out_axes), out_tree)
        full = optree.tree_broadcast_prefix(out_axes, out_tree, none_is_leaf=True, namespace=tree.NAMESPACE)
        return tree.map(lambda x, ax: x[0] if ax is None else torch.movedim(x, 0, ax), out_tree, full)

    return wrapped


def _check_unmapped_outputs(fn: Callable[..., Any], out: Any, out_axes: Any) -> None:
    """Inside the vmapped function: an output whose `out_axes` entry is None must not vary over the examples
    (it is returned once; JAX and torch.func refuse one that does, rather than return the first example's)."""
    if isinstance(out_axes, int):
        return
    level = torch._C._functorch.maybe_current_level()
    ns = tree.NAMESPACE
    out_paths = optree.tree_paths(out, none_is_leaf=True, namespace=ns)
    out_leaves = optree.tree_leaves(out, none_is_leaf=True, namespace=ns)
    if out_axes is None:
        axes: list[Any] = [None] * len(out_leaves)
    else:
        full = optree.tree_broadcast_prefix(out_axes, out, none_is_leaf=True, namespace=ns)
        axes = optree.tree_leaves(full, none_is_leaf=True, namespace=ns)
    for path, ax, leaf in zip(out_paths, axes, out_leaves):
        if ax is None and isinstance(leaf, torch.Tensor) and torch._C._functorch.maybe_get_level(leaf) == level:
            raise ValueError(
                f"vmap({getattr(fn, '__name__', fn)}): out_axes is None for output{tree.keystr(path)} "
                f"(returned once, for every example), but it differs from example to example; give it an axis"
            )


def _vmap_on_shards(
    leaves: list[Any], axes: list[int | None]
) -> Callable[[Callable[..., Any]], tuple | None] | None:
    """vmap over sharded arguments, run on each rank's own examples; None where that is not exact.

    torch.func.vmap does not batch DTensor's ops reliably (a gradient inside the vmapped function fails in
    DTensor's rules). When every mapped DTensor is split only along its mapped axis (the examples) and every
    unmapped one is replicated, each rank holds whole examples and everything each example reads, so mapping
    the function over the local examples is exactly the global vmap: the result is split over the same mesh
    axes, and an unmapped input's gradient is a partial sum over them (each rank's examples contribute theirs).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    dtensors = [(leaf, ax) for leaf, ax in zip(leaves, axes) if isinstance(leaf, DTensor)]
    if not dtensors or len({id(leaf.device_mesh) for leaf, _ in dtensors}) != 1:
        return None
    mesh = dtensors[0][0].device_mesh
    batch_dims: set[int] = set()
    for leaf, ax in dtensors:
        for d, p in enumerate(leaf.placements):
            if ax is not None and is_plain_shard(p) and p.dim == ax % leaf.ndim:
                batch_dims.add(d)
            elif not p.is_replicate():
                return None  # split along something other than the examples, or a pending sum
    for leaf, ax in zip(leaves, axes):
        if ax is None:
            continue
        if not isinstance(leaf, DTensor):
            if batch_dims:
                return None  # a plain mapped tensor holds every example, the DTensors only this rank's
            continue
        if any(not isinstance(leaf.placements[d], Shard) for d in batch_dims):
            return None  # mapped arguments must split their examples alike
    partial_grad = [Partial() if d in batch_dims else Replicate() for d in range(mesh.ndim)]
    local = [
        leaf if not isinstance(leaf, DTensor)
        else leaf.to_local() if ax is not None
        else leaf.to_local(grad_placements=partial_grad)
        for leaf, ax in zip(leaves, axes)
    ]
    out_placements = [Shard(0) if d in batch_dims else Replicate() for d in range(mesh.ndim)]

    def run(vectorised: Callable[..., Any]) -> tuple | None:
        outs = vectorised(*local)
        if any(isinstance(t, DTensor) for t in outs):
            return None  # the function read a DTensor it was not given (a closure): not per-rank local; retry whole
        return tuple(
            DTensor.from_local(t, mesh, out_placements, run_check=False) if isinstance(t, torch.Tensor) else t
            for t in outs
        )

    return run
