"""Blockwise int8 / int4 quantisation kernels for compressed gradient exchange.

`quantize_blockwise` and `dequantize_blockwise` are torch custom ops (`torch.ops.pt3func.*`): one node each in a
traced program, Triton kernels on CUDA, the torch reference (`pt3func.kernels.reference`) elsewhere; a CPU program
that pf.jit compiles with Inductor gets the reference's aten ops instead, fused into C++ loops (`ops.py`). The format
(padding, scales, int4 nibble order, the hash that drives stochastic rounding) is documented in `reference.py`.
"""

from __future__ import annotations

import torch

from pt3func.kernels import reference
from pt3func.kernels.ops import dequantize_blockwise_op, quantize_blockwise_op, triton_available
from pt3func.kernels.reference import padded_numel

__all__ = ["dequantize_blockwise", "padded_numel", "quantize_blockwise", "reference", "triton_available"]


def quantize_blockwise(
    x: torch.Tensor,
    *,
    bits: int,
    block: int,
    residual: torch.Tensor | None = None,
    stochastic: bool = False,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantise `x` (any shape; fp32, bf16 or fp16) blockwise to int8 (`bits=8`) or packed int4 (`bits=4`).

    Args:
      x: the values; flattened and zero-padded to `padded_numel(x.numel(), bits, block)`.
      bits: 8 (q is int8, one value per element) or 4 (q is uint8, two offset-binary values per byte,
        low nibble first).
      block: elements per scale (even for int4).
      residual: error-feedback state, fp32 with `x.numel()` elements. When given, `x + residual` is quantised
        and `new_residual = (x + residual) - dequantize(q)` is returned (shaped like `residual`).
      stochastic: round `floor(v + u)` with `u` in [0, 1) from a counter-based hash of `(seed, index)` (unbiased)
        instead of round-half-to-even.
      seed: 0-d integer tensor (a program input, so each step can draw new bits without retracing);
        required when `stochastic`.

    Returns:
      `(q, scales, new_residual)`: `q` of `padded` (int8) or `padded // 2` (uint8) elements, fp32 `scales`
      (`absmax / qmax` per block, qmax 127 or 7), and the new residual or None.
    """
    if stochastic and seed is None:
        raise ValueError("stochastic rounding needs a seed (a 0-d integer tensor, new every step)")
    if residual is not None and residual.numel() != x.numel():
        raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    reference.check_format(bits, block)
    q, scales, new_residual = quantize_blockwise_op(x, bits, block, residual, stochastic, seed)
    return q, scales, (new_residual if residual is not None else None)


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    block: int,
    numel: int,
    shape: torch.Size | tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`q * scales` per block as `dtype`, padding dropped: flat with `numel` elements, or reshaped to `shape`."""
    out = dequantize_blockwise_op(q, scales, bits, block, numel, dtype)
    return out if shape is None else out.view(shape)
