"""A small GPT (decoder-only transformer) as pure functions over a nested-dict params pytree.

There is no `nn.Module`: `init_params` builds the weights, `forward` and `loss_fn` read them, and
nothing is mutated, so the functions trace into one static graph under `pf.jit`.
Linear weights use PyTorch's (out_features, in_features) layout, as `nn.Linear` would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.tensor import DTensor, Partial, Replicate

import pt3func as pf
from pt3func import P

Params = dict[str, Any]


@dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of the model.

    `compute_dtype` (e.g. `torch.bfloat16`) runs the matmuls and attention in that dtype while the
    params, layer norms, residual stream and loss stay float32 (mixed precision without autocast).
    """

    vocab: int
    seq: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


def _layer_norm(d_model: int, device: torch.device | str | None) -> Params:
    return {"weight": torch.ones(d_model, device=device), "bias": torch.zeros(d_model, device=device)}


def init_params(config: GPTConfig, seed: int = 0, device: torch.device | str | None = None) -> Params:
    """Fresh float32 params, GPT-2 style: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L).

    The same `seed` gives the same params on every device (they are drawn on the CPU).
    """
    generator = torch.Generator().manual_seed(seed)
    d, hidden = config.d_model, config.mlp_ratio * config.d_model
    # Each block adds two projections into the residual stream; scaling them keeps its variance flat in depth.
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(device)

    params: Params = {
        "wte": normal(config.vocab, d),
        "wpe": normal(config.seq, d),
        "blocks": {
            str(i): {
                "ln1": _layer_norm(d, device),
                "attn": {"qkv": {"weight": normal(3 * d, d)}, "proj": {"weight": normal(d, d, std=residual_std)}},
                "ln2": _layer_norm(d, device),
                "mlp": {"fc": {"weight": normal(hidden, d)}, "proj": {"weight": normal(d, hidden, std=residual_std)}},
            }
            for i in range(config.n_layers)
        },
        "ln_f": _layer_norm(d, device),
    }
    if not config.tie_embeddings:
        params["lm_head"] = {"weight": normal(config.vocab, d)}
    return params


def param_specs(params: Params, tp: str | None = "tp") -> Params:
    """Megatron tensor parallelism over mesh axis `tp` (None: everything replicated), as a tree of `P`.

    qkv and the MLP's first projection split their output features (column-parallel), the attention and
    MLP output projections their input features (row-parallel): one all-reduce per block in the forward.
    Embeddings and norms are replicated.
    """
    column, row, replicated = P(tp, None), P(None, tp), P()

    def spec(path: tuple, leaf: torch.Tensor) -> P:
        if tp is None or leaf.ndim != 2 or path[0] != "blocks":
            return replicated
        name = path[3]
        if name in ("qkv", "fc"):
            return column
        if name == "proj":
            return row
        raise ValueError(f"no tensor-parallel rule for params{pf.tree.keystr(path)}")

    return pf.tree.map_with_path(spec, params)


def num_params(params: Params) -> int:
    """How many scalars the params hold."""
    return sum(leaf.numel() for leaf in pf.tree.leaves(params))


def _linear(x: torch.Tensor, weight: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    dtype = config.compute_dtype or x.dtype
    return F.linear(x.to(dtype), weight.to(dtype))


def _norm(x: torch.Tensor, p: Params) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p["weight"], p["bias"])


def _dropout(x: torch.Tensor, config: GPTConfig, train: bool) -> torch.Tensor:
    return F.dropout(x, config.dropout, training=True) if train and config.dropout > 0 else x


def _attention(x: torch.Tensor, p: Params, config: GPTConfig, train: bool) -> torch.Tensor:
    # Head-major (h, three, d) columns: a tensor-parallel split of qkv's output dim gives each rank whole heads.
    q, k, v = rearrange(
        _linear(x, p["qkv"]["weight"], config), "b t (h three d) -> three b h t d", three=3, h=config.n_heads
    )
    dropout_p = config.dropout if train else 0.0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return _sum_partials(_linear(rearrange(y, "b h t d -> b t (h d)"), p["proj"]["weight"], config))


def _mlp(x: torch.Tensor, p: Params, config: GPTConfig) -> torch.Tensor:
    h = F.gelu(_linear(x, p["fc"]["weight"], config), approximate="tanh")
    return _sum_partials(_linear(h, p["proj"]["weight"], config))


def _sum_partials(y: torch.Tensor) -> torch.Tensor:
    """All-reduce a row-parallel projection's partial sums here, once per block (Megatron's layout).

    Left to DTensor, the residual add would reduce-scatter them and the next block all-gather again.
    """
    if not isinstance(y, DTensor) or not any(isinstance(p, Partial) for p in y.placements):
        return y
    return y.redistribute(y.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in y.placements])


def forward(params: Params, idx: torch.Tensor, config: GPTConfig, train: bool = False) -> torch.Tensor:
    """Next-token logits (batch, seq, vocab), float32, for token ids `idx` (batch, seq) with seq <= config.seq.

    `train=True` applies dropout (drawn from torch's global generator) when `config.dropout > 0`.
    """
    seq = idx.shape[1]
    if seq > config.seq:
        raise ValueError(f"sequence length {seq} exceeds the model's context of {config.seq}")
    x = _dropout(params["wte"][idx] + params["wpe"][:seq], config, train)
    for block in params["blocks"].values():
        # Branch outputs may be in compute_dtype; the residual stream stays float32.
        x = x + _dropout(_attention(_norm(x, block["ln1"]), block["attn"], config, train), config, train).to(x.dtype)
        x = x + _dropout(_mlp(_norm(x, block["ln2"]), block["mlp"], config), config, train).to(x.dtype)
    head = params["wte"] if config.tie_embeddings else params["lm_head"]["weight"]
    return _linear(_norm(x, params["ln_f"]), head, config).float()


def loss_fn(
    params: Params, batch: tuple[torch.Tensor, torch.Tensor], config: GPTConfig, train: bool = False
) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of `batch = (inputs, targets)`, both int64 (batch, seq)."""
    inputs, targets = batch
    logits = forward(params, inputs, config, train)
    return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"))
