"""The random generators' states as a pytree of tensors, so a checkpoint can carry them."""

from __future__ import annotations

import torch


def rng_state() -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """This process's generator states: `{"cpu": uint8 tensor}`, plus `"cuda": [one per device]` if CUDA is up."""
    state: dict[str, torch.Tensor | list[torch.Tensor]] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, torch.Tensor | list[torch.Tensor]]) -> None:
    """Restore the generator states that `rng_state()` returned (a CUDA part is skipped without CUDA)."""
    torch.set_rng_state(state["cpu"].to("cpu", torch.uint8).contiguous())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to("cpu", torch.uint8).contiguous() for s in state["cuda"]])
