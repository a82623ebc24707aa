"""Ops DTensor gets wrong or refuses on split values, in sharded steps, against one device.

- losses whose mean DTensor took over each rank's block (gradients world-size times too large: `mse_loss`,
  `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy`, `soft_margin_loss`) or had no rule for at all
  (`binary_cross_entropy_with_logits`, `logsigmoid`): `spmd/decompose.py`; `cross_entropy` / `nll_loss`, whose
  mean over a split batch DTensor averaged per block (wrong with class weights or uneven `ignore_index` counts,
  NaN for a block that ignores everything): `spmd/mean_loss.py`;
- convolutions of a weight split over channels or an input split along a spatial dim (`spmd/convolution.py`);
- `argmax` / `argmin` over a split dim (its shard offsets were read inside the trace);
- tensors captured from outside the step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P

N, C = 8, 5


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _data():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(C, C, generator=g),
        "x": torch.randn(N, C, generator=g),
        "y": torch.randn(N, C, generator=g),
        "p": torch.rand(N, C, generator=g) * 0.9 + 0.05,
        "sign": torch.randint(0, 2, (N, C), generator=g).float() * 2 - 1,
        "t": torch.randint(0, C, (N,), generator=g),
    }


# Rows 0-3 are rank 0's block on the 2-rank mesh: every target there is ignored.
_IGNORED = torch.tensor([-100, -100, -100, -100, 1, -100, 3, 0])
_CLASS_WEIGHTS = torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0])

LOSSES = {
    "mse_loss": lambda z, d: F.mse_loss(z, d["y"]),
    "smooth_l1_loss": lambda z, d: F.smooth_l1_loss(z, d["y"]),
    "huber_loss": lambda z, d: F.huber_loss(z, d["y"], delta=0.5),
    "binary_cross_entropy": lambda z, d: F.binary_cross_entropy(torch.sigmoid(z), d["p"]),
    "binary_cross_entropy_with_logits": lambda z, d: F.binary_cross_entropy_with_logits(z, d["p"]),
    "soft_margin_loss": lambda z, d: F.soft_margin_loss(z, d["sign"]),
    "logsigmoid": lambda z, d: -F.logsigmoid(z * d["sign"]).mean(),
    "cross_entropy ignore_index": lambda z, d: F.cross_entropy(z, _IGNORED),
    "cross_entropy weight": lambda z, d: F.cross_entropy(z, d["t"], weight=_CLASS_WEIGHTS),
    "cross_entropy ignore_index, label smoothing": lambda z, d: F.cross_entropy(z, _IGNORED, label_smoothing=0.1),
    "nll_loss of uneven blocks": lambda z, d: F.nll_loss(F.log_softmax(z, -1), _IGNORED.roll(1)),
    "var over the batch": lambda z, d: z.var(0).sum(),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_of_a_split_batch_equal_one_device(mesh, name):
    loss = LOSSES[name]

    def value_and_grad(w, d):
        return pf.value_and_grad(lambda w: loss(d["x"] @ w, d))(w)

    d = _data()
    want_value, want_grad = value_and_grad(d["w"], d)
    batch_specs = {k: (P() if k == "w" else P("dp")) for k in d}
    with pf.set_mesh(mesh):
        value, grad = pf.jit(value_and_grad, in_shardings=(P(), batch_specs), backend="eager")(d["w"], d)
    torch.testing.assert_close(pf.device_get(value), want_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pf.device_get(grad), want_grad, rtol=1e-5, atol=1e-6)


CONVOLUTIONS = {
    # name: (weight spec, input spec, conv)
    "conv2d, weight split over out-channels": (P("dp"), P(), F.conv2d),
    "conv2d, weight split over in-channels": (P(None, "dp"), P(), F.conv2d),
    "conv2d, input split along its width": (P(), P(None, None, None, "dp"), F.conv2d),
    "conv2d, batch and out-channels split": (P("dp"), P("dp"), F.conv2d),
    "conv_transpose2d, weight split over in-channels": (P("dp"), P(), F.conv_transpose2d),
}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(CONVOLUTIONS))
def test_convolutions_of_split_weights_and_inputs_equal_one_device(mesh, name, backend):
    w_spec, x_spec, conv = CONVOLUTIONS[name]
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 4, 3, 3, generator=g), "b": torch.randn(4, generator=g)}
    x = torch.randn(2, 4, 8, 8, generator=g)

    def step(params, x):
        def loss(params):
            y = conv(x, params["w"], params["b"], padding=1)
            return (y.tanh() * torch.arange(y.shape[-1], dtype=y.dtype)).square().mean(), y

        (value, y), grads = pf.value_and_grad(loss, has_aux=True)(params)
        return value, y, grads

    want = step(params, x)
    bias_spec = w_spec if conv is F.conv2d and w_spec == P("dp") else P()
    with pf.set_mesh(mesh):
        got = pf.jit(step, in_shardings=({"w": w_spec, "b": bias_spec}, x_spec), backend=backend)(params, x)
    for a, b in zip(pf.tree.leaves(pf.device_get(got)), pf.tree.leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call", ["argmax(0)", "argmax()", "argmin(0)", "argmax(1)"])
def test_argmax_over_a_split_dim_equals_one_device(mesh, call):
    fn = {"argmax(0)": lambda a: a.argmax(0), "argmax()": lambda a: a.argmax(),
          "argmin(0)": lambda a: a.argmin(0), "argmax(1)": lambda a: a.argmax(1)}[call]
    a = torch.randn(N, C, generator=torch.Generator().manual_seed(2))
    with pf.set_mesh(mesh):
        got = pf.jit(fn, in_shardings=(P("dp"),), backend="eager")(a)
    assert torch.equal(pf.device_get(got), fn(a))


def test_captured_tensors_in_a_sharded_step(mesh):
    table = torch.randn(N, C, generator=torch.Generator().manual_seed(3))
    scale = torch.linspace(0.5, 1.5, C)

    def loss(w, x):
        return ((x @ w) * table * scale).square().sum() + table.sum()

    w, x = _data()["w"], _data()["x"]
    want = pf.value_and_grad(loss)(w, x)
    with pf.set_mesh(mesh):
        got = pf.jit(pf.value_and_grad(loss), in_shardings=(P(), P("dp")))(w, x)
    for a, b in zip(pf.device_get(got), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose", [False, True])
def test_convolution_of_a_batch_split_over_two_axes_equals_one_device(transpose):
    """Data parallel over a whole 2 x 2 mesh (`P(("dp", "tp"))`): DTensor's rule refused two Shard(0)s."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, 3, 3, generator=g) * 0.3, "b": torch.randn(4, generator=g)}
    if not transpose:
        params["w"] = params["w"].transpose(0, 1).contiguous()
    conv = F.conv_transpose2d if transpose else F.conv2d
    x = torch.randn(8, 3, 5, 5, generator=g)

    def step(p, x):
        return pf.value_and_grad(lambda p: conv(x, p["w"], p["b"], padding=1).pow(2).mean())(p)

    want = pf.jit(step, backend="eager")(params, x)
    with pf.set_mesh(pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)):
        got = pf.device_get(pf.jit(step, in_shardings=(P(), P(("dp", "tp"))), backend="eager")(params, x))
    for a, b in zip(pf.tree.leaves(got), pf.tree.leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
