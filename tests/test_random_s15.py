"""Random draws that differed from eager torch / one device (session 15's hunt), each against the reference.

- A buffer filled in place after it is made (rrelu's noise) is never recomputed by remat (passes/remat.py).
- On split values (spmd/random_ops.py): `rand_like(generator=g)` draws from g; non-contiguous values draw in eager's
  memory order; `torch.dropout` / `torch.feature_dropout` are redrawn, other torch.* dropouts warn; values split
  in strides and pending sums (dropout after a row-parallel matmul) draw one device's mask.
- `pf.vmap(randomness="different")` over split examples draws one device's numbers (transforms.py).
- `torch.set_rng_state` and default generators' setters inside a step are refused (trace/capture.py).
- Fills with a user's generator trace (`exponential_`, ...) and compile with Inductor (`bernoulli_`).

The multi-rank checks run once on a 2-rank gloo world: ranks of a virtual mesh are threads sharing one global
generator, so their draws interleave and cannot be compared with one device's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from dist import run_world

import pt3func as pf
from pt3func import P
from pt3func._compat import FX_RECORDS_GENERATORS, TORCH_VERSION
from pt3func.errors import ImpureFunctionError


def _rrelu_block(w, x):
    return torch.cos(F.rrelu(torch.tanh(x @ w), training=True)).sum()


@pytest.mark.parametrize("remat", ["checkpoint", "memory_budget"])
def test_rrelu_noise_is_kept_not_recomputed_unfilled(remat):
    # rrelu_with_noise writes its noise into an empty_like buffer that its backward reads; recomputed, the buffer
    # was a fresh unfilled one (gradients of 1e29 or NaN).
    torch.manual_seed(0)
    w, x = torch.randn(8, 16) * 0.3, torch.randn(10, 8)
    torch.manual_seed(3)
    wr = w.clone().requires_grad_()
    want = torch.autograd.grad(_rrelu_block(wr, x), wr)[0]
    if remat == "checkpoint":
        step = pf.jit(pf.grad(pf.checkpoint(_rrelu_block)), backend="eager")
    else:
        step = pf.jit(pf.grad(_rrelu_block), backend="eager", memory_budget=0.0)
    torch.manual_seed(3)
    assert torch.allclose(step(w, x), want, atol=1e-6)


SAVED = torch.get_rng_state()


@pytest.mark.parametrize("reseed", [
    lambda: torch.set_rng_state(SAVED),
    lambda: torch.random.set_rng_state(SAVED),
    lambda: torch.default_generator.manual_seed(0),
    lambda: torch.default_generator.set_state(SAVED),
], ids=["torch.set_rng_state", "torch.random.set_rng_state", "default_generator.manual_seed",
        "default_generator.set_state"])
def test_setting_the_global_generator_in_a_step_is_refused(reseed):
    # Run once while tracing, not at each call: later calls drew other numbers than eager torch.
    def step(x):
        reseed()
        return x + torch.rand(3)

    torch.rand(1)  # the state now differs from SAVED: setting SAVED back is a change the trace can see
    before = torch.get_rng_state()
    with pytest.raises(ImpureFunctionError, match=r"test_random_s15\.py:\d+.*inside jitted '[^']*step'"):
        pf.jit(step, backend="eager")(torch.zeros(3))
    assert torch.equal(torch.get_rng_state(), before)  # the trace's reseeding is undone


def test_a_step_that_only_reads_the_generator_state_is_kept():
    torch.manual_seed(7)
    got = pf.jit(lambda x: x + torch.rand(3), backend="eager")(torch.zeros(3))
    torch.manual_seed(7)
    assert torch.equal(got, torch.rand(3))


FILLS = {
    "exponential_": lambda x, g: x * torch.empty_like(x).exponential_(2.0, generator=g),
    "geometric_": lambda x, g: x * torch.empty_like(x).geometric_(0.3, generator=g),
    "cauchy_": lambda x, g: x * torch.empty_like(x).cauchy_(sigma=0.5, generator=g),
    "log_normal_": lambda x, g: x * torch.empty_like(x.t()).log_normal_(generator=g).t(),
}


@pytest.mark.parametrize("name", FILLS)
def test_fills_with_a_generator_trace_and_draw_what_eager_draws(name):
    # Fake tensors refused them ("generator is not supported in refs").
    x = torch.randn(4, 3)
    eager = torch.Generator().manual_seed(3)
    want = FILLS[name](x, eager)
    g = torch.Generator().manual_seed(3)
    got = pf.jit(FILLS[name], backend="eager")(x, g)
    assert torch.equal(got, want)
    assert torch.equal(g.get_state(), eager.get_state())


@pytest.mark.skipif(not FX_RECORDS_GENERATORS, reason="torch 2.11's FX cannot record a Generator argument")
def test_bernoulli_with_a_generator_compiles_with_inductor():
    # Inductor's bernoulli_ lowering takes no generator (a LoweringException).
    def f(x, g):
        return x * torch.empty_like(x).bernoulli_(0.5, generator=g) + torch.empty_like(x).exponential_(generator=g)

    x = torch.randn(4, 3)
    want = f(x, torch.Generator().manual_seed(3))
    assert torch.equal(pf.jit(f)(x, torch.Generator().manual_seed(3)), want)


# ---------------------------------------------------------------- split values, on 2 gloo ranks

def _sharded(f, specs, *args, mesh=None):
    mesh = mesh or pf.make_mesh((2,), ("dp",))
    with pf.set_mesh(mesh):
        return pf.device_get(pf.jit(f, in_shardings=specs, backend="eager")(*args))


def _split_checks(rank: int, world: int) -> dict:
    out: dict = {}
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))

    # rand_like / randn_like with a generator: drawn from it, the global generator untouched.
    gen = torch.Generator()

    def noisy(x):
        return x + torch.randn_like(x, generator=gen) + torch.rand_like(x, generator=gen)

    if FX_RECORDS_GENERATORS:
        gen.manual_seed(9)
        torch.manual_seed(5)
        want, global_state = noisy(x), torch.get_rng_state()
        gen.manual_seed(9)
        torch.manual_seed(5)
        out["generator"] = (_sharded(noisy, (P("dp"),), x), want)
        out["generator_global_untouched"] = torch.equal(torch.get_rng_state(), global_state)

    # A non-contiguous split value: eager fills in its memory order (column by column for x.t()).
    def transposed(x):
        t = x.t()
        return F.dropout(t, 0.5) + torch.rand_like(t) + torch.empty_like(t).uniform_()

    torch.manual_seed(5)
    want = transposed(x)
    torch.manual_seed(5)
    out["transposed"] = (_sharded(transposed, (P("dp"),), x), want)

    # torch.dropout / torch.feature_dropout (what F.dropout / F.dropout2d call) are redrawn.
    def torch_dropouts(x):
        return torch.dropout(x, 0.5, True) + torch.feature_dropout(x.view(8, 6, 1), 0.5, train=True).view(8, 6)

    torch.manual_seed(5)
    want = torch_dropouts(x)
    torch.manual_seed(5)
    out["torch_dropouts"] = (_sharded(torch_dropouts, (P("dp"),), x), want)

    def uncovered(x):
        return torch.alpha_dropout(x, 0.5, True) + torch.native_dropout(x, 0.5, True)[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sharded(uncovered, (P("dp"),), x)
    out["uncovered_warnings"] = [str(w.message) for w in caught if "on a value split over the mesh" in str(w.message)]

    # A sequence split flattened into (batch * seq, d) is a _StridedShard: each rank keeps its rows of one draw.
    def flattened(x):
        h = x.reshape(16, 4)
        return F.dropout(h, 0.5) + torch.rand_like(h)

    if TORCH_VERSION >= (2, 13):  # 2.11's DTensor cannot flatten a split dim 1 (README, Known limits)
        ones = torch.ones(2, 8, 4)
        torch.manual_seed(5)
        want, state = flattened(ones), torch.get_rng_state()
        torch.manual_seed(5)
        out["strided"] = (_sharded(flattened, (P(None, "dp"),), ones), want)
        out["strided_state"] = torch.equal(torch.get_rng_state(), state)

    # Dropout of a row-parallel matmul's output (a pending sum): crashed in DTensor.
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g)

    def mlp(w1, w2, x):
        return F.dropout(torch.tanh(x @ w1) @ w2, 0.3).square().mean()

    step = pf.value_and_grad(mlp, argnums=(0, 1))
    torch.manual_seed(5)
    want = step(w1, w2, x)
    torch.manual_seed(5)
    tp = pf.make_mesh((2,), ("tp",))
    out["partial"] = (_sharded(step, (P(None, "tp"), P("tp", None), P()), w1, w2, x, mesh=tp), want)

    # vmap(randomness="different") over split examples, and its gradient.
    w = torch.randn(6, 6, generator=g)

    def per_example(w, x):
        def one(r):
            return (F.dropout(r @ w, 0.5) + torch.rand_like(r)).square().sum()

        return pf.vmap(one, randomness="different")(x).sum()

    step = pf.value_and_grad(per_example)
    torch.manual_seed(5)
    want, state = step(w, x), torch.get_rng_state()
    torch.manual_seed(5)
    out["vmap"] = (_sharded(step, (P(), P("dp")), w, x), want)
    out["vmap_state"] = torch.equal(torch.get_rng_state(), state)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_world(2, _split_checks)


def _close(got, want) -> bool:
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    return len(got) == len(want) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


@pytest.mark.parametrize("case", ["generator", "transposed", "torch_dropouts", "strided", "partial", "vmap"])
def test_split_values_draw_what_one_device_draws(ranks, case):
    if case == "generator" and not FX_RECORDS_GENERATORS:
        pytest.skip("torch 2.11's FX cannot record a Generator argument")
    if case == "strided" and TORCH_VERSION < (2, 13):
        pytest.skip("torch 2.11's DTensor cannot flatten a split dim 1")
    for rank, results in enumerate(ranks):
        got, want = results[case]
        assert _close(got, want), f"{case} rank {rank}"


def test_split_draws_advance_the_generators_as_one_device(ranks):
    for results in ranks:
        assert results.get("generator_global_untouched", not FX_RECORDS_GENERATORS)
        assert results.get("strided_state", TORCH_VERSION < (2, 13)) and results["vmap_state"]


def test_dropouts_not_redrawn_warn(ranks):
    for results in ranks:
        messages = results["uncovered_warnings"]
        assert any(m.startswith("torch.alpha_dropout on a value split") for m in messages), messages
        assert any(m.startswith("torch.native_dropout on a value split") for m in messages), messages
