"""shard_map on a virtual mesh (session 13): a train step's counters keep the step's signature, and specs that do
not fit say which specs and what they were matched against."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func import P


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def test_a_shard_map_train_step_traces_once(mesh):
    opt = pf.optim.adam(0.1)

    def local_step(p, s, x):
        g = pf.lax.pmean(pf.grad(lambda p: (p * x).sum())(p), "dp")
        u, s = opt.update(g, s, p)
        return p + u, s

    with pf.set_mesh(mesh):
        step = pf.jit(pf.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=(P(), P())))
        p = pf.device_put(torch.linspace(-1, 1, 4), P())
        s = opt.init(p)
        x = pf.device_put(torch.arange(16.0).reshape(4, 4), P("dp"))
        counts = []
        for _ in range(3):
            p, s = step(p, s, x)
            counts.append(step.trace_count())
    assert counts[0] == counts[-1], counts
    ref_p, ref_s = torch.linspace(-1, 1, 4), opt.init(torch.linspace(-1, 1, 4))
    for _ in range(3):
        g = torch.arange(16.0).reshape(4, 4).sum(0) / 2  # each rank's column sums of its rows, meaned over dp
        u, ref_s = opt.update(g, ref_s, ref_p)
        ref_p = ref_p + u
    torch.testing.assert_close(pf.device_get(p), ref_p)


@pytest.mark.parametrize(
    ("in_specs", "out_specs", "match"),
    [
        ((P("dp"),), P("dp"), r"in_specs \(P\('dp'\),\) is not a pytree prefix of the arguments, \(\(4, 6\), \(4,\)\)"),
        ((P("dp"), P()), (P("dp"), P()), r"out_specs \(P\('dp'\), P\(\)\) is not a pytree prefix of the output, "
         r"\(2, 6\)"),
    ],
)
def test_specs_that_do_not_fit_are_named(mesh, in_specs, out_specs, match):
    f = pf.shard_map(lambda a, b: a * 2, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=match):
        pf.jit(f)(torch.ones(4, 6), torch.ones(4))
