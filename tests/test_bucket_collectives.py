"""`pf.config.bucket_collectives`: Inductor's collective bucketing, when it applies and that it keeps the values."""

from __future__ import annotations

import re

import pytest
import torch
from dist import run_world
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import pt3func as pf
from pt3func.runtime.backend import bucket_collectives


def _graph(device: str, collective: bool) -> fx.GraphModule:
    """x -> (all_gather ->) x * 2, with `val` metadata on `device` (fake tensors: no GPU needed)."""
    graph = fx.Graph()
    with FakeTensorMode():
        val = torch.empty(4, 2, device=device)
    x = graph.placeholder("x")
    x.meta["val"] = val
    y = x
    if collective:
        y = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
        y.meta["val"] = val
    out = graph.call_function(torch.ops.aten.mul.Tensor, (y, 2))
    out.meta["val"] = val
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    "setting, device, collective, expected",
    [
        ("auto", "cuda", True, True),  # FSDP on GPUs: the measured case
        ("auto", "cuda", False, False),  # nothing to bucket
        ("auto", "cpu", True, False),  # gloo: not measured, left as it was
        ("on", "cpu", True, True),
        ("off", "cuda", True, False),
    ],
)
def test_when_bucketing_applies(monkeypatch, setting, device, collective, expected):
    monkeypatch.setattr(pf.config, "bucket_collectives", setting)
    assert bucket_collectives(_graph(device, collective)) is expected


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="bucket_collectives is one of 'auto', 'on', 'off', got 'yes'"):
        pf.config.bucket_collectives = "yes"
    assert pf.config.bucket_collectives in ("auto", "on", "off")


def _fsdp_steps(rank: int, world: int, setting: str) -> dict:
    pf.config.bucket_collectives = setting
    mesh = pf.make_mesh((world,), ("dp",))
    torch.manual_seed(0)
    params = {f"l{i}": {"w": torch.randn(8, 8) / 3, "b": torch.zeros(8)} for i in range(3)}
    data = torch.randn(4 * world, 8), torch.randn(4 * world, 8)
    sharded = pf.NamedSharding(mesh, pf.P("dp"))
    params = pf.device_put(params, sharded)
    batch = pf.device_put(data, sharded)

    def loss_fn(p, x, y):
        for i in range(3):
            x = torch.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return ((x - y) ** 2).mean()

    def step(p, x, y):
        loss, g = pf.value_and_grad(loss_fn)(p, x, y)
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    jitted = pf.jit(step, backend="inductor", donate_argnums=0)
    code = jitted.lower(params, *batch).compile().generated_code()
    losses = []
    for _ in range(3):
        params, loss = jitted(params, *batch)
        losses.append(float(loss))
    pf.config.bucket_collectives = "auto"
    launches = {
        kind: len(re.findall(rf"torch\.ops\._c10d_functional\.{kind}\.default\(", code))
        for kind in ("all_gather_into_tensor", "reduce_scatter_tensor")
    }
    return {"params": pf.device_get(params), "losses": losses, "launches": launches}


@pytest.mark.slow
def test_bucketed_fsdp_program_equals_the_unbucketed_one_on_two_ranks():
    on = run_world(2, _fsdp_steps, "on")[0]
    off = run_world(2, _fsdp_steps, "off")[0]
    # Six sharded leaves: one all-gather and one reduce-scatter each unbucketed, fewer launches bucketed.
    assert off["launches"] == {"all_gather_into_tensor": 6, "reduce_scatter_tensor": 6}, off["launches"]
    assert on["launches"]["all_gather_into_tensor"] < 6 and on["launches"]["reduce_scatter_tensor"] < 6, on["launches"]
    assert on["losses"] == off["losses"]
    for path, a, b in zip(pf.tree.paths(off["params"]), pf.tree.leaves(on["params"]), pf.tree.leaves(off["params"])):
        assert torch.equal(a, b), pf.tree.keystr(path)


def _compressed_fsdp_steps(rank: int, world: int, setting: str, fmt_text: str) -> dict:
    import compress_cases as cases

    pf.config.bucket_collectives = setting
    mesh, specs, batch_spec, data_axes = cases._setup("fsdp2")
    fmt = eval(fmt_text, vars(pf.compress))  # noqa: S307 - test constants
    with pf.set_mesh(mesh):
        params = pf.device_put(cases.init_params(), specs)
        ex = fmt.init(params, data_axes=data_axes)
        step = pf.jit(
            cases.grad_step,
            in_shardings=(specs, None, batch_spec, batch_spec),
            grad_exchange=fmt,
            backend="inductor",
            **cases._jit_kwargs(),
        )
        grads = []
        for t in range(3):
            g, ex = step(params, ex, *cases.batch(t))
            grads.append(cases._full(g))
    pf.config.bucket_collectives = "auto"
    return {"grads": grads, "residuals": cases._full(ex.leaves)}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16()", "int8(error_feedback=True)"])
def test_compressed_fsdp_exchange_is_unchanged_by_bucketing(fmt):
    """Inductor's bucketing also meets the compressed exchange's collectives (gloo, 2 ranks, Inductor)."""
    on = run_world(2, _compressed_fsdp_steps, "on", fmt)[0]
    off = run_world(2, _compressed_fsdp_steps, "off", fmt)[0]
    for step_on, step_off in zip(on["grads"], off["grads"]):
        for name in step_off:
            assert torch.equal(step_on[name], step_off[name]), name
    for a, b in zip(pf.tree.leaves(on["residuals"]), pf.tree.leaves(off["residuals"])):
        assert torch.equal(a, b)


def _bucketed_spmd_cases(rank: int, world: int, names: list[str]) -> dict:
    import spmd_cases

    pf.config.bucket_collectives = "on"
    try:
        return {name: spmd_cases.run_case(name, backend="inductor") for name in names}
    finally:
        pf.config.bucket_collectives = "auto"


@pytest.mark.slow
def test_bucketed_fsdp_and_fsdp_x_tp_match_one_device_on_four_ranks():
    """What "auto" turns on for FSDP on GPUs, forced on here: FSDP over 4 ranks and FSDP x TP on a 2 x 2 mesh
    (collectives of two process groups in one program) against the single-device run of the same steps."""
    import spmd_cases

    ref_params, ref_losses = spmd_cases.reference()
    for result in run_world(4, _bucketed_spmd_cases, ["fsdp", "fsdp_tp"]):
        for name, case in result.items():
            for got, want in zip(case["losses"], ref_losses):
                assert abs(got - want) <= 1e-5 * max(abs(want), 1.0), name
            for path, want in zip(pf.tree.paths(ref_params), pf.tree.leaves(ref_params)):
                got = case["params"]
                for key in path:
                    got = got[key]
                assert float((got - want).norm() / want.norm().clamp_min(1e-12)) <= 1e-5, (name, path)
