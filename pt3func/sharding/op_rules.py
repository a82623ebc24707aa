"""Sharding rules DTensor lacks for ops a pure step commonly reaches, registered once on import.

DTensor shards scaled-dot-product attention on CUDA (flash, efficient, cuDNN kernels) but has no rule for the
CPU kernel `F.scaled_dot_product_attention` dispatches to (`_scaled_dot_product_flash_attention_for_cpu` and its
backward): a data parallel or tensor parallel step on a gloo world failed inside DTensor with
"Operator ... does not have a sharding strategy registered". The rules here are DTensor's own for the CUDA flash
kernel, over the CPU kernel's signature: everything replicated, or batch (dim 0) sharded, or heads (dim 1)
sharded, for every tensor of the op. An attention mask follows q along the dims it has (a dim of size 1
broadcasts, so it stays replicated there).

DTensor shards the pooling forwards along batch and channels, but has no rule for some of their backwards
(`adaptive_max_pool2d_backward` of `nn.AdaptiveMaxPool2d`, ...): a data-parallel step failed in the backward. Each
(sample, channel) plane pools alone, and the indices a max pool saves count within its plane, so the rule here is
the forward's: every tensor replicated, or every tensor split along the batch (dim 0), or along the channels
(dim 1, batched inputs only).

DTensor gives an op's output the strides its meta function gives for the *global* inputs as they came, before it
redistributes them, while the local block is computed from the redistributed inputs. Attention's output follows
q's layout (`empty_like(query)`): q is usually a transposed view (b, t, h, d) -> (b, h, t, d), and a pending sum
reduce-scattered onto the batch comes back contiguous, so the DTensor claimed a transposed layout its block did not
have, and the `reshape` that merges the heads back was taken as a view of it ("Cannot view a tensor with shape
[1, 6, 4, 4] and strides (96, 4, 24, 1)": a LLaMA with a vocabulary-parallel embedding, whose partial lookup
reaches q). The attention kernels are therefore dispatched here (`_dispatch_keeping_strides`), as DTensor does,
but each output's global strides are those its local block implies (as `DTensor.from_local` derives them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

aten = torch.ops.aten


def _mask_placement(op_schema: OpSchema, dim: int, size: int) -> list:
    """The attention mask's placement when q is sharded on `dim` (of size `size`): [] without a mask."""
    mask = op_schema.kwargs_schema.get("attn_mask")
    if not isinstance(mask, OpStrategy):
        return []
    shape = mask.shape
    # A mask is (L, S) or broadcasts over (B, H, L, S); dim counts from q's (B, H, L, E).
    mask_dim = dim - (4 - len(shape))
    sharded = mask_dim >= 0 and shape[mask_dim] == size and size > 1
    return [Shard(mask_dim) if sharded else Replicate()]


def _attention_strategies(op_schema: OpSchema, n_outputs: int, q_index: int) -> list[list]:
    """[outputs..., tensor inputs..., mask?] placements: replicated, batch sharded, heads sharded."""
    tensor_args = [a for a in op_schema.args_schema if isinstance(a, OpStrategy)]
    q_shape = op_schema.args_schema[q_index].shape
    strategies = []
    all_replicated = [Replicate()] * (n_outputs + len(tensor_args)) + _mask_placement(op_schema, -1, 0)
    strategies.append(all_replicated)
    for dim in (0, 1):  # batch, heads: attention is independent across both
        strategies.append([Shard(dim)] * (n_outputs + len(tensor_args)) + _mask_placement(op_schema, dim, q_shape[dim]))
    return strategies


def _cpu_flash_forward(op_schema: OpSchema) -> OpStrategy:
    # outputs: (output, logsumexp); inputs: q, k, v (then attn_mask, a keyword)
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _attention_strategies(op_schema, 2, 0), input_index=2)


def _cpu_flash_backward(op_schema: OpSchema) -> OpStrategy:
    # outputs: (grad_q, grad_k, grad_v); inputs: grad_out, q, k, v, out, logsumexp (then attn_mask)
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _attention_strategies(op_schema, 3, 1), input_index=3)


# Pooling backwards without a DTensor rule -> their spatial rank (inputs are (N, C, *spatial) or (C, *spatial)).
_POOL_BACKWARDS = {
    aten.adaptive_max_pool2d_backward.default: 2,
    aten.adaptive_max_pool3d_backward.default: 3,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten._adaptive_avg_pool3d_backward.default: 3,
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
}


def _pool_backward(op_schema: OpSchema) -> OpStrategy:
    # output: grad_input; inputs: grad_output, self (then indices, for a max pool)
    mesh = op_schema.get_mesh_from_args(validate=False)
    n = 1 + len([a for a in op_schema.args_schema if isinstance(a, OpStrategy)])
    strategies = [[Replicate()] * n, [Shard(0)] * n]
    if op_schema.args_schema[1].ndim >= _POOL_BACKWARDS[op_schema.op] + 2:  # batched: dim 1 holds the channels
        strategies.append([Shard(1)] * n)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=1)


# Pooling forwards -> (spatial rank, outputs): DTensor >= 2.12 has rules for them, torch 2.11 not for all
# (`adaptive_max_pool2d`); registered only where missing, with the same rule as their backwards.
_POOL_FORWARDS = {
    aten.adaptive_max_pool2d.default: (2, 2),
    aten.adaptive_max_pool3d.default: (3, 2),
    aten.max_pool2d_with_indices.default: (2, 2),
    aten.max_pool3d_with_indices.default: (3, 2),
    aten._adaptive_avg_pool2d.default: (2, 1),
    aten._adaptive_avg_pool3d.default: (3, 1),
    aten.avg_pool2d.default: (2, 1),
    aten.avg_pool3d.default: (3, 1),
}


def _pool_forward(op_schema: OpSchema) -> OpStrategy:
    # outputs: the pooled value (and a max pool's indices); input: self
    mesh = op_schema.get_mesh_from_args(validate=False)
    spatial, outputs = _POOL_FORWARDS[op_schema.op]
    n = outputs + 1
    strategies = [[Replicate()] * n, [Shard(0)] * n]
    if op_schema.args_schema[0].ndim >= spatial + 2:
        strategies.append([Shard(1)] * n)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=outputs)


def _registered() -> set:
    return set(DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs)


# Attention kernels whose outputs take q's layout in their meta functions (`empty_like(query)`): the CPU kernel (its
# backward's outputs have a fixed layout, the same for any input). CUDA's flash kernel's meta does the same; it is
# left to DTensor here, untested on a GPU.
_LAYOUT_FOLLOWS_INPUT = (aten._scaled_dot_product_flash_attention_for_cpu.default,)


def _dispatch_keeping_strides(op_call: Any, args: tuple, kwargs: dict) -> object:
    """DTensor's dispatch of `op_call` (sharding rule, redistribution of the inputs, the local op), with each
    output's global strides taken from its local block rather than from the inputs before redistribution."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or not op_info.compute_mesh._is_current_rank_part_of_mesh():
        raise NotImplementedError(f"pt3func: {op_call} on a rank outside its mesh")
    if sharding.needs_redistribute:
        dispatcher.redistribute_local_args(
            op_info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
        )
    local_args = op_info.local_args
    if op_info.args_tree_spec is not None:
        from torch.utils import _pytree as pytree

        local_args = pytree.tree_unflatten(list(local_args), op_info.args_tree_spec)
    local_results = op_call(*local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local_results, _with_local_strides(local_results, sharding.output_spec))


def _with_local_strides(result: object, spec: Any) -> Any:
    """`spec` (an output's, or a tuple of them) with the global strides `result`'s local block implies."""
    from torch.distributed.tensor._utils import compute_global_tensor_info

    if isinstance(spec, (list, tuple)):
        return type(spec)(_with_local_strides(r, s) for r, s in zip(result, spec))
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None or not isinstance(result, torch.Tensor):
        return spec
    _, stride = compute_global_tensor_info(result, spec.mesh, list(spec.placements))
    meta = spec.tensor_meta
    return spec.shallow_copy_with_tensor_meta(TensorMeta(meta.shape, tuple(stride), meta.dtype))


def register_missing_rules() -> None:
    """Register each rule here whose op this torch's DTensor cannot shard yet (a later torch's own rule wins)."""
    have = _registered()
    rules = (
        (aten._scaled_dot_product_flash_attention_for_cpu.default, _cpu_flash_forward, RuntimeSchemaInfo(3)),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, _cpu_flash_backward, RuntimeSchemaInfo(6)),
    ) + tuple((op, _pool_backward, RuntimeSchemaInfo(2)) for op in _POOL_BACKWARDS) + tuple(
        (op, _pool_forward, RuntimeSchemaInfo(1)) for op in _POOL_FORWARDS
    )
    for op, rule, schema_info in rules:
        if op not in have:
            register_op_strategy(op, schema_info=schema_info)(rule)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _LAYOUT_FOLLOWS_INPUT:
        handlers.setdefault(op, _dispatch_keeping_strides)  # a handler of torch's own (none in 2.13) wins


register_missing_rules()
