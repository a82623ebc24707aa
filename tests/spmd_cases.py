"""Sharded train steps checked against the single-device run of the same step (run on every rank)."""

from __future__ import annotations

import torch

import pt3func as pf
from pt3func.sharding import P

STEPS = 4


def init_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1": {"w": torch.randn(16, 32, generator=g) * 0.3, "b": torch.zeros(32)},
        "fc2": {"w": torch.randn(32, 8, generator=g) * 0.3},
    }


def batches(n: int = STEPS, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(n)]


def loss_fn(params, x, y):
    h = torch.tanh(x @ params["fc1"]["w"] + params["fc1"]["b"])
    return ((h @ params["fc2"]["w"] - y) ** 2).mean()


OPT = pf.optim.adamw(1e-2, weight_decay=0.01)


def train_step(params, opt_state, batch):
    loss, grads = pf.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return pf.optim.apply_updates(params, updates), opt_state, loss


# name -> (mesh shape, axis names, param specs, optimizer-state spec rule, batch spec)
CASES = {
    "dp": ((4,), ("dp",), {"fc1": {"w": P(), "b": P()}, "fc2": {"w": P()}}, "params", P("dp")),
    "fsdp": ((4,), ("dp",), {"fc1": {"w": P("dp"), "b": P("dp")}, "fc2": {"w": P("dp")}}, "params", P("dp")),
    "zero1": ((4,), ("dp",), {"fc1": {"w": P(), "b": P()}, "fc2": {"w": P()}}, P("dp"), P("dp")),
    "tp": ((4,), ("tp",), {"fc1": {"w": P(None, "tp"), "b": P("tp")}, "fc2": {"w": P("tp", None)}}, "params", P()),
    "dp_tp": ((2, 2), ("dp", "tp"), {"fc1": {"w": P(None, "tp"), "b": P("tp")}, "fc2": {"w": P("tp", None)}},
              "params", P("dp")),
    "fsdp_tp": ((2, 2), ("dp", "tp"), {"fc1": {"w": P("dp", "tp"), "b": P("tp")}, "fc2": {"w": P("tp", "dp")}},
                "params", P("dp")),
    "dp2": ((2,), ("dp",), {"fc1": {"w": P(), "b": P()}, "fc2": {"w": P()}}, "params", P("dp")),
    "fsdp2": ((2,), ("dp",), {"fc1": {"w": P("dp"), "b": P("dp")}, "fc2": {"w": P("dp")}}, "params", P("dp")),
}


def reference() -> tuple[dict, list[float]]:
    params = init_params()
    opt_state = OPT.init(params)
    losses = []
    for batch in batches():
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


def opt_state_specs(opt_state, param_specs, rule):
    """Optimizer-state shardings: follow the params (`"params"`), or one spec for every leaf of 1+ dims."""
    def spec_for(x):
        if rule == "params" or x.ndim == 0:
            return None
        return rule

    return pf.tree.map(spec_for, opt_state)


def _local_numel(x) -> int | None:
    """Elements this rank (rank 0 of a virtual mesh) holds of a sharded value."""
    if hasattr(x, "locals"):
        x = x.locals[0]
    return x._local_tensor.numel() if hasattr(x, "_local_tensor") else None


def run_case(name: str, backend: str = "eager", virtual: bool = False) -> dict:
    """Train the sharded step for STEPS steps; return what the test compares (on every rank)."""
    shape, axes, param_specs, opt_rule, batch_spec = CASES[name]
    mesh = pf.make_mesh(shape, axes, virtual=virtual)
    with pf.set_mesh(mesh):
        params = pf.device_put(init_params(), param_specs)
        opt_state = pf.jit(OPT.init, backend=backend)(params)  # jitted: runs where the shards live
        if opt_rule != "params":
            opt_state = pf.device_put(opt_state, opt_state_specs(opt_state, param_specs, opt_rule))
        opt_specs = None if opt_rule == "params" else opt_state_specs(opt_state, param_specs, opt_rule)
        step = pf.jit(train_step, in_shardings=(param_specs, opt_specs, (batch_spec, batch_spec)),
                      donate_argnums=(0, 1), backend=backend)
        losses = []
        local_sizes = {k: _local_numel(v) for k, v in _flat(params).items()}
        data = batches()
        lowered = step.lower(params, opt_state, data[0])
        buffers_before = _local_buffers(params)
        for batch in data:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(pf.device_get(loss)))
        state_sizes = [n for n in map(_local_numel, pf.tree.leaves(opt_state)) if n is not None]
        return {
            "params": pf.tree.map(lambda x: x.clone(), pf.device_get(params)),
            "losses": losses,
            "local_sizes": local_sizes,
            "state_sizes": state_sizes,
            "text": lowered.as_text(),
            "comm_bytes": lowered.cost_analysis()["comm_bytes"],
            "trace_count": step.trace_count(),
            # Donated shards are updated in place: the new params live in the old local buffers.
            "params_in_place": buffers_before is not None and buffers_before == _local_buffers(params),
            "donation_report": lowered.donation_report(),
        }


def _local_buffers(tree) -> list[int] | None:
    """The data pointers of this rank's shards (None on a virtual mesh, whose shards live in rank threads)."""
    leaves = pf.tree.leaves(tree)
    if any(hasattr(leaf, "locals") for leaf in leaves):
        return None
    return [leaf._local_tensor.data_ptr() for leaf in leaves]


def _flat(tree) -> dict:
    return {pf.tree.keystr(path): leaf for path, leaf in zip(pf.tree.paths(tree), pf.tree.leaves(tree))}
