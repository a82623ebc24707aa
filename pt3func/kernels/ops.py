"""The quantisation kernels as torch custom ops, so a traced program holds one opaque node per call.

`torch.ops.pt3func.quantize_blockwise` / `dequantize_blockwise` run the Triton kernels on CUDA (when triton
imports) and the torch reference elsewhere. Their fake implementations give the output shapes from the
static arguments alone, so `make_fx(tracing_mode="fake")` and Inductor treat them like any other op.

On CPU, Inductor does not call the ops: pt3func's backend compiles a CPU program with `cpu_decompositions()`,
which lower them to the reference's aten ops, so the C++ backend fuses each quantisation (error feedback and the
payload layout around it included) into a loop or two over memory. Run op by op, the reference makes about
fifteen passes over the buffer (43 ms against 2.9 ms for int8 + EF of 4 Mi elements on one core), which cost
more than the bytes int8 saves on a 1 Gbit/s link. The traced program still holds one node per call (the
decomposition happens when Inductor compiles it), and the result is the reference's bit for bit: Inductor's C++
is built without fast-math and without FMA contraction (tests/test_kernels.py checks it). The table also
installs `pt3func._compat.guard_inductor_cpu_loop_split`, a fix for an Inductor miscompile these lowered ops would
otherwise hit whenever a length is not a multiple of the block.
"""

import functools
from collections.abc import Callable
from typing import Any

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


def cpu_decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor decompositions of the ops into the torch reference, for programs compiled for the CPU.

    Passed to `compile_fx` by pt3func's backend only when a program's inputs are on the CPU (see the module
    docstring). Never registered in Inductor's global table: for CUDA programs Inductor makes the ops fallback
    kernels (the Triton launchers), and it refuses an op that has both a fallback and a global decomposition
    ("both a fallback and a decomp for same op"), which is what broke the int8 exchange on the H200.
    """
    from pt3func._compat import guard_inductor_cpu_loop_split

    guard_inductor_cpu_loop_split()  # the lowered ops index by `i // block`, which Inductor's loop split mishandles

    def quantize(x, bits, block, residual, stochastic, seed):
        q, scales, new_residual = reference.quantize_blockwise(x, bits, block, residual, stochastic, seed)
        return q, scales, x.new_empty((0,), dtype=torch.float32) if new_residual is None else new_residual

    def dequantize(q, scales, bits, block, numel, dtype):
        return reference.dequantize_blockwise(q, scales, bits, block, numel, dtype)

    return {
        torch.ops.pt3func.quantize_blockwise.default: quantize,
        torch.ops.pt3func.dequantize_blockwise.default: dequantize,
    }
