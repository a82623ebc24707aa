"""More sharded checks run on every rank of a gloo world (see test_spmd_more.py)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

import pt3func as pf
from pt3func import P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def sharding_constraint() -> dict:
    mesh = pf.make_mesh((4,), ("dp",))

    def f(x):
        y = pf.with_sharding_constraint(x * 2, P("dp"))
        return y + 1

    x = torch.arange(8.0).reshape(8, 1)
    with pf.set_mesh(mesh):
        out = pf.jit(f, in_shardings=(P(),), backend="eager")(x)
        text = pf.jit(f, in_shardings=(P(),), backend="eager").lower(x).as_text()
    return {"placements": str(out.placements), "full": pf.device_get(out), "text": text}


def _mlp_params() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w1": torch.randn(16, 32, generator=g) * 0.3, "w2": torch.randn(32, 16, generator=g) * 0.3}


def _data() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(4))


def shard_map_vs_automatic_tp() -> dict:
    mesh = pf.make_mesh((4,), ("tp",))
    x = _data()

    def automatic(params, x):
        return (torch.tanh(x @ params["w1"]) @ params["w2"]).pow(2).mean()

    def by_hand(params, x):
        def local(w1, w2, x):  # column-parallel w1, row-parallel w2, one psum: Megatron by hand
            return pf.lax.psum(torch.tanh(x @ w1) @ w2, "tp")

        y = pf.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P())(
            params["w1"], params["w2"], x
        )
        return y.pow(2).mean()

    specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
    out = {}
    with pf.set_mesh(mesh):
        params = pf.device_put(_mlp_params(), specs)
        for name, loss_fn in (("automatic", automatic), ("by_hand", by_hand)):
            step = pf.jit(pf.value_and_grad(loss_fn), backend="eager")
            loss, grads = step(params, pf.device_put(x, P()))
            out[name] = {"loss": pf.device_get(loss), "grads": pf.device_get(grads)}
            out[name + "_comm"] = step.lower(params, pf.device_put(x, P())).cost_analysis()["comm_bytes"]
    loss, grads = pf.value_and_grad(automatic)(_mlp_params(), x)
    out["single"] = {"loss": loss, "grads": grads}
    return out


def gpt_dp_tp() -> dict:
    """The example GPT (attention included) on a 2 x 2 dp x tp mesh, three AdamW steps vs one device."""
    import gpt

    config = gpt.GPTConfig(vocab=40, seq=16, d_model=32, n_layers=2, n_heads=4)
    opt = pf.optim.adamw(1e-2)

    def train_step(params, opt_state, batch):
        loss, grads = pf.value_and_grad(gpt.loss_fn)(params, batch, config)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 40, (4, 16), generator=g), torch.randint(0, 40, (4, 16), generator=g))
               for _ in range(3)]
    params = gpt.init_params(config, seed=0)
    opt_state = opt.init(params)
    ref_losses = []
    for batch in batches:
        params, opt_state, loss = train_step(params, opt_state, batch)
        ref_losses.append(float(loss))
    ref_params = params

    mesh = pf.make_mesh((2, 2), ("dp", "tp"))
    with pf.set_mesh(mesh):
        params = gpt.init_params(config, seed=0)
        params = pf.device_put(params, gpt.param_specs(params, "tp"))
        opt_state = pf.jit(opt.init, backend="eager")(params)
        step = pf.jit(train_step, in_shardings=(None, None, P("dp")), donate_argnums=(0, 1), backend="eager")
        losses = []
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(pf.device_get(loss)))
        text = step.lower(params, opt_state, batches[0]).as_text()
    full = pf.device_get(params)
    err = max(float((a - b).abs().max()) for a, b in zip(pf.tree.leaves(full), pf.tree.leaves(ref_params)))
    return {"losses": losses, "ref_losses": ref_losses, "max_param_err": err, "text": text}


def errors() -> dict:
    mesh = pf.make_mesh((4,), ("dp",))
    messages = {}
    try:
        pf.make_mesh((3,), ("dp",))
    except pf.ShardingError as e:
        messages["world"] = str(e)

    def step(params):
        return {"w": params["w"] * 2}

    with pf.set_mesh(mesh):
        params = pf.device_put({"w": torch.ones(8, 4)}, P("dp"))
        try:
            pf.jit(step, donate_argnums=0, out_shardings=P(), backend="eager")(params)
        except pf.ShardingError as e:
            messages["donation"] = str(e)
        try:
            pf.jit(step, in_shardings=({"w": P(None, "dp")},), backend="eager")({"w": torch.ones(8, 6)})
        except pf.ShardingError as e:
            messages["divisible"] = str(e)
        # A donated shard whose only output comes back replicated cannot be reused: reported, not silent.
        sharded = pf.device_put(torch.ones(8, 4), P("dp"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pf.jit(lambda a: {"x": a * 2}, donate_argnums=0, out_shardings={"x": P()}, backend="eager")(sharded)
        messages["unused_donation"] = "\n".join(str(w.message) for w in caught)
    return messages


def run_all(rank: int, world: int) -> dict:
    return {
        "constraint": sharding_constraint(),
        "shard_map": shard_map_vs_automatic_tp(),
        "gpt": gpt_dp_tp(),
        "errors": errors(),
    }
