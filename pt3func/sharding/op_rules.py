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
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
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
    from torch.distributed.tensor import DTensor

    return set(DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs)


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


register_missing_rules()
