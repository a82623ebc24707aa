"""Layers that never mix samples, in jitted steps: LSTM/GRU/RNN on CPU (traced through their plain kernels, oneDNN's
failed), and recurrent layers and group norm on batch-sharded inputs (each rank runs its own samples; DTensor has
no rule for the recurrent kernels' in-place transpose, and its group norm backward kept the global batch size),
equal to one device."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION

# torch 2.11's DTensor cannot flatten [T, B, ...] with B split (nn.Linear on a sequence-first input): README.
FLATTENS_SPLIT_DIM_1 = TORCH_VERSION >= (2, 13)

LAYERS = {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM, "rnn": torch.nn.RNN}


class _Net(torch.nn.Module):
    def __init__(self, kind: str, batch_first: bool, dropout: float = 0.0):
        super().__init__()
        self.rnn = LAYERS[kind](4, 6, num_layers=2, batch_first=batch_first, bidirectional=True, dropout=dropout)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x, hx=None):
        return self.head(self.rnn(x, hx)[0])


def _setup(kind: str, batch_first: bool, dropout: float = 0.0):
    torch.manual_seed(0)
    net = _Net(kind, batch_first, dropout)
    params, apply = pf.functionalize(net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 4, generator=g) if batch_first else torch.randn(5, 4, 4, generator=g)
    y = torch.randn(*x.shape[:2], 3, generator=g)

    def loss_fn(p, x, y):
        return (apply(p, x) - y).square().mean()

    return net, params, loss_fn, x, y


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_lstm_step_on_cpu_equals_torch_autograd(backend):
    net, params, loss_fn, x, y = _setup("lstm", batch_first=True)
    loss, grads = pf.jit(pf.value_and_grad(loss_fn), backend=backend)(params, x, y)
    want = (net(x) - y).square().mean()
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for name, p in net.named_parameters():
        got = grads
        for part in name.split("."):
            got = got[part]
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("kind", "batch_first", "backend"),
                         [("gru", True, "eager"),
                          pytest.param("lstm", False, "eager", marks=pytest.mark.skipif(
                              not FLATTENS_SPLIT_DIM_1, reason="torch 2.11: Linear of a [T, B] input split on B")),
                          ("rnn", True, "eager"),
                          ("lstm", True, "inductor")])
def test_batch_sharded_recurrent_layers_equal_one_device(kind, batch_first, backend):
    _, params, loss_fn, x, y = _setup(kind, batch_first)
    step = pf.jit(pf.value_and_grad(loss_fn), backend=backend)
    want_loss, want_grads = step(params, x, y)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    spec = P("dp") if batch_first else P(None, "dp")
    with pf.set_mesh(mesh):
        loss, grads = pf.device_get(step(pf.device_put(params, P()), pf.device_put(x, spec), pf.device_put(y, spec)))
    torch.testing.assert_close(loss, want_loss)
    for got, want in zip(pf.tree.leaves(grads), pf.tree.leaves(want_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_sharded_initial_state_is_used_as_given():
    _, params, _, x, y = _setup("gru", batch_first=True)
    _, apply = pf.functionalize(_Net("gru", True))
    h0 = torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(2))  # (layers x directions, batch, hidden)

    def loss_fn(p, x, h0, y):
        return (apply(p, x, h0) - y).square().mean()

    step = pf.jit(pf.value_and_grad(loss_fn, argnums=(0, 2)), backend="eager")
    want_loss, want_grads = step(params, x, h0, y)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        got_loss, got_grads = pf.device_get(step(pf.device_put(params, P()), pf.device_put(x, P("dp")),
                                                 pf.device_put(h0, P(None, "dp")), pf.device_put(y, P("dp"))))
    torch.testing.assert_close(got_loss, want_loss)
    torch.testing.assert_close(got_grads[1], want_grads[1])  # the initial state's gradient, row for row


def test_dropout_between_layers_is_not_run_per_rank():
    # Each rank would draw its own dropout mask: left to DTensor, which refuses the kernel (loud, not wrong).
    _, params, loss_fn, x, y = _setup("gru", batch_first=True, dropout=0.5)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    # (torch 2.11 stops earlier, at the head's flatten of the GRU's output: README, Known limits.)
    refused = "transpose_" if FLATTENS_SPLIT_DIM_1 else "transpose_|flatten multiple dimensions"
    with pf.set_mesh(mesh), pytest.raises(Exception, match=refused):
        pf.jit(pf.value_and_grad(loss_fn), backend="eager")(
            pf.device_put(params, P()), pf.device_put(x, P("dp")), pf.device_put(y, P("dp")))


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_group_norm_on_a_sharded_batch_equals_one_device(layout):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    params, apply = pf.functionalize(net)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)

    def loss_fn(p, x, y):
        return torch.nn.functional.cross_entropy(apply(p, x), y)

    step = pf.jit(pf.value_and_grad(loss_fn), backend="eager")
    want_loss, want_grads = step(params, x, y)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    specs = pf.tree.map(lambda t: P("dp") if layout == "fsdp" and t.shape[0] % 2 == 0 else P(), params)
    with pf.set_mesh(mesh):
        loss, grads = pf.device_get(step(pf.device_put(params, specs), pf.device_put(x, P("dp")),
                                         pf.device_put(y, P("dp"))))
    torch.testing.assert_close(loss, want_loss)
    for got, want in zip(pf.tree.leaves(grads), pf.tree.leaves(want_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["mean", "sum_weighted"])
def test_embedding_bags_on_a_sharded_batch_equal_one_device(mode):
    torch.manual_seed(0)
    params = {"table": torch.randn(20, 8), "head": torch.randn(8, 5)}
    g = torch.Generator().manual_seed(1)
    idx, y = torch.randint(0, 20, (4, 6), generator=g), torch.randint(0, 5, (4,), generator=g)
    weights = torch.rand(4, 6, generator=g)

    def loss_fn(p, idx, w, y):
        if mode == "mean":
            bags = torch.nn.functional.embedding_bag(idx, p["table"], mode="mean")
        else:
            bags = torch.nn.functional.embedding_bag(idx, p["table"], mode="sum", per_sample_weights=w)
        return torch.nn.functional.cross_entropy(bags @ p["head"], y)

    step = pf.jit(pf.value_and_grad(loss_fn), backend="eager")
    want_loss, want_grads = step(params, idx, weights, y)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        loss, grads = pf.device_get(step(pf.device_put(params, P()), *(pf.device_put(t, P("dp"))
                                                                        for t in (idx, weights, y))))
    torch.testing.assert_close(loss, want_loss)
    for k in params:
        torch.testing.assert_close(grads[k], want_grads[k], rtol=1e-4, atol=1e-6)
