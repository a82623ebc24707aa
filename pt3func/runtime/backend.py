"""Turn a traced program into something callable: Inductor, or the FX graph as is."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import fx

from pt3func.trace.capture import TRACE_LOCK

BACKENDS = ("inductor", "eager")


def compile_program(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], backend: str
) -> Callable[..., Sequence]:
    """Return `run(*flat_inputs) -> flat outputs` for `gm` with the chosen backend."""
    if backend == "eager":
        return gm
    if backend == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # fallback_random: Inductor's own RNG would draw different numbers than eager torch; the contract
        # is that a jitted step sees the same random numbers as the same code run eagerly.
        with TRACE_LOCK, inductor_config.patch(fallback_random=True):
            return compile_fx(gm, list(example_inputs), decompositions=_decompositions(example_inputs))
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def _decompositions(example_inputs: Sequence[torch.Tensor]) -> dict | None:
    """Inductor's decompositions, plus pt3func's quantisation ops lowered to aten for a program on the CPU
    (fused C++ instead of an op-by-op reference); None (Inductor's default table) for any other program."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(x.device.type != "cpu" for x in tensors):
        return None
    from torch._inductor.decomposition import select_decomp_table

    from pt3func.kernels.ops import cpu_decompositions

    return {**select_decomp_table(), **cpu_decompositions()}
