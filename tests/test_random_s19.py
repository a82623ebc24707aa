"""Session 19: draws whose numbers depend on their input's values (multinomial, bernoulli(p), poisson) on split
values draw what one device draws: the input is gathered whole, drawn over, and each rank keeps its block.
Before, every rank drew its block alone (ranks seeded alike drew the same numbers), so a policy-gradient step's
actions differed from one device's, with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist import run_world

import pt3func as pf
from pt3func import P


def _draws(logits, rates):
    probs = logits.softmax(-1)
    actions = torch.multinomial(probs, 3, replacement=True)
    dist = torch.distributions.Categorical(logits=logits, validate_args=False)
    sampled = dist.sample()
    coins = torch.bernoulli(probs)
    counts = torch.poisson(rates)
    return actions, sampled, coins, counts, (dist.log_prob(sampled) * counts[:, 0]).sum()


def _inputs():
    torch.manual_seed(1)
    return torch.randn(8, 6), torch.rand(8, 3) * 4


def _single():
    logits, rates = _inputs()
    torch.manual_seed(7)
    return pf.jit(_draws, backend="eager")(logits, rates)


@pytest.mark.parametrize("shape,names,specs", [
    ((2,), ("dp",), (P("dp"), P("dp"))),
    ((2, 2), ("dp", "tp"), (P("dp", "tp"), P("dp"))),  # probabilities split over the categories too
])
def test_value_dependent_draws_on_a_virtual_mesh_equal_one_device(shape, names, specs):
    want = _single()
    logits, rates = _inputs()
    mesh = pf.make_mesh(shape, names, virtual=True)
    with pf.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not redrawn" warning left
        torch.manual_seed(7)
        got = pf.device_get(pf.jit(_draws, in_shardings=specs, backend="eager")(logits, rates))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _on_ranks(rank: int, world: int) -> list:
    mesh = pf.make_mesh((world,), ("dp",))
    logits, rates = _inputs()
    with pf.set_mesh(mesh):
        torch.manual_seed(7)
        out = pf.jit(_draws, in_shardings=(P("dp"), P("dp")), backend="eager")(logits, rates)
        return [t.tolist() for t in pf.device_get(out)]


@pytest.mark.slow
def test_value_dependent_draws_on_two_ranks_equal_one_device():
    want = _single()
    for rank, got in enumerate(run_world(2, _on_ranks)):
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g, dtype=w.dtype), w, msg=f"rank {rank}")
