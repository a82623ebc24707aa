"""shard_map and pf.lax on a virtual mesh (session 18): plain tensors meet shard_map outputs as replicated values,
sums count bools, collectives take pytrees, a split out spec never reaches a 0-d output, pf.vmap over a shard_map
is refused, and errors and as_text() name the collective."""

from __future__ import annotations

import re

import pytest
import torch

import pt3func as pf
from pt3func import P


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _run(mesh, f, in_specs, out_specs, *args):
    sm = pf.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with pf.set_mesh(mesh):
        out = pf.jit(sm, backend="eager")(*[pf.device_put(a, P()) for a in args])
        return pf.tree.map(pf.device_get, out)


def test_plain_tensors_meet_a_shard_map_output_as_replicated(mesh):
    # Every argument plain: the step was traced without implicit replication and the add failed inside DTensor.
    sm = pf.shard_map(lambda a: pf.lax.psum(a, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    x, y = torch.arange(8.0).reshape(4, 2), torch.ones(2, 2)
    expected = x.view(2, 2, 2).sum(0) + 1
    with pf.set_mesh(mesh):
        for f, args in [(lambda x, y: sm(x) + y, (x, y)),  # a plain argument
                        (lambda x: sm(x) + y, (x,)),  # a closure tensor
                        (lambda x: sm(x) + torch.ones(2, 2), (x,))]:  # a tensor the step makes
            assert torch.equal(pf.device_get(pf.jit(f, backend="eager")(*args)), expected)


def test_a_plain_step_traces_the_same_program_under_a_mesh(mesh):
    # Tracing with a current mesh now enters the sharded-tracing overrides: a plain step's ops must not change.
    def step(w, x):
        h = torch.nn.functional.embedding(torch.tensor([0, 1, 2]), w) + x
        return torch.nn.functional.cross_entropy(h, torch.zeros(3, dtype=torch.long)) + h.cumsum(-1).sum()

    args = (torch.randn(4, 2), torch.randn(3, 2))
    jitted = pf.jit(pf.value_and_grad(step), backend="eager")

    def ops(text):  # the virtual mesh's rank threads see other source lines: compare the ops only
        return [re.sub(r"\s+#.*$", "", line) for line in text.splitlines()]

    plain = jitted.lower(*args).as_text()
    with pf.set_mesh(mesh):
        assert ops(jitted.lower(*args).as_text()) == ops(plain)


def test_sums_count_bools(mesh):
    flags = torch.tensor([True, True, True, False])  # rank 0: [T, T], rank 1: [T, F]

    def local(f):
        return pf.lax.psum(f, "dp"), pf.lax.pmean(f, "dp"), pf.lax.psum_scatter(f, "dp")

    s, m, scattered = _run(mesh, local, P("dp"), (P(), P(), P("dp")), flags)
    assert s.dtype == torch.int32 and s.tolist() == [2, 1]
    assert m.tolist() == [1.0, 0.5]
    assert scattered.tolist() == [2, 1]


def test_collectives_take_pytrees(mesh):
    x = torch.arange(4.0)  # rank 0: [0, 1], rank 1: [2, 3]

    def local(a):
        s = pf.lax.psum((a, 2 * a), "dp")
        m = pf.lax.pmean({"a": a}, "dp")
        (g,) = pf.lax.all_gather((a,), "dp")
        return s, m, g

    (s0, s1), m, g = _run(mesh, local, P("dp"), P(), x)
    assert s0.tolist() == [2.0, 4.0] and s1.tolist() == [4.0, 8.0]
    assert m["a"].tolist() == [1.0, 2.0]
    assert g.tolist() == x.tolist()


def test_psum_of_axis_index_is_a_real_sum(mesh):
    # axis_index is this rank's Python int: psum of a number was `number * axis_size` (0 and 2, not 1 and 1).
    out = _run(mesh, lambda a: a * 0 + pf.lax.psum(pf.lax.axis_index("dp"), "dp"), P("dp"), P("dp"), torch.zeros(4))
    assert out.tolist() == [1.0] * 4


def test_a_split_out_spec_prefix_refuses_a_0d_output(mesh):
    # Given as a prefix, P("dp") took the per-rank 0-d loss as replicated: rank 0's value won.
    x = torch.arange(8.0).reshape(4, 2)
    with pytest.raises(pf.ShardingError, match=r"out_specs at \[1\]: spec P\('dp'\).*shape \(\)"):
        _run(mesh, lambda a: (a * 2, (a**2).sum()), P("dp"), P("dp"), x)


def test_vmap_over_a_shard_map_is_refused_clearly(mesh):
    sm = pf.shard_map(lambda a: pf.lax.psum(a, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match=r"pf.shard_map\(pf.vmap\(f\)"):
        pf.jit(pf.vmap(sm), backend="eager")(pf.device_put(torch.randn(3, 4, 2), P()))


def test_errors_and_as_text_name_the_collective(mesh):
    with pytest.raises(pf.ShardingError, match=r"all_gather\(tiled=True\) of a 0-d value.*tiled=False"):
        _run(mesh, lambda a: pf.lax.all_gather(a.sum(), "dp"), P("dp"), P(), torch.ones(4))
    with pytest.raises(pf.ShardingError, match=r"all_gather: dim 3 is out of range"):
        _run(mesh, lambda a: pf.lax.all_gather(a, "dp", axis=3), P("dp"), P(), torch.ones(4))
    with pytest.raises(pf.ShardingError, match=r"shard_map out_specs: .*'tp'.*block has shape \(2,\)"):
        _run(mesh, lambda a: a, P("dp"), P("tp"), torch.ones(4))
    sm = pf.shard_map(lambda a: pf.lax.psum(a, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    with pf.set_mesh(mesh):
        text = pf.jit(sm, backend="eager").lower(pf.device_put(torch.ones(4), P())).as_text()
    assert re.search(r"COLLECTIVE all_reduce over 'dp'.*: pf\.lax\.psum", text), text
