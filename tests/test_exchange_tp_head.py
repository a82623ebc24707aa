"""A stateful compressed exchange on a dp x tp mesh where a replicated head follows a row-parallel layer: its
gradient is a sum over dp+tp. Session 13: summed exactly over tp first, then compressed over dp with state sized
for the data axes; a state built for the wrong axes gets an error naming the reduction's axes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.passes.grad_exchange import GradExchangeError

C = pf.compress


def _loss(p, x, y):
    return F.mse_loss((torch.relu(x @ p["w1"]) @ p["w2"]) @ p["head"], y)


def _step(p, ex, x, y):
    return pf.grad(_loss)(p, x, y), ex


@pytest.fixture()
def setup(monkeypatch):
    monkeypatch.setattr(pf.config, "exchange_guard", "off")
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(6, 8, generator=g) * 0.3, "w2": torch.randn(8, 6, generator=g) * 0.3,
              "head": torch.randn(6, 4, generator=g) * 0.3}
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    return mesh, params, x, y


SPECS = {"w1": P(None, "tp"), "w2": P("tp"), "head": P()}
TORCH_2_13 = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch 2.11's DTensor reduces the row-split w2's gradient whole over dp (README, Known limits)",
)


@TORCH_2_13
def test_a_head_summed_over_dp_and_tp_is_compressed_over_dp(setup):
    mesh, params, x, y = setup
    fmt = C.int8(block=8)
    exact = pf.grad(_loss)(params, x, y)
    with pf.set_mesh(mesh):
        p = pf.device_put(params, SPECS)
        step = pf.jit(_step, in_shardings=(None, None, P("dp"), P("dp")), grad_exchange=fmt, backend="eager")
        state = fmt.init(p, data_axes="dp")
        text = step.lower(p, state, x, y).as_text()
        grads, _ = pf.device_get(step(p, state, x, y))
    assert "exact sum over tp first" in text
    for name in ("w1", "w2", "head"):  # int8 with blocks of 8: close to the exact gradient
        assert float((grads[name] - exact[name]).norm() / exact[name].norm()) < 0.02, name


@TORCH_2_13
def test_state_for_the_wrong_axes_names_the_reduction(setup):
    mesh, params, x, y = setup
    fmt = C.int8(block=8)
    with pf.set_mesh(mesh):
        p = pf.device_put(params, SPECS)
        step = pf.jit(_step, in_shardings=(None, None, P("dp"), P("dp")), grad_exchange=fmt, backend="eager")
        with pytest.raises(GradExchangeError, match=r"p\['w2'\].*over 2 ranks \(axes 'dp'\).*per_leaf"):
            step(p, fmt.init(p, data_axes=("dp", "tp")), x, y)


@TORCH_2_13
def test_per_leaf_leaves_the_head_uncompressed(setup):
    mesh, params, x, y = setup
    fmt = C.per_leaf(lambda path, shape: None if path == "['head']" else C.int8(block=8))
    exact = pf.grad(_loss)(params, x, y)
    with pf.set_mesh(mesh):
        p = pf.device_put(params, SPECS)
        step = pf.jit(_step, in_shardings=(None, None, P("dp"), P("dp")), grad_exchange=fmt, backend="eager")
        grads, _ = pf.device_get(step(p, fmt.init(p, data_axes="dp"), x, y))
    torch.testing.assert_close(grads["head"], exact["head"], rtol=1e-5, atol=1e-6)  # uncompressed: exact
    for name in ("w1", "w2"):  # int8 with blocks of 8: close
        assert float((grads[name] - exact[name]).norm() / exact[name].norm()) < 0.02
