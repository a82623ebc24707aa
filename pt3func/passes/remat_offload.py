"""The two copies behind `offload_to_host`: device -> pinned host after the forward, host -> device before the backward.

Custom ops rather than `aten._to_copy`, so that Inductor keeps them as two opaque calls at the places the remat
pass put them (it would otherwise be free to merge a copy there and back, or drop `pin_memory`).
Both copies are issued on the current stream with `non_blocking=True`: ordered with the kernels around
them, so correct; not yet overlapped with compute (that needs a side stream and events).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("pt3func::offload_to_host", mutates_args=())
def offload_to_host(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` in pinned host memory (for a CUDA tensor; a plain copy otherwise)."""
    if x.device.type == "cpu":
        return x.clone()
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    out.copy_(x, non_blocking=True)
    return out


@offload_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("pt3func::reload_to_device", mutates_args=())
def reload_to_device(x: torch.Tensor, device: str) -> torch.Tensor:
    """`x` (host) copied back to `device`."""
    return x.to(device, non_blocking=True, copy=True)


@reload_to_device.register_fake
def _(x: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=device)


OFFLOAD = torch.ops.pt3func.offload_to_host.default
RELOAD = torch.ops.pt3func.reload_to_device.default
