"""`pf.compress`: compressed gradient exchange for `pf.jit(step, grad_exchange=...)`.

    exchange = pf.compress.skip_small(pf.compress.int8(block=256), min_numel=4096)
    opt = pf.compress.with_state(pf.optim.adamw(3e-4), exchange)   # opt state = (adam state, ExchangeState)
    step = pf.jit(train_step, grad_exchange=exchange, donate_argnums=(0, 1))

Every gradient all-reduce (data parallel) and reduce-scatter (FSDP) of the traced program is rewritten into
the format's compressed reduction (pt3func/passes/grad_exchange.py); `Lowered.as_text()` shows the new
collectives and `cost_analysis()["comm_bytes"]` their volume. Error-feedback residuals live in an explicit
`ExchangeState` that the step takes and returns. A `Guard` (on by default for all but bf16, fp16 and none) times the
compressed step against a bf16-exchange one on the first calls and switches compression off where it costs more
than 3% (pt3func/compress/guard.py).
"""

from __future__ import annotations

from typing import Any

from pt3func.compress.formats import (
    Format,
    adaptive_alpha,
    bf16,
    chain,
    fp16,
    int4,
    int8,
    none,
    per_leaf,
    powersgd,
    skip_small,
    topk,
)
from pt3func.compress.guard import ExchangeDecision, Guard
from pt3func.compress.state import ExchangeState, LeafState
from pt3func.optim.base import GradientTransformation


def with_state(
    opt: GradientTransformation, exchange: Format, data_axes: str | tuple[str, ...] | None = None
) -> GradientTransformation:
    """`opt` whose state also carries `exchange`'s `ExchangeState`: `(opt state, exchange state)`.

    `update` leaves the exchange state as it is; the jitted step returns it and the program writes the new
    residuals. Use this so the residuals are donated and checkpointed with the optimizer state.
    """

    def init_fn(params: Any) -> tuple[Any, ExchangeState]:
        return opt.init(params), exchange.init(params, data_axes)

    def update_fn(updates: Any, state: tuple[Any, ExchangeState], params: Any = None) -> tuple[Any, Any]:
        inner, ex = state
        updates, inner = opt.update(updates, inner, params)
        return updates, (inner, ex)

    return GradientTransformation(init_fn, update_fn)


__all__ = [
    "ExchangeDecision",
    "ExchangeState",
    "Format",
    "Guard",
    "LeafState",
    "adaptive_alpha",
    "bf16",
    "chain",
    "fp16",
    "int4",
    "int8",
    "none",
    "per_leaf",
    "powersgd",
    "skip_small",
    "topk",
    "with_state",
]
