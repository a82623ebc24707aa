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
            return compile_fx(gm, list(example_inputs))
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
