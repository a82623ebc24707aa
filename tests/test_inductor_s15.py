"""Inductor programs pt3func compiles: workarounds for Inductor bugs found in session 15 (each against eager)."""

from __future__ import annotations

import torch

import pt3func as pf
from pt3func.runtime.backend import reuse_buffers


def _message_passing_loss(p: dict, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    src, dst = edges
    for layer in ("l1", "l2"):
        q = p[layer]
        m = torch.relu(torch.cat([h[src], h[src]], -1) @ q["mw"])
        agg = h.new_zeros(h.shape).scatter_reduce(0, dst[:, None].expand(-1, h.shape[1]), m, "amax",
                                                  include_self=False)
        h = torch.cat([h, agg], -1) @ q["uw"]
    return h.square().sum()


def test_scatter_amax_into_a_cat_has_eager_gradients_under_inductor() -> None:
    torch.manual_seed(0)
    n, e, d = 12, 40, 8
    h = torch.randn(n, d)
    edges = torch.randint(0, n, (2, e))
    p = {f"l{i}": {"mw": torch.randn(2 * d, d) * 0.3, "uw": torch.randn(2 * d, d) * 0.3} for i in (1, 2)}
    want = pf.grad(_message_passing_loss)(p, h, edges)
    step = pf.jit(pf.grad(_message_passing_loss))
    got = step(p, h, edges)
    for a, b in zip(pf.tree.leaves(want), pf.tree.leaves(got)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert not reuse_buffers(step.lower(p, h, edges).graph_module)


def test_buffer_reuse_stays_on_without_reducing_scatters() -> None:
    step = pf.jit(pf.grad(lambda w, x: (x @ w).tanh().sum()))
    assert reuse_buffers(step.lower(torch.randn(4, 4), torch.randn(2, 4)).graph_module)
