"""`pf.checkpoint` / `pf.remat`, `pf.checkpoint_name` and `pf.checkpoint_policies`, as in JAX.

Under `pf.jit` a checkpointed call only marks the nodes it records (their region and policy, in
`node.meta["custom"]`); the remat pass (`pt3func/passes/remat.py`) then rewrites the whole-step graph.
Outside `pf.jit` (eager PyTorch, `torch.compile`) the same call runs through
`torch.utils.checkpoint.checkpoint(use_reentrant=False)` with a selective policy, and gives the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor

from pt3func.passes.remat import COLLECTIVES_KEY, DOTS, POLICY_KEY, REGION_KEY, Policy, add_name
from pt3func.spmd import lower

__all__ = ["checkpoint", "checkpoint_name", "checkpoint_policies", "remat", "Policy"]


class _Policies:
    """The policies of `pf.checkpoint`: which values of a checkpointed region the backward keeps.

    Everything not kept is recomputed in the backward from what is kept (and from the region's inputs,
    which are always kept). Random ops (dropout masks) and collectives are never recomputed.
    """

    everything_saveable = Policy("everything_saveable")
    """Keep every value: no recomputation (as without `pf.checkpoint`)."""
    nothing_saveable = Policy("nothing_saveable")
    """Keep only the region's inputs; recompute the rest (the default)."""
    dots_saveable = Policy("dots_saveable")
    """Keep matrix-product outputs (mm, addmm, bmm, baddbmm); recompute the cheap ops around them."""
    checkpoint_dots = dots_saveable

    @staticmethod
    def save_only_these_names(*names: str) -> Policy:
        """Keep exactly the values tagged with `pf.checkpoint_name(x, name)` for one of `names`."""
        return Policy("save_only_these_names", names)

    @staticmethod
    def offload_to_host(*names: str) -> Policy:
        """Keep the named values in pinned host memory until the backward; recompute the rest.

        On a CPU device this is `save_only_these_names(*names)` (host memory is where they already are).
        """
        return Policy("offload_to_host", names)


checkpoint_policies = _Policies()

_REGIONS = itertools.count(1)
_EAGER = threading.local()  # the policy of the innermost eager checkpoint region, and a pending name


def _resolve(policy: Any) -> Policy:
    if policy is None:
        return checkpoint_policies.nothing_saveable
    if isinstance(policy, Policy):
        return policy
    raise TypeError(
        f"pf.checkpoint: unknown policy {policy!r}; use one of pf.checkpoint_policies.everything_saveable, "
        "nothing_saveable, dots_saveable, save_only_these_names(*names), offload_to_host(*names)"
    )


def tracing() -> bool:
    """True while `pf.jit` traces (make_fx records nodes), not under torch.compile or eager."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return lower.current() is not None and get_proxy_mode() is not None


def checkpoint(
    fun: Callable[..., Any], policy: Policy | None = None, *, recompute_collectives: bool = False
) -> Callable[..., Any]:
    """Rematerialise `fun`'s activations in the backward pass instead of keeping them (alias `pf.remat`).

    `policy` (from `pf.checkpoint_policies`; default `nothing_saveable`) says which of the values computed
    inside `fun` the backward may keep; the rest are recomputed from them and from `fun`'s inputs.
    The result is numerically the same as calling `fun` directly: random ops are never recomputed.
    `recompute_collectives=True` lets collectives inside `fun` (FSDP/TP gathers) be issued again in the
    backward rather than their results kept.

    Usable as `pf.checkpoint(block)(x, p)`, `pf.checkpoint(block, policy=...)` and as a decorator via
    `functools.partial(pf.checkpoint, policy=...)`.
    """
    resolved = _resolve(policy)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if tracing():
            return _traced_region(fun, resolved, recompute_collectives, args, kwargs)
        return _eager_region(fun, resolved, args, kwargs)

    return wrapped


remat = checkpoint


def _traced_region(fun: Callable[..., Any], policy: Policy, collectives: bool, args: tuple, kwargs: dict) -> Any:
    with traced_region(policy, collectives):
        return fun(*args, **kwargs)


@contextlib.contextmanager
def traced_region(policy: Policy, collectives: bool = False) -> Iterator[None]:
    """While `pf.jit` traces: mark the ops recorded inside as one checkpointed region (nested in the enclosing one)
    for the remat pass. What `pf.checkpoint` does around its function; `trace/torch_checkpoint.py` uses it for
    `torch.utils.checkpoint.checkpoint`."""
    outer = (fx_traceback.current_meta.get("custom") or {}).get(REGION_KEY)
    region = f"{outer}/{next(_REGIONS)}" if outer else str(next(_REGIONS))
    marks = {REGION_KEY: region, POLICY_KEY: policy.as_meta(), COLLECTIVES_KEY: collectives}
    with fx_traceback.annotate(marks):
        yield


def _eager_region(fun: Callable[..., Any], policy: Policy, args: tuple, kwargs: dict) -> Any:
    if policy.kind == "everything_saveable" or not torch.is_grad_enabled() or _composed():
        return fun(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    # The user's keyword arguments are bound here: torch's checkpoint would take `debug=`, `context_fn=`,
    # `preserve_rng_state=`, `determinism_check=` as its own.
    bound = functools.partial(fun, **kwargs) if kwargs else fun
    if policy.kind == "nothing_saveable":
        return torch_checkpoint(bound, *args, use_reentrant=False)
    selective = _with_eager_policy(bound, policy)
    return torch_checkpoint(selective, *args, use_reentrant=False, context_fn=_selective(policy))


def _composed() -> bool:
    """Under a torch.func transform (pf.vmap, per-sample gradients) or a gradient of a gradient: there
    torch.utils.checkpoint refuses to run (saved-tensor hooks) or fails (selective checkpointing's cache), so the
    region runs as it is; remat saves memory only, the numbers are the same. Inside `pf.jit` remat applies."""
    from pt3func.transforms import differentiation_depth

    return torch._C._functorch.maybe_current_level() is not None or differentiation_depth() >= 2


def _with_eager_policy(fun: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    @functools.wraps(fun)
    def inner(*args: Any, **kwargs: Any) -> Any:
        previous = getattr(_EAGER, "policy", None)
        _EAGER.policy = policy
        try:
            return fun(*args, **kwargs)
        finally:
            _EAGER.policy = previous

    return inner


def _selective(policy: Policy) -> Callable[[], Any]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # Random ops are recomputed here: torch.utils.checkpoint replays the RNG state (preserve_rng_state),
    # so the recomputed dropout mask is the one the forward drew.
    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if policy.kind == "dots_saveable":
            keep = op in DOTS
        else:  # save_only_these_names / offload_to_host (kept on the device in eager mode)
            keep = op is torch.ops.aten.alias.default and getattr(_EAGER, "name", None) in policy.names
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, decide)


@contextlib.contextmanager
def _pending_name(name: str) -> Iterator[None]:
    previous = getattr(_EAGER, "name", None)
    _EAGER.name = name
    try:
        yield
    finally:
        _EAGER.name = previous


def checkpoint_name(x: Any, name: str) -> Any:
    """Tag `x` (a tensor, or a pytree of them) with `name` for `save_only_these_names` / `offload_to_host`.

    Returns `x`. Outside a checkpointed region the tag has no effect.
    """
    if not isinstance(name, str):
        raise TypeError(f"pf.checkpoint_name: name must be a string, got {name!r}")
    from pt3func import tree

    return tree.map(lambda leaf: _name_leaf(leaf, name), x)


def _name_leaf(x: Any, name: str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if tracing():
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        local = x._local_tensor if isinstance(x, DTensor) else x
        slot = get_proxy_slot(local, get_proxy_mode().tracer, None)
        if slot is not None:
            add_name(slot.proxy.node, name)
        return x
    if getattr(_EAGER, "policy", None) is not None and torch.is_grad_enabled():
        # Eager selective checkpointing decides per op: an alias op that the policy sees with the name set.
        with _pending_name(name):
            return torch.ops.aten.alias.default(x)
    return x
