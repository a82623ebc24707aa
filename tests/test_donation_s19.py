"""Session 19: donations a mesh refused that one device took (a passed-through input, a plain input left None)."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func import P


@pytest.fixture
def strict():
    saved = pf.config.strict_donation
    pf.config.strict_donation = True
    yield
    pf.config.strict_donation = saved


def _step(a, b, x):
    return a - 0.1 * (x @ a).mean(), b, (x @ a).sum()  # b passes through unchanged (a GAN's other network)


def test_a_donated_input_passed_through_is_donated_on_a_mesh(strict):
    w, v, x = torch.randn(4, 3), torch.randn(5), torch.randn(8, 4)
    want = _step(w, v, x)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        step = pf.jit(_step, backend="eager", in_shardings=(P(), P(), P("dp")), donate_argnums=(0, 1))
        lowered = step.lower(w.clone(), v.clone(), x)
        assert all(row["aliased"] for row in lowered.donation_report()), lowered.donation_report()
        copies = [n for n in lowered.graph_module.graph.nodes if n.target is torch.ops.aten.copy_.default]
        assert len(copies) == 1  # a's new value into a's buffer; b is its own buffer already
        got = step(w.clone(), v.clone(), x)
    for g, e in zip(pf.device_get(got), want):
        torch.testing.assert_close(g, e)


def _update(w, x):
    return w - 0.1 * (x @ w).sum() * torch.ones_like(w), (x @ w).sum()


def test_a_plain_input_left_none_is_donated_as_p_is(strict):
    w, x = torch.randn(4, 3), torch.randn(8, 4)
    want = _update(w, x)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        # None keeps a plain tensor as it is: replicated, as P() places it; its output comes back replicated.
        step = pf.jit(_update, backend="eager", in_shardings=(None, P("dp")), donate_argnums=0)
        assert step.lower(w.clone(), x).donation_report()[0]["aliased"]
        got = step(w.clone(), x)
    for g, e in zip(pf.device_get(got), want):
        torch.testing.assert_close(g, e)
