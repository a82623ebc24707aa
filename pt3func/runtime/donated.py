"""Invalidate donated tensors so that reading one raises instead of returning overwritten data."""

from __future__ import annotations

from typing import Any

import torch

from pt3func.errors import DonationError

# Functions that must keep working on a donated tensor: hashing (dicts, sets, weakrefs) and repr.
_ALLOWED = {torch.Tensor.__hash__, torch.Tensor.__repr__, torch.Tensor.__format__}


class DonatedTensor(torch.Tensor):
    """The class a donated input is switched to: every torch operation on it raises `DonationError`."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        victim = next((a for a in args if is_donated(a)), None)
        where = donated_to(victim)
        raise DonationError(
            f"this tensor was donated to {where}: its buffer now holds that call's outputs, so it can no "
            "longer be read. Use the values the call returned instead (e.g. `params, opt_state, m = "
            "step(params, opt_state, batch)`), or do not donate it."
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"DonatedTensor(<donated to {donated_to(self)}>)"


_DONATED_SUBCLASSES: dict[type, type] = {}


def _donated_class(cls: type) -> type:
    """A subclass of `cls` (Tensor, Parameter, DTensor, ...) that refuses every operation."""
    if cls is torch.Tensor:
        return DonatedTensor
    sub = _DONATED_SUBCLASSES.get(cls)
    if sub is None:
        # Same memory layout as `cls` (no new slots), so an instance's class can be switched in place.
        sub = type(f"Donated{cls.__name__}", (cls,), {
            "__torch_function__": DonatedTensor.__dict__["__torch_function__"],
            "__repr__": DonatedTensor.__repr__,
            "_pt3func_is_donated": True,
        })
        _DONATED_SUBCLASSES[cls] = sub
    return sub


_BY_PROGRAM: dict[tuple[type, str], type] = {}


def invalidate(t: torch.Tensor, where: str) -> None:
    """Mark `t` donated: it keeps no extra memory alive and raises on any use."""
    # One subclass per (class, program) carries the program's name, so a call sets one attribute per tensor.
    cls = _BY_PROGRAM.get((type(t), where))
    if cls is None:
        base = _donated_class(type(t))
        cls = _BY_PROGRAM[(type(t), where)] = type(base.__name__, (base,), {"_pt3func_donated": where})
    t.__class__ = cls


def is_donated(t: Any) -> bool:
    return isinstance(t, DonatedTensor) or getattr(type(t), "_pt3func_is_donated", False)


def donated_to(t: Any) -> str:
    """The program a donated tensor was donated to, as its errors and repr name it."""
    return getattr(t, "_pt3func_donated", "a jitted step")


def refuse_inference_donation(name: str, labels: Any, leaves: Any, donated: Any) -> None:
    """Refuse a call outside `torch.inference_mode()` that donates a tensor made inside it (a KV cache filled
    under inference mode): torch forbids writing into it there, and the program writes each donated buffer in
    place, so the call would fail inside torch without naming the argument. `donated`: the leaf indices whose
    buffers the program writes; `labels[i]` names leaf i."""
    if torch.is_inference_mode_enabled():
        return
    for i in donated:
        leaf = leaves[i]
        local = getattr(leaf, "_local_tensor", leaf)
        if isinstance(local, torch.Tensor) and local.is_inference():
            raise DonationError(
                f"{name}: donated {labels[i]} is an inference tensor (made under torch.inference_mode()), and "
                "torch forbids writing into one outside inference mode. Call the step under "
                "torch.inference_mode() too, pass a normal tensor (`.clone()` it outside inference mode), or do "
                "not donate it."
            )
