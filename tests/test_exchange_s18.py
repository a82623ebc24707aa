"""Compressed exchange (session 18 fixes): complex gradients, a leaf reduced more than once in a step (micro-batches,
HSDP), HSDP's error-feedback state, top-k's donated residual, errors for rebuilt or mislaid exchange states."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func.passes import grad_exchange
from pt3func.sharding import P

C = pf.compress


def _complex_step_results(fmt):
    g = torch.Generator().manual_seed(0)
    params = {"c": torch.randn(8, 4, generator=g, dtype=torch.complex64), "w": torch.randn(4, 4, generator=g)}
    x = torch.randn(4, 8, generator=g)

    def loss(p, x):
        z = x.to(torch.complex64) @ p["c"]
        return z.abs().pow(2).mean() + (x[:, :4] @ p["w"]).pow(2).mean()

    def step(p, ex, x):
        return pf.grad(loss)(p, x), ex

    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        p = pf.device_put(params, P())
        ex = (fmt or C.bf16()).init(p)
        j = pf.jit(step, in_shardings=(P(), None, P("dp")), grad_exchange=fmt, backend="eager")
        grads, ex = j(p, ex, pf.device_put(x, P("dp")))
        return pf.device_get(grads), pf.device_get(ex.leaves)


@pytest.mark.parametrize("fmt,tol", [
    (C.bf16(), 1e-2), (C.fp16(), 1e-3), (C.int8(block=8), 2e-2), (C.int8(block=8, error_feedback=False), 2e-2),
    (C.int4(block=8), 0.2), (C.topk(1.0), 0.0), (C.topk(1.0, bucketed=True), 0.0),
])
def test_complex_gradients_keep_their_imaginary_part(fmt, tol):
    exact, _ = _complex_step_results(None)
    got, state = _complex_step_results(fmt)
    assert got["c"].dtype == torch.complex64
    assert exact["c"].imag.abs().max() > 0.1
    for name in ("c", "w"):
        err = (got[name] - exact[name]).abs().max()
        assert err <= tol * exact[name].abs().max() + 1e-6, (name, err)
    if state["c"].residual is not None:  # the error feedback of a complex leaf is its real view's
        assert tuple(state["c"].residual.shape) == (2, 8, 4, 2)


@pytest.mark.parametrize("axes", [("dp", "fsdp"), ("fsdp", "dp")])
def test_hsdp_error_feedback_state_fits_the_programs_first_reduction(axes):
    # On ("dp", "fsdp") DTensor all-reduces over dp first, then reduce-scatters over fsdp: the state was built for
    # a reduce-scatter (no server residual) and the step refused it.
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(32, 16, generator=g), "v": torch.randn(16, 8, generator=g)}
    x = torch.randn(8, 32, generator=g)

    def loss(p, x):
        return ((x @ p["w"]) @ p["v"]).pow(2).mean()

    def step(p, ex, x):
        return pf.grad(loss)(p, x), ex

    with pf.set_mesh(pf.make_mesh((2, 2), axes, virtual=True)):
        p = pf.device_put(params, P("fsdp"))
        xs = pf.device_put(x, P(axes))
        exact = pf.device_get(pf.jit(step, in_shardings=(P("fsdp"), None, P(axes)), backend="eager")(p, None, xs)[0])
        for fmt in (C.int8(block=16), C.int4(block=16)):
            ex = fmt.init(p, data_axes=("dp", "fsdp"))
            j = pf.jit(step, in_shardings=(P("fsdp"), None, P(axes)), grad_exchange=fmt, backend="eager")
            grads, ex = j(p, ex, xs)
            grads, ex = j(p, ex, xs)
            got = pf.device_get(grads)
            for name in params:
                assert (got[name] - exact[name]).abs().max() <= 0.2 * exact[name].abs().max()


def _two_grads_step():
    def loss(p, x):
        return (x @ p["w"]).tanh().pow(2).mean()

    def step(p, ex, x1, x2):
        g1, g2 = pf.grad(loss)(p, x1), pf.grad(loss)(p, x2)
        return pf.tree.map(lambda a, b: (a + b) / 2, g1, g2), ex

    return step


def test_every_reduction_of_a_leaf_reduced_twice_is_compressed_by_a_stateless_format():
    # Before, the second pf.grad call's reductions went as plain fp32 all-reduces.
    g = torch.Generator().manual_seed(2)
    w, x1, x2 = torch.randn(64, 64, generator=g), torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        p = pf.device_put({"w": w}, P())
        xs = pf.device_put((x1, x2), P("dp"))
        specs = (P(), None, P("dp"), P("dp"))
        exact = pf.device_get(pf.jit(_two_grads_step(), in_shardings=specs, backend="eager")(p, None, *xs)[0])
        for fmt in (C.bf16(), C.int8(error_feedback=False), C.topk(1.0, error_feedback=False)):
            j = pf.jit(_two_grads_step(), in_shardings=specs, grad_exchange=fmt, backend="eager")
            ex = fmt.init(p)
            assert "all_reduce" not in j.lower(p, ex, *xs).cost_analysis()["comm_bytes"], fmt
            got = pf.device_get(j(p, ex, *xs)[0])
            assert (got["w"] - exact["w"]).abs().max() <= 2e-2 * exact["w"].abs().max(), fmt


def test_a_stateful_format_warns_naming_the_leaf_it_reduces_again_uncompressed():
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        p = pf.device_put({"w": torch.randn(64, 64)}, P())
        xs = pf.device_put((torch.randn(8, 64), torch.randn(8, 64)), P("dp"))
        fmt = C.int8()
        j = pf.jit(_two_grads_step(), in_shardings=(P(), None, P("dp"), P("dp")), grad_exchange=fmt, backend="eager")
        with pytest.warns(UserWarning, match=r"p\['w'\] is reduced again .* uncompressed"):
            comm = j.lower(p, fmt.init(p), *xs).cost_analysis()["comm_bytes"]
    assert comm["all_reduce"] == 64 * 64 * 4  # the second reduction, exact; the first is int8's


@pytest.mark.parametrize("fmt", [C.topk(0.1), C.topk(0.1, bucketed=True), C.topk(0.1, momentum=0.9),
                                 C.chain(C.topk(0.1), C.bf16())])
def test_top_k_error_feedback_state_is_donated(fmt, monkeypatch):
    # Before, the residual was a scatter into v of values gathered from v: never donatable (DonationError under
    # strict_donation, a warning on every trace otherwise).
    monkeypatch.setattr(pf.config, "strict_donation", True)
    opt = C.with_state(pf.optim.sgd(0.1), fmt)

    def loss(p, x):
        return (x @ p["w"]).tanh().pow(2).mean() + (x @ p["b"]).pow(2).mean()

    def step(p, s, x):
        u, s = opt.update(pf.grad(loss)(p, x), s, p)
        return pf.optim.apply_updates(p, u), s

    g = torch.Generator().manual_seed(3)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        p = pf.device_put({"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}, P())
        s = opt.init(p)
        j = pf.jit(step, in_shardings=(P(), None, P("dp")), grad_exchange=fmt, backend="eager", donate_argnums=(0, 1))
        for _ in range(2):
            p, s = j(p, s, pf.device_put(torch.randn(8, 64, generator=g), P("dp")))
        residual = pf.device_get(s[1].leaves["w"].residual)
    assert residual.abs().sum() > 0


@pytest.mark.parametrize("wrap", [lambda o: pf.optim.MultiSteps(o, 2).gradient_transformation(),
                                  lambda o: pf.optim.apply_if_finite(o, 3)])
def test_optimizer_wrappers_around_with_state_pass_it_through(wrap):
    # The wrappers' selection between the new and the old inner state keeps a leaf both pass through (the
    # ExchangeState with_state returns) as that object, so the exchange finds its state again.
    fmt = C.int8()
    opt = wrap(C.with_state(pf.optim.sgd(0.1), fmt))

    def step(p, s, x):
        u, s = opt.update(pf.grad(lambda p, x: (x @ p["w"]).pow(2).mean())(p, x), s, p)
        return pf.optim.apply_updates(p, u), s

    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        p = pf.device_put({"w": torch.randn(16, 16)}, P())
        s = opt.init(p)
        j = pf.jit(step, in_shardings=(P(), None, P("dp")), grad_exchange=fmt, backend="eager")
        for _ in range(2):
            p, s = j(p, s, torch.randn(8, 16))
        states = [leaf for leaf in pf.tree.leaves(s, is_leaf=lambda x: isinstance(x, C.ExchangeState))
                  if isinstance(leaf, C.ExchangeState)]
        assert len(states) == 1 and pf.device_get(states[0].leaves["w"].residual).abs().sum() > 0


def test_a_wrapper_rebuilding_the_exchange_state_is_named_in_the_error():
    fmt = C.int8()
    inner = C.with_state(pf.optim.sgd(0.1), fmt)

    def update(g, s, p=None):
        u, s = inner.update(g, s, p)
        return u, pf.tree.map(lambda t: t.clone(), s)  # a wrapper that makes new state tensors

    opt = pf.optim.GradientTransformation(inner.init, update)

    def step(p, s, x):
        u, s = opt.update(pf.grad(lambda p, x: (x @ p["w"]).pow(2).mean())(p, x), s, p)
        return pf.optim.apply_updates(p, u), s

    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        p = pf.device_put({"w": torch.randn(16, 16)}, P())
        j = pf.jit(step, in_shardings=(P(), None, P("dp")), grad_exchange=fmt, backend="eager")
        match = "optimizer wrapper .* rebuilt it.* with_state outermost"
        with pytest.raises(grad_exchange.GradExchangeError, match=match):
            j.lower(p, opt.init(p), torch.randn(8, 16))
