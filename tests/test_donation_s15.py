"""Donation against views of split/unbind pieces, reads after the in-place write, re-layouts of the donated input,
and plain tensors placed by in_shardings for a donated argument."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.trace.capture import storage_root

_PIECE_OUTPUTS = {
    "unbind": lambda a: (a + 1, a.unbind(0)[0]),
    "chunk": lambda a: (a + 1, a.chunk(2, 0)[0]),
    "split": lambda a: (a + 1, a.split(1, 0)[1]),
    "split_with_sizes": lambda a: (a + 1, a.split([1, 1], 0)[1]),
}


@pytest.mark.parametrize("name", list(_PIECE_OUTPUTS))
def test_output_that_is_a_split_piece_of_a_donated_input_is_not_aliased(name):
    fn = _PIECE_OUTPUTS[name]
    a = torch.randn(2, 3)
    expected = [t.clone() for t in fn(a.clone())]
    with pytest.warns(UserWarning, match="reads this input's memory"):
        out = pf.jit(fn, donate_argnums=0, backend="eager")(a)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)


def test_write_through_a_split_piece_of_an_input_is_impure():
    def g(a):
        x, y = a.split(1, 0)
        x.mul_(0)
        return y + 1

    a = torch.ones(2, 3)
    with pytest.raises(pf.ImpureFunctionError, match="writes in place into input a"):
        pf.jit(g, backend="eager")(a)
    torch.testing.assert_close(a, torch.ones(2, 3))


def _soft_tied_step(params, x):
    def loss_fn(enc, dec, x):
        return ((torch.tanh(x @ enc) @ dec - x) ** 2).mean()

    enc = params["enc"].view(4, 3)  # flat storage viewed once, before the gradients' all-reduces
    dec = params["dec"].view(3, 4)
    g_enc, g_dec = pf.grad(loss_fn, argnums=(0, 1))(enc, dec, x)
    new_enc = enc - 0.1 * (g_enc + 0.5 * (enc - dec.t()))  # reads the old decoder after its all-reduce
    return {"enc": new_enc.reshape(-1), "dec": (dec - 0.1 * g_dec).reshape(-1)}


def test_donation_copy_stays_after_reads_through_views_made_before_the_collectives():
    torch.manual_seed(0)
    params = {"enc": torch.randn(12), "dec": torch.randn(12)}
    x = torch.randn(8, 4)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        step = pf.jit(_soft_tied_step, donate_argnums=0, backend="inductor")  # lowered only: the passes, no compile
        lowered = step.lower(pf.device_put(params, P()), pf.device_put(x, P("dp")))
    assert all(row["aliased"] for row in lowered.donation_report())
    nodes = list(lowered.graph_module.graph.nodes)
    for k, node in enumerate(nodes):
        if node.target is torch.ops.aten.copy_.default:
            written = storage_root(node.args[0])
            late = [n.name for n in nodes[k + 1:] if any(storage_root(a) is written for a in n.all_input_nodes)
                    and n.op != "output"]
            assert not late, f"{node.name} writes {written.name} before {late} read it"


_RELAYOUTS = {
    "view.t.reshape": lambda a: a.view(4, 4).t().reshape(16),
    "view.flip.reshape": lambda a: a.view(2, 8).flip(0).reshape(16),
    "transpose then pointwise": lambda a: a.view(4, 4).transpose(0, 1).reshape(16) * 2 + 1,
    "roll": lambda a: a.roll(3) + a,
    "cat of slices": lambda a: torch.cat([a[4:], a[:4]]) - 1,
    "broadcast of one element": lambda a: a + a[0],
    "row sums": lambda a: (a.view(4, 4) - a.view(4, 4).t().sum(0, keepdim=True)).reshape(16),
}


@pytest.mark.parametrize("name", list(_RELAYOUTS))
def test_new_value_reading_the_donated_input_elsewhere_is_not_aliased(name):
    a = torch.randn(16)
    lowered = pf.jit(_RELAYOUTS[name], donate_argnums=0, backend="eager").lower(a)
    (row,) = lowered.donation_report()
    assert not row["aliased"] and "other positions" in row["reason"]


def test_relayout_of_a_donated_input_is_right_under_inductor():
    fn = _RELAYOUTS["view.t.reshape"]
    a = torch.randn(16)
    expected = fn(a.clone())
    with pytest.warns(UserWarning, match="other positions than it would write them"):
        out = pf.jit(fn, donate_argnums=0, backend="inductor")(a.clone())
    torch.testing.assert_close(out, expected)


def test_optimizer_updates_still_donate_everything():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    params, apply = pf.functionalize(model)
    opt = pf.optim.chain(pf.optim.clip_by_global_norm(1.0), pf.optim.adamw(1e-2, weight_decay=0.1))

    def step(p, s, x, y):
        loss, g = pf.value_and_grad(lambda p: F.mse_loss(apply(p, x), y))(p)
        u, s = opt.update(g, s, p)
        return pf.optim.apply_updates(p, u), s, loss

    state = opt.init(params)
    lowered = pf.jit(step, donate_argnums=(0, 1), backend="eager").lower(
        params, state, torch.randn(5, 4), torch.randn(5, 2)
    )
    report = lowered.donation_report()
    assert report and all(row["aliased"] for row in report), [r for r in report if not r["aliased"]]


def test_bias_broadcast_over_rows_and_flat_buckets_still_donate():
    # The bias's gradient sums over the rows it was broadcast to; the bucket is split back where it was cat.
    def step(p, x):
        loss, g = pf.value_and_grad(lambda p: torch.relu(x @ p["w"] + p["b"]).square().mean())(p)
        flat = torch.cat([(p["w"] - 0.1 * g["w"]).reshape(-1), p["b"] - 0.1 * g["b"]])
        w, b = flat.split([p["w"].numel(), p["b"].numel()])
        return {"w": w.view(p["w"].shape), "b": b}, loss

    params = {"w": torch.randn(4, 6), "b": torch.randn(6)}
    x = torch.randn(5, 4)
    report = pf.jit(step, donate_argnums=0, backend="eager").lower(params, x).donation_report()
    assert all(row["aliased"] for row in report), report


def test_plain_tensor_placed_for_a_donated_argument_is_invalidated():
    def f(w, x):
        return w - 0.1 * x.mean(0), (x @ w).sum()

    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    w, x = torch.randn(3), torch.randn(4, 3)
    expected = f(w.clone(), x)
    with pf.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new_w, loss = pf.jit(f, in_shardings=(P(), P("dp")), donate_argnums=0, backend="eager")(w, x)
        torch.testing.assert_close(pf.device_get(new_w), expected[0])
        torch.testing.assert_close(pf.device_get(loss), expected[1])
    with pytest.raises(pf.DonationError, match="donated"):
        w + 1
