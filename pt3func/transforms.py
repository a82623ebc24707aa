"""Pytree-aware autodiff and vectorisation: `grad`, `value_and_grad`, `vmap`.

Gradients go through `torch.autograd.grad`, not `torch.func.grad`, on purpose: autograd is what
make_fx records into the whole-step program, and it is the path that sees DTensor redistributions and
functional collectives (torch.func.grad does not), so the same code works eagerly, under `pf.jit`,
and on sharded values.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode

from pt3func import tree
from pt3func._compat import is_plain_shard, outside_functorch_levels
from pt3func.errors import TracingError
from pt3func.runtime import virtual
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
    structure of the differentiated argument (a tuple of them when `argnums` is a sequence); leaves that are not
    floating-point or complex tensors get `None`. Returns `(value, grads)` or `((value, aux), grads)`.
    Nests (grad of grad) and works inside `pf.jit`.
    """
    nums = _as_argnums(argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mesh = _virtual_mesh_of(args, kwargs)
        if mesh is not None:
            return virtual.call(mesh, wrapped, args, kwargs)
        if _inside_functorch_transform():
            # Inside torch.func.vmap (pf.vmap) autograd.grad is unavailable; torch.func.grad is the
            # transform that composes there.
            args, kwargs = _as_local_blocks((args, kwargs))
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
        diff_leaves, spec = _differentiated_leaves(args, nums)
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


@torch.compiler.disable
def _inside_functorch_transform() -> bool:
    """Whether a torch.func transform (pf.vmap) is running: asked eagerly on every call, never traced by Dynamo.

    Under torch.compile Dynamo folds `maybe_current_level()` into a constant, and a frame it compiled outside any
    transform carries no guard on the transform stack: pf.grad's wrapper, compiled for a call outside pf.vmap, was
    reused inside one and took the autograd path there (`requires_grad_()` refused inside a functorch transform).
    """
    return torch._C._functorch.maybe_current_level() is not None


def _differentiated_leaves(args: tuple, nums: tuple[int, ...]) -> tuple[list[Any], Any]:
    """The leaves of the differentiated arguments and their structure.

    Classes registered with `torch.utils._pytree` are adopted first, as `pf.jit` does (else such an argument was one
    opaque leaf and got a None gradient outside `pf.jit` only). A Python float stays a number and gets None, so a
    float in the tree can be passed on as one (`F.layer_norm(eps=p["eps"])`); under `pf.jit` floats are traced as
    0-d tensors and do get a gradient (README, Known limits).
    """
    diff_leaves, spec = tree.flatten_adopting(tuple(args[i] for i in nums))
    return diff_leaves, spec


EAGER_DIFFERENTIATION = threading.local()  # .depth: > 0 while pf.grad runs a function eagerly (outside pf.jit)


@contextlib.contextmanager
def _differentiating_eagerly(on: bool) -> Iterator[None]:
    """Mark the block as pf.grad's eager run of the user's function: a `pf.jit`-ed function called in it must refuse
    (its program runs under no_grad, so the gradient through it would be zero)."""
    if not on:
        yield
        return
    EAGER_DIFFERENTIATION.depth = getattr(EAGER_DIFFERENTIATION, "depth", 0) + 1
    try:
        yield
    finally:
        EAGER_DIFFERENTIATION.depth -= 1


def _value_and_grad_call(
    fn: Callable[..., Any], nums: tuple[int, ...], has_aux: bool, argnums: Any, args: tuple, kwargs: dict,
    diff_leaves: list[Any], spec: Any, create_graph: bool,
) -> Any:
    grad_enabled = torch.is_grad_enabled()
    with torch.enable_grad():
        # A leaf that already requires grad is differentiated through a view of its own, one per occurrence: the
        # caller's tensor itself, given twice ({"a": x, "b": x}), got the sum of both gradients at each place.
        prepared = [
            (leaf.view_as(leaf) if create_graph and leaf.requires_grad else leaf.detach().requires_grad_())
            if _differentiable(leaf)
            else leaf
            for leaf in diff_leaves
        ]
        if get_proxy_mode() is None:
            for p in prepared:
                if _differentiable(p):
                    _PREPARED[id(p)] = p
        used = prepared
        if any(isinstance(p, DTensor) for p in prepared):
            lower.copy_labels(diff_leaves, prepared)
            others = tree.leaves(([a for k, a in enumerate(args) if k not in nums], kwargs))
            used = lower.gather_sharded_params(prepared, others)
        new_args = list(args)
        for i, sub in zip(nums, tree.unflatten(spec, used)):
            new_args[i] = sub
        with _differentiating_eagerly(get_proxy_mode() is None):
            out = fn(*new_args, **kwargs)
        value, aux = out if has_aux else (out, None)
        _check_scalar(fn, value)
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
                grads = _autograd_grad(value, wrt, create_graph) if wrt else ()
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


def _autograd_grad(value: torch.Tensor, wrt: list[torch.Tensor], create_graph: bool) -> tuple:
    try:
        return torch.autograd.grad(value, wrt, allow_unused=True, create_graph=create_graph)
    except RuntimeError as exc:
        if not _from_selective_checkpoint(exc):
            raise
        raise RuntimeError(
            f"pf.checkpoint with a selective policy (dots_saveable, save_only_these_names) outside pf.jit runs "
            f"torch's selective activation checkpoint, which failed in the backward: {exc}. It cannot handle an "
            "in-place op on a value the policy saves (a matmul output) or a pf.grad taken inside the region. Use "
            "checkpoint_policies.nothing_saveable outside pf.jit, or call the step under pf.jit, where every "
            "policy works."
        ) from exc


def _from_selective_checkpoint(exc: RuntimeError) -> bool:
    """torch's selective checkpoint's own errors: its cache's mutation check, or a recompute that backpropagates a
    second time (a gradient taken inside the region), raised from torch.utils.checkpoint."""
    import traceback

    text = str(exc)
    if "selective activation checkpoint" in text:
        return True
    return "backward through the graph a second time" in text and any(
        frame.filename.endswith(("utils/checkpoint.py", "utils\\checkpoint.py"))
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def _check_scalar(fn: Callable[..., Any], value: Any) -> None:
    """What is differentiated must be one number: a 0-d tensor, or one of shape [1] (as torch's backward takes)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return
    name = getattr(fn, "__name__", fn)
    if isinstance(value, virtual.VirtualArray):
        raise TypeError(
            f"{name} returned a virtual mesh's array: it read one that is not among the differentiated function's "
            "arguments (from its closure), so this thread cannot differentiate it; outside pf.jit pf.grad runs on "
            "every rank when the virtual arrays are its arguments: pass them as arguments, or call it under pf.jit"
        )
    got = type(value).__name__ if not isinstance(value, torch.Tensor) else f"shape {tuple(value.shape)}"
    raise TypeError(
        f"{name} must return a scalar tensor to be differentiated, got {got}"
        + (" (did you mean has_aux=True?)" if isinstance(value, tuple) else "")
    )


# Not traced by Dynamo: this runs inside a torch.func transform running eagerly (pf.vmap's, after its wrapper's graph
# breaks), where Dynamo cannot compile frames (it falls back to eager for every backend but "eager", which failed
# to fake the batched tensors of `fn`'s frames after a graph break in them: "AssertionError: False != True").
@torch.compiler.disable
def _functorch_value_and_grad(
    fn: Callable[..., Any], nums: tuple[int, ...], has_aux: bool, argnums: Any, args: tuple, kwargs: dict
) -> Any:
    diff_leaves, spec = _differentiated_leaves(args, nums)
    positions = [k for k, leaf in enumerate(diff_leaves) if _differentiable(leaf)]

    def flat_fn(*wrt: torch.Tensor) -> Any:
        leaves = list(diff_leaves)
        for k, value in zip(positions, wrt):
            leaves[k] = value
        new_args = list(args)
        for i, sub in zip(nums, tree.unflatten(spec, leaves)):
            new_args[i] = sub
        out = fn(*new_args, **kwargs)
        value = out[0] if has_aux else out
        _check_scalar(fn, value)
        # torch.func.grad takes 0-d values only; pf.grad (autograd) also takes one of shape [1]: the same number.
        return (value.reshape(()), (value, out[1])) if has_aux else (value.reshape(()), (value,))

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


def _check_in_axes(in_axes: Any) -> None:
    """`in_axes` is one entry per positional argument (or one int / None for all). A dict or other pytree is not
    such a sequence (JAX and torch.func refuse it too); it reached torch.func.vmap as its keys."""
    if in_axes is None or isinstance(in_axes, (int, tuple, list)):
        return
    raise TypeError(
        f"vmap in_axes must be an int, None, or a tuple (or list) with one entry per positional argument, got "
        f"{in_axes!r}; for a function of one argument, put its entry in a tuple: in_axes=({in_axes!r},)"
    )


def _leaf_axes(axes: Any, args: tuple[Any, ...]) -> list[int | None]:
    """Broadcast an `in_axes` prefix tree over `args`, one axis (or None) per leaf."""
    if axes is None or isinstance(axes, int):
        per_arg: Sequence[Any] = [axes] * len(args)
    else:
        per_arg = list(axes)
        if len(per_arg) != len(args):
            raise ValueError(f"vmap in_axes has {len(per_arg)} entries but the function got {len(args)} arguments")
    out: list[int | None] = []
    for position, (arg, ax) in enumerate(zip(args, per_arg)):
        if ax is None or isinstance(ax, int):
            out.extend([ax] * len(tree.leaves(arg)))
            continue
        try:
            axes_leaves = tree.broadcast_prefix(ax, arg, none_is_leaf=True)
        except tree.PrefixError as exc:
            raise ValueError(f"vmap in_axes[{position}] is not a pytree prefix of argument {position}: "
                             f"{exc}") from None
        arg_leaves = optree.tree_leaves(arg, none_is_leaf=True, namespace=tree.NAMESPACE)
        out.extend(a for a, leaf in zip(axes_leaves, arg_leaves) if leaf is not None)
    bad = [a for a in out if a is not None and not isinstance(a, int)]
    if bad:
        raise TypeError(f"vmap in_axes entries must be ints or None, got {bad[0]!r}")
    return out


def _tensor_axes(fn: Callable[..., Any], in_axes: Any, args: tuple[Any, ...], leaves: list[Any]) -> list[int | None]:
    """The batch axis of each leaf of `args` (None: unmapped). A Python number given an axis is refused, as JAX
    does: left unmapped silently, it was the same for every example where the caller meant one per example."""
    axes = _leaf_axes(in_axes, args)
    for path, leaf, ax in zip(tree.paths(args), leaves, axes):
        if ax is not None and isinstance(leaf, numbers.Number):
            raise ValueError(
                f"vmap({getattr(fn, '__name__', fn)}): argument args{tree.keystr(path)} is a Python "
                f"{type(leaf).__name__} ({leaf!r}) with in_axes {ax}, but only a tensor has an axis to map over; give "
                "it in_axes None (or pass it as a keyword argument) to use it for every example, or pass a tensor"
            )
    return [ax if isinstance(leaf, torch.Tensor) else None for ax, leaf in zip(axes, leaves)]


def _batch_placeholder(leaves: list[Any], axes: list[int | None], axis_size: int | None) -> torch.Tensor | None:
    """JAX's `axis_size`: with no mapped input, an empty mapped tensor of `axis_size` rows (the function never sees
    it) gives torch.func.vmap its batch size; with mapped inputs it must match theirs."""
    mapped = [(leaf, ax) for leaf, ax in zip(leaves, axes) if ax is not None]
    if axis_size is None:
        if not mapped:
            raise ValueError("vmap needs at least one tensor argument with a batch axis (in_axes are all None), "
                             "or axis_size=")
        return None
    sizes = {leaf.shape[ax] for leaf, ax in mapped if -leaf.ndim <= ax < leaf.ndim}
    if sizes - {axis_size}:
        raise ValueError(f"vmap axis_size={axis_size}, but the mapped arguments have {sorted(sizes)} examples")
    if mapped:
        return None
    device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    return torch.empty((axis_size, 0), device=device)


def vmap(
    fn: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, randomness: str = "error",
    axis_size: int | None = None,
) -> Callable[..., Any]:
    """Vectorise `fn` over a batch axis, like `jax.vmap`, over pt3func pytrees.

    `in_axes` is an int, None, or a per-argument sequence of pytree prefixes of ints/None (a Python number given
    an axis is refused); `out_axes` an int, None or a pytree prefix of the output (None: an output the same for
    every example, returned once; an output that varies over the examples there raises). Keyword arguments are
    passed to every example unmapped, as `torch.func.vmap` does. `axis_size` gives the number of examples where
    no argument is mapped (each output is then that many copies, or draws with `randomness="different"`). Built
    on `torch.func.vmap`; `randomness` is passed to it. Virtual arrays outside `pf.jit`: run on every rank.
    """
    _check_in_axes(in_axes)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mesh = _virtual_mesh_of(args, kwargs)
        if mesh is not None:
            return virtual.call(mesh, wrapped, args, kwargs)
        args, kwargs = _as_local_blocks((args, kwargs))
        leaves, spec = tree.flatten(args)
        axes = _tensor_axes(fn, in_axes, args, leaves)
        placeholder = _batch_placeholder(leaves, axes, axis_size)
        if placeholder is not None:
            leaves, axes = [*leaves, placeholder], [*axes, 0]
        out_spec: list[Any] = []

        def flat_fn(*flat: Any) -> tuple[Any, ...]:
            # The structure is taken again here rather than closed over: under torch.compile a graph break between
            # here and the flatten above turns `spec` into Dynamo's stand-in for optree's treespec, which fails
            # to rebuild a dict ("unhashable type: 'list'") when this function then runs eagerly.
            here = tree.structure(args)
            out = fn(*tree.unflatten(here, list(flat[:here.num_leaves])), **kwargs)
            out_leaves, s = tree.flatten(out)
            while tree.adopt_torch_nodes(out_leaves):  # a Hugging Face ModelOutput: its tensors are outputs
                out_leaves, s = tree.flatten(out)
            out_spec.append(s)
            _check_unmapped_outputs(fn, out, out_axes)
            return tuple(out_leaves)

        vectorised = torch.func.vmap(flat_fn, in_dims=tuple(axes), out_dims=0, randomness=randomness)
        flat_out = _run_vectorised(vectorised, leaves, axes, randomness)
        structure = out_spec[-1]
        out_tree = tree.unflatten(structure, list(flat_out))
        if out_axes == 0:
            return out_tree
        if isinstance(out_axes, int) or out_axes is None:
            return tree.map(lambda x: x[0] if out_axes is None else torch.movedim(x, 0, out_axes), out_tree)
        # None outputs are leaves here, so that an axis given for one (out_axes=(1, 0) over `(y, None)`) covers it
        axes = _out_leaf_axes(out_axes, out_tree)
        out_leaves, out_structure = optree.tree_flatten(out_tree, none_is_leaf=True, namespace=tree.NAMESPACE)
        moved = [x if x is None else x[0] if ax is None else torch.movedim(x, 0, ax) for x, ax in zip(out_leaves, axes)]
        return optree.tree_unflatten(out_structure, moved)

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
    axes: list[Any] = [None] * len(out_leaves) if out_axes is None else _out_leaf_axes(out_axes, out)
    for path, ax, leaf in zip(out_paths, axes, out_leaves):
        if ax is None and isinstance(leaf, torch.Tensor) and torch._C._functorch.maybe_get_level(leaf) == level:
            raise ValueError(
                f"vmap({getattr(fn, '__name__', fn)}): out_axes is None for output{tree.keystr(path)} "
                f"(returned once, for every example), but it differs from example to example; give it an axis"
            )


def _out_leaf_axes(out_axes: Any, out: Any) -> list[Any]:
    """The `out_axes` prefix broadcast over the output's leaves (None outputs included)."""
    try:
        return tree.broadcast_prefix(out_axes, out, none_is_leaf=True)
    except tree.PrefixError as exc:
        raise ValueError(f"vmap out_axes is not a pytree prefix of the output: {exc}") from None


def _run_vectorised(
    vectorised: Callable[..., Any], leaves: list[Any], axes: list[int | None], randomness: str
) -> tuple:
    """`vectorised(*leaves)` on each rank's own examples where that is exact, else over the whole values."""
    on_shards = _vmap_on_shards(leaves, axes, randomness)
    if on_shards is not None:
        flat_out = on_shards(vectorised)
        return vectorised(*leaves) if flat_out is None else flat_out
    if any(isinstance(leaf, DTensor) for leaf in leaves) or _LOCAL_RUN.get() is not None or not _meshes_exist():
        # DTensor's own path; or nested in a per-rank run, whose mode stays active; or no DTensor can exist (the
        # mode below would look at every op's arguments for nothing)
        return vectorised(*leaves)
    # No DTensor argument: every rank maps over every example, so a DTensor read from the closure is needed whole.
    with _ClosureValuesAsLocalBlocks(mesh=None, batch_dims=frozenset()):
        return vectorised(*leaves)


def _meshes_exist() -> bool:
    """Whether a DTensor can exist at all: it needs a process group (a real world, or a virtual mesh's)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() or virtual.VirtualWorld._installed


_LOCAL_RUN: ContextVar[_ClosureValuesAsLocalBlocks | None] = ContextVar("pt3func_vmap_local_run", default=None)


class _ClosureValuesAsLocalBlocks(TorchFunctionMode):
    """While a vmapped function runs on each rank's own examples, a DTensor it reads without being given it (a
    parameter in its closure) becomes this rank's whole copy of it.

    Left a DTensor, it met the local examples under torch.func.vmap, where DTensor's rules see the unbatched
    shapes of batched values and failed (`(x @ w.T).sum()`: "Dimension out of range"). Its gradient is that of an
    unmapped argument: a partial sum over the mesh dims the examples are split along. A split one is gathered
    first (exact; the function reads it whole).
    """

    def __init__(self, mesh: Any, batch_dims: frozenset[int]) -> None:
        super().__init__()
        self.mesh = mesh  # the examples' mesh; None where the examples are not split
        self.batch_dims = batch_dims
        self._copies: dict[int, tuple[DTensor, torch.Tensor]] = {}
        self._token: Any = None

    def __enter__(self) -> _ClosureValuesAsLocalBlocks:
        self._token = _LOCAL_RUN.set(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _LOCAL_RUN.reset(self._token)
        super().__exit__(*exc)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(DTensor, self.local_copy, (args, kwargs or {}))
        return func(*args, **kwargs)

    def local_copy(self, value: DTensor) -> torch.Tensor:
        known = self._copies.get(id(value))
        if known is None or known[0] is not value:
            # Outside torch.func's levels: the value is not batched, and DTensor's to_local has no vmap rule.
            with outside_functorch_levels():
                known = (value, self._whole_local_copy(value))
            self._copies[id(value)] = known
        return known[1]

    def _whole_local_copy(self, value: DTensor) -> torch.Tensor:
        mesh = value.device_mesh
        if self.batch_dims and mesh != self.mesh:
            raise TracingError(
                f"vmap: the function reads a DTensor on mesh {mesh} that it was not given, while its examples are "
                f"split over mesh {self.mesh}; pass that value as an unmapped argument (in_axes None)"
            )
        if not all(p.is_replicate() for p in value.placements):
            value = value.redistribute(mesh, [Replicate()] * mesh.ndim)
        return value.to_local(grad_placements=_partial_over(self.batch_dims, mesh.ndim))


def _as_local_blocks(values: Any) -> Any:
    """Inside a vmapped function running on each rank's examples, the DTensors among a nested pf.vmap's or
    pf.grad's arguments (read from the closure) as this rank's whole copies; unchanged elsewhere."""
    run = _LOCAL_RUN.get()
    if run is None:
        return values
    return tree.map(lambda v: run.local_copy(v) if isinstance(v, DTensor) else v, values)


def _partial_over(batch_dims: frozenset[int], ndim: int) -> list[Placement]:
    """The gradient of a value every rank holds whole, read by each rank's own examples: a sum over their dims."""
    return [Partial() if d in batch_dims else Replicate() for d in range(ndim)]


def _batch_mesh_dims(dtensors: list[tuple[DTensor, int | None]]) -> frozenset[int] | None:
    """The mesh dims along which the mapped DTensors split their examples; None where an unmapped one is not
    replicated (split parameters, tensor parallel: DTensor's own path keeps them split)."""
    dims: set[int] = set()
    for leaf, ax in dtensors:
        if ax is None:
            if not all(p.is_replicate() for p in leaf.placements):
                return None
            continue
        dims.update(d for d, p in enumerate(leaf.placements) if is_plain_shard(p) and p.dim == ax % leaf.ndim)
    return frozenset(dims)


def _examples_split_evenly(leaves: list[Any], axes: list[int | None], mesh: Any, batch_dims: frozenset[int]) -> bool:
    """Whether every rank gets as many examples: the outputs' global shape is read from one rank's block."""
    ranks = math.prod(mesh.size(d) for d in batch_dims)
    return all(leaf.shape[ax] % ranks == 0 for leaf, ax in zip(leaves, axes) if ax is not None)


def _local_examples(leaf: Any, ax: int | None, mesh: Any, batch_dims: frozenset[int]) -> Any:
    """This rank's part of an argument: its own examples of a mapped one, all of an unmapped one."""
    if not isinstance(leaf, DTensor):
        if ax is None or not batch_dims:
            return leaf  # every rank holds all of it, and maps over every example where none is split
        leaf = DTensor.from_local(leaf, mesh, [Replicate()] * mesh.ndim, run_check=False)
    elif ax is None:
        return leaf.to_local(grad_placements=_partial_over(batch_dims, mesh.ndim))
    # Split like the examples, whole otherwise: labels held whole beside split inputs keep this rank's examples (a
    # local slice), a value split along its features is gathered (DTensor's rules, under torch.func.vmap, saw the
    # unbatched shapes of batched values and failed). The gradient goes back to the value's own layout.
    target = [Shard(ax % leaf.ndim) if d in batch_dims else Replicate() for d in range(mesh.ndim)]
    if tuple(leaf.placements) != tuple(target):
        leaf = leaf.redistribute(mesh, target)
    return leaf.to_local()


def _vmap_on_shards(
    leaves: list[Any], axes: list[int | None], randomness: str = "error"
) -> Callable[[Callable[..., Any]], tuple | None] | None:
    """vmap over sharded arguments, run on each rank's own examples; None where that is not exact.

    torch.func.vmap does not batch DTensor's ops reliably (a gradient inside the vmapped function fails in
    DTensor's rules). When every mapped value is split only along its mapped axis (the examples), alike, and
    every unmapped one is replicated, each rank holds whole examples and everything each example reads, so
    mapping the function over the local examples is exactly the global vmap: the result is split over the same
    mesh axes, and an unmapped input's gradient is a partial sum over them (each rank's examples contribute
    theirs). Mapped values are brought to that layout first (`_local_examples`); DTensors the function reads
    from its closure become whole local copies (`_ClosureValuesAsLocalBlocks`). An unmapped DTensor that is
    not replicated keeps DTensor's own path (None). With `randomness="different"` every rank maps over all the
    examples instead (`_on_whole_batch`).
    """
    dtensors = [(leaf, ax) for leaf, ax in zip(leaves, axes) if isinstance(leaf, DTensor)]
    if not dtensors or len({id(leaf.device_mesh) for leaf, _ in dtensors}) != 1:
        return None
    mesh = dtensors[0][0].device_mesh
    batch_dims = _batch_mesh_dims(dtensors)
    if batch_dims is None or not _examples_split_evenly(leaves, axes, mesh, batch_dims):
        return None
    if randomness == "different" and batch_dims:
        return _on_whole_batch(leaves, mesh, batch_dims)
    local = [_local_examples(leaf, ax, mesh, batch_dims) for leaf, ax in zip(leaves, axes)]
    out_placements = [Shard(0) if d in batch_dims else Replicate() for d in range(mesh.ndim)]

    def run(vectorised: Callable[..., Any]) -> tuple | None:
        with _ClosureValuesAsLocalBlocks(mesh, batch_dims):
            outs = vectorised(*local)
        if any(isinstance(t, DTensor) for t in outs):
            return None  # the function made DTensors of its own: not per-rank local; retry whole
        return tuple(
            DTensor.from_local(t, mesh, out_placements, run_check=False) if isinstance(t, torch.Tensor) else t
            for t in outs
        )

    return run


def _on_whole_batch(
    leaves: list[Any], mesh: Any, batch_dims: frozenset[int]
) -> Callable[[Callable[..., Any]], tuple | None]:
    """vmap with `randomness="different"` over examples split over the mesh: every rank maps over all of them,
    drawing what one device draws (its generator advancing as one device's does), and keeps its own examples'
    results. Mapped over its own examples only, every rank drew the first examples' numbers (ranks are seeded
    alike). Costs each rank the whole batch's work; each rank's gradients are its own examples' (partial sums)."""
    grads = _partial_over(batch_dims, mesh.ndim)
    whole = []
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            if not all(p.is_replicate() for p in leaf.placements):
                leaf = leaf.redistribute(mesh, [Replicate()] * mesh.ndim)
            leaf = leaf.to_local(grad_placements=grads)
        whole.append(leaf)
    coordinate, index, ranks = mesh.get_coordinate(), 0, 1
    for d in sorted(batch_dims):  # Shard(0) over several mesh dims: the first one splits outermost
        index, ranks = index * mesh.size(d) + coordinate[d], ranks * mesh.size(d)
    out_placements = [Shard(0) if d in batch_dims else Replicate() for d in range(mesh.ndim)]

    def own(t: torch.Tensor) -> DTensor:
        n = t.shape[0] // ranks
        return DTensor.from_local(t[index * n:(index + 1) * n], mesh, out_placements, run_check=False)

    def run(vectorised: Callable[..., Any]) -> tuple | None:
        with _ClosureValuesAsLocalBlocks(mesh, batch_dims):
            outs = vectorised(*whole)
        if any(isinstance(t, DTensor) for t in outs):
            return None  # the function made DTensors of its own: retry whole
        return tuple(own(t) if isinstance(t, torch.Tensor) else t for t in outs)

    return run


def _virtual_mesh_of(args: tuple, kwargs: dict) -> virtual.VirtualMesh | None:
    """Outside its rank threads, the virtual mesh of the first virtual array among the arguments: the transform
    then runs in every rank thread on that rank's values, as each process of a real world runs it on its own."""
    if not virtual.VirtualWorld._installed or virtual.in_rank_thread():
        return None
    return virtual.mesh_of_arrays(args, kwargs)
