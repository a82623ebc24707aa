"""A train step with dropout and random noise, run sharded on gloo ranks and on one device (test_random_sharded.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P

STEPS = 3
SEED = 1234
OPT = pf.optim.adamw(1e-2)


def init_params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(16, 32, generator=g) * 0.3, "w2": torch.randn(32, 8, generator=g) * 0.3}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]


def loss_fn(params, x, y):
    h = torch.tanh(x @ params["w1"])
    h = F.dropout(h, 0.3, training=True)
    h = F.dropout2d(h.reshape(8, 4, 8, 1), 0.25, training=True).reshape(8, 32)  # 4 channels of 8 features
    h = h + 0.05 * torch.randn_like(h) + 0.05 * (torch.rand_like(h) - 0.5)
    h = h + 0.05 * torch.empty_like(h).uniform_(-1, 1) * torch.empty_like(h).bernoulli_(0.5)
    return ((h @ params["w2"] - y) ** 2).mean()


def train_step(params, opt_state, x, y):
    loss, grads = pf.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return pf.optim.apply_updates(params, updates), opt_state, loss


# name -> (mesh shape, axis names, param specs, batch spec); the hidden activation h is split along its batch dim
# over dp and along its features over tp.
CASES = {
    "dp2": ((2,), ("dp",), {"w1": P(), "w2": P()}, P("dp")),
    "fsdp2": ((2,), ("dp",), {"w1": P("dp"), "w2": P("dp")}, P("dp")),
    "dp4": ((4,), ("dp",), {"w1": P(), "w2": P()}, P("dp")),
    "tp4": ((4,), ("tp",), {"w1": P(None, "tp"), "w2": P("tp", None)}, P()),
    "dp_tp": ((2, 2), ("dp", "tp"), {"w1": P(None, "tp"), "w2": P("tp", None)}, P("dp")),
}


def run_single(backend: str) -> tuple[dict, list[float]]:
    torch.manual_seed(SEED)
    step = pf.jit(train_step, backend=backend)
    params = init_params()
    state = OPT.init(params)
    losses = []
    for x, y in batches():
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return params, losses


def run_sharded(rank: int, world: int, names: list[str], backend: str) -> dict:
    results = {}
    for name in names:
        shape, axes, specs, batch_spec = CASES[name]
        mesh = pf.make_mesh(shape, axes)
        torch.manual_seed(SEED)  # every rank alike, as a real run seeds them
        step = pf.jit(train_step, in_shardings=(specs, None, batch_spec, batch_spec), backend=backend)
        with pf.set_mesh(mesh):
            params = pf.device_put(init_params(), specs)
            state = pf.jit(OPT.init, backend="eager")(params)
            losses = []
            for x, y in batches():
                params, state, loss = step(params, state, x, y)
                losses.append(float(pf.device_get(loss)))
            results[name] = (pf.device_get(params), losses)
    return results


def alpha_dropout_step(x):
    a = F.dropout(x, 0.5, True)
    return F.alpha_dropout(a, 0.5, True).sum()


def rank_checks(rank: int, world: int) -> dict:
    """One rank's view of the override (`random_ops.dropout` called directly) and of the warning for a random
    function it does not redraw."""
    import warnings

    from pt3func.spmd.random_ops import dropout

    mesh = pf.make_mesh((world,), ("dp",))
    x = torch.randn(6 * world, 4, generator=torch.Generator().manual_seed(3))
    with pf.set_mesh(mesh):
        split, whole = pf.device_put(x, P("dp")), pf.device_put(x, P())
        torch.manual_seed(0)
        block = dropout(F.dropout, (split, 0.5, True), {}).to_local()
        left_alone = [dropout(F.dropout, (whole, 0.5, True), {}),
                      dropout(F.dropout, (split,), {"p": 0.5, "training": False}), dropout(F.dropout, (split, 0.0), {})]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pf.jit(alpha_dropout_step, in_shardings=(P("dp"),), backend="eager")(x[:8])
    return {
        "x": x, "block": block, "left_alone": left_alone,
        "warnings": [str(w.message) for w in caught if "on a value split over the mesh" in str(w.message)],
    }
