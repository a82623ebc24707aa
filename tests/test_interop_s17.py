"""pt3func inside torch.compile (per-example gradients: pf.vmap of pf.grad), and optimizers with a low-precision
moment (`mu_dtype=torch.bfloat16`) giving the same numbers under every pf.jit backend as without pf.jit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import pt3func as pf


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    # Each test compiles pt3func's wrappers from scratch: frames cached by an earlier test would hide (or cause)
    # what a test looks at, and many tests' compiles of the same code would reach Dynamo's recompile limit.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _max_diff(a: Any, b: Any) -> float:
    la, lb = pf.tree.leaves(a), pf.tree.leaves(b)
    assert len(la) == len(lb)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(la, lb))


def _linear_problem() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(6, 3), "b": torch.zeros(3)}, torch.randn(10, 6), torch.randn(10, 3)


def _linear_loss(q: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(xi @ q["w"] + q["b"], yi)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_per_example_gradients_of_a_dict_of_params(backend):
    # Dynamo's stand-in for optree's treespec (made where it traced pf.vmap's flatten) reached the eagerly run vmap
    # after a graph break, and could not rebuild the dict: "TypeError: unhashable type: 'list'".
    p, x, y = _linear_problem()

    def per_example(p, x, y):
        return pf.vmap(pf.grad(_linear_loss), in_axes=(None, 0, 0))(p, x, y)

    want = torch.func.vmap(torch.func.grad(_linear_loss), in_dims=(None, 0, 0))(p, x, y)
    got = torch.compile(per_example, backend=backend)(p, x, y)
    assert set(got) == {"w", "b"}
    assert _max_diff(got, want) < 1e-6
    assert _max_diff(got, per_example(p, x, y)) < 1e-6


def test_compiled_per_example_gradients_after_a_graph_break_in_the_loss():
    # Dynamo's "eager" backend compiles frames inside a torch.func transform run eagerly: it failed to fake the
    # batched tensors of the loss's frame after its graph break ("AssertionError: False != True").
    p, x, y = _linear_problem()

    def loss(q, xi, yi):
        h = xi @ q["w"]
        torch._dynamo.graph_break()
        return F.mse_loss(h + q["b"], yi)

    def per_example(p, x, y):
        return pf.vmap(pf.grad(loss), in_axes=(None, 0, 0))(p, x, y)

    want = per_example(p, x, y)
    got = torch.compile(per_example, backend="eager")(p, x, y)
    assert _max_diff(got, want) < 1e-6


def _train_problem() -> tuple[Any, Callable[..., Any], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    params, apply = pf.functionalize(net)
    return params, apply, torch.randn(10, 6), torch.randn(10, 3)


def test_compiled_train_step_with_per_example_gradient_norms():
    # pf.value_and_grad's wrapper, compiled by Dynamo for the call outside pf.vmap, carried no guard on the functorch
    # transform stack: reused for pf.grad inside pf.vmap, it took the autograd path there ("You are attempting to
    # call Tensor.requires_grad_() ... inside of a function being transformed by a functorch transform").
    params, apply, x, y = _train_problem()
    opt = pf.optim.adamw(1e-2, weight_decay=0.1)

    def step(p, s, x, y):
        loss, g = pf.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))(p, x, y)
        per_example = pf.vmap(
            pf.grad(lambda p, xi, yi: F.mse_loss(apply(p, xi[None]), yi[None])), in_axes=(None, 0, 0)
        )(p, x, y)
        u, s = opt.update(g, s, p)
        return pf.optim.apply_updates(p, u), s, loss, pf.tree.map(lambda t: t.flatten(1).norm(dim=1), per_example)

    compiled = torch.compile(step, backend="aot_eager")
    rp, rs = pf.tree.map(torch.clone, params), opt.init(params)
    cp, cs = pf.tree.map(torch.clone, params), opt.init(params)
    for _ in range(2):
        rp, rs, rl, rn = step(rp, rs, x, y)
        cp, cs, cl, cn = compiled(cp, cs, x, y)
        assert abs(cl.item() - rl.item()) < 1e-6
        assert _max_diff(cp, rp) < 1e-6
        assert _max_diff(cn, rn) < 1e-5


def _run_optimizer(opt: Any, backend: str | None, steps: int = 5) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(64, generator=gen), "b": torch.randn(4, 8, generator=gen)}
    grads = [pf.tree.map(lambda t: torch.randn(t.shape, generator=gen), p) for _ in range(steps)]

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return pf.optim.apply_updates(p, u), s

    run = pf.jit(step, backend=backend) if backend else step
    s = opt.init(p)
    for g in grads:
        p, s = run(p, s, g)
    return p, s


@pytest.mark.parametrize("name", ["adam", "adamw", "lion"])
def test_bfloat16_moment_gives_the_same_numbers_under_every_backend(name):
    # Adam's update read the bfloat16 moment in bfloat16 (`m / bias_correction1` stays bfloat16 in eager: a 0-d
    # float32 tensor does not promote it) and Lion's moment was a sum of bfloat16 products; Inductor skipped those
    # intermediate roundings: 2e-4 off in the params after 6 steps, and one bfloat16 step off in the moment.
    make = {
        "adam": lambda: pf.optim.adam(1e-2, mu_dtype=torch.bfloat16),
        "adamw": lambda: pf.optim.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.bfloat16),
        "lion": lambda: pf.optim.lion(1e-2, mu_dtype=torch.bfloat16),
    }[name]
    results = {backend: _run_optimizer(make(), backend) for backend in (None, "eager", "inductor")}
    want_params, want_state = results[None]
    want_mu = [leaf for leaf in pf.tree.leaves(want_state) if leaf.dtype == torch.bfloat16]
    assert len(want_mu) == 2  # the moments stay bfloat16
    for backend in ("eager", "inductor"):
        params, state = results[backend]
        assert _max_diff(params, want_params) < 1e-6, backend
        mu = [leaf for leaf in pf.tree.leaves(state) if leaf.dtype == torch.bfloat16]
        assert len(mu) == 2, backend
        for got, want in zip(mu, want_mu):
            assert torch.equal(got, want), backend


def test_bfloat16_moment_adam_update_uses_the_unrounded_moment():
    # As optax: the moment is computed in float32 (the gradient's dtype), the update taken from it, and only what
    # is stored rounded to bfloat16.
    opt = pf.optim.adam(1e-1, b1=0.9, b2=0.999, eps=1e-8, mu_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    p = {"w": torch.randn(32, generator=gen, dtype=torch.float64).float()}
    grads = [torch.randn(32, generator=gen) for _ in range(3)]
    s = opt.init(p)
    m = torch.zeros(32, dtype=torch.bfloat16)
    v = torch.zeros(32)
    for t, g in enumerate(grads, start=1):
        u, s = opt.update({"w": g}, s, p)
        m_full = torch.lerp(m.float(), g, 0.1)
        v = v * 0.999 + 0.001 * g * g
        want = -0.1 * (m_full / (1 - 0.9**t)) / (v.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)
        torch.testing.assert_close(u["w"], want, rtol=1e-5, atol=1e-7)
        m = m_full.bfloat16()
        mu = s[0].mu["w"]
        assert mu.dtype == torch.bfloat16
        assert torch.equal(mu, m)


def test_lion_direction_with_a_wider_moment_is_taken_in_the_wider_dtype() -> None:
    """bf16 params with an fp32 moment: optax's sign((1 - b1) g + b1 m) in fp32; rounding m to bf16 first flipped
    the sign of near-cancelling sums (regression hunt, session 17)."""
    b1 = 0.9
    opt = pf.optim.scale_by_lion(b1=b1, b2=0.99, mu_dtype=torch.float32)
    g = torch.ones(1000, dtype=torch.bfloat16)
    m = -(1 - b1) / b1 * (1 + torch.linspace(-3e-3, 3e-3, 1000))
    state = opt.init({"w": torch.zeros(1000, dtype=torch.bfloat16)})._replace(mu={"w": m})
    directions, _ = opt.update({"w": g}, state)
    assert directions["w"].dtype == torch.bfloat16
    torch.testing.assert_close(directions["w"].float(), torch.sign((1 - b1) * g.float() + b1 * m), atol=0, rtol=0)
