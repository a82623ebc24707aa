"""The quantisation kernels as torch custom ops, so a traced program holds one opaque node per call.

`torch.ops.pt3func.quantize_blockwise` / `dequantize_blockwise` run the Triton kernels on CUDA (when triton
imports) and the torch reference elsewhere. Their fake implementations give the output shapes from the
static arguments alone, so `make_fx(tracing_mode="fake")` and Inductor treat them like any other op.
"""

import functools

import torch

from pt3func.kernels import reference


@functools.cache
def triton_available() -> bool:
    """True when the Triton kernels can be imported (triton installed and importable)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while loading its backends
        return False
    return True


def _backend(device: torch.device):
    if device.type == "cuda" and triton_available():
        from pt3func.kernels import triton_quant

        return triton_quant
    return reference


# An op's outputs cannot be None, so "no residual" is an empty tensor here; `quantize_blockwise` in
# `pt3func.kernels` turns it back into None.
@torch.library.custom_op("pt3func::quantize_blockwise", mutates_args=())
def quantize_blockwise_op(
    x: torch.Tensor,
    bits: int,
    block: int,
    residual: torch.Tensor | None,
    stochastic: bool,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scales, new_residual = _backend(x.device).quantize_blockwise(x, bits, block, residual, stochastic, seed)
    if new_residual is None:
        new_residual = x.new_empty((0,), dtype=torch.float32)
    return q, scales, new_residual


@quantize_blockwise_op.register_fake
def _(x, bits, block, residual, stochastic, seed):
    padded = reference.padded_numel(x.numel(), bits, block)
    q = x.new_empty((padded if bits == 8 else padded // 2,), dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = x.new_empty((padded // block,), dtype=torch.float32)
    if residual is None:
        new_residual = x.new_empty((0,), dtype=torch.float32)
    else:
        new_residual = residual.new_empty(residual.shape, dtype=torch.float32)
    return q, scales, new_residual


@torch.library.custom_op("pt3func::dequantize_blockwise", mutates_args=())
def dequantize_blockwise_op(
    q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    return _backend(q.device).dequantize_blockwise(q, scales, bits, block, numel, dtype)


@dequantize_blockwise_op.register_fake
def _(q, scales, bits, block, numel, dtype):
    reference.check_format(bits, block)
    return q.new_empty((numel,), dtype=dtype)
