"""pf.lax collectives and shard_map: values and gradients against unsharded references on gloo worlds."""

from __future__ import annotations

import pytest
import torch
from dist import run_world
from torch.distributed.tensor import DTensor, Shard

import pt3func as pf
from pt3func.sharding import NamedSharding, P, device_put, make_mesh
from pt3func.spmd import lax, shard_map
from pt3func.spmd.collectives import bind_axes


def _check(name: str, mesh, f, in_specs, out_specs, reference, *shapes, seed: int = 0) -> None:
    """shard_map(f) on full inputs of `shapes` equals `reference` in value and in the grads of a random
    linear loss of its output."""
    torch.manual_seed(seed)
    inputs = [torch.randn(*shape, dtype=torch.float64) for shape in shapes]
    sharded = [x.clone().requires_grad_() for x in inputs]
    plain = [x.clone().requires_grad_() for x in inputs]
    out = shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*sharded)
    want = reference(*plain)
    got = out.full_tensor()
    assert got.shape == want.shape and torch.allclose(got, want), f"{name}: value\n{got}\n!=\n{want}"
    weights = torch.randn(want.shape, dtype=torch.float64)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for i, (a, b) in enumerate(zip(sharded, plain)):
        assert torch.allclose(a.grad, b.grad), f"{name}: grad of input {i}\n{a.grad}\n!=\n{b.grad}"


def _collectives_world(rank: int, n: int) -> None:
    mesh = make_mesh((n,), ("i",))
    k, d = 2, 3

    _check("psum", mesh, lambda a: lax.psum(a, "i"), P("i"), P(),
           lambda x: x.view(n, k, d).sum(0), (n * k, d))
    _check("pmean", mesh, lambda a: lax.pmean(a, "i"), P("i"), P(),
           lambda x: x.view(n, k, d).mean(0), (n * k, d))
    # A replicated input feeding a per-rank computation, and one used only after the psum.
    _check("psum of replicated x sharded w", mesh, lambda x, w: lax.psum(x * w, "i") + x, (P(), P("i")), P(),
           lambda x, w: (x * w).sum(0, keepdim=True) + x, (1, d), (n, d))
    _check("replicated in and out", mesh, lambda x: 2 * x, P(), P(), lambda x: 2 * x, (k, d))
    _check("all_gather", mesh, lambda a: lax.all_gather(a, "i"), P("i"), P(), lambda x: x, (n * k, d))
    _check("all_gather axis=1", mesh, lambda a: lax.all_gather(a, "i", axis=1), P(None, "i"), P(),
           lambda x: x, (k, n * d))
    _check("all_gather untiled", mesh, lambda a: lax.all_gather(a, "i", axis=1, tiled=False), P("i"), P(),
           lambda x: x.view(n, k, d).transpose(0, 1), (n * k, d))
    _check("psum_scatter", mesh, lambda a: lax.psum_scatter(a, "i"), P("i"), P("i"),
           lambda x: x.view(n, n * k, d).sum(0), (n * n * k, d))
    _check("psum_scatter dim 1", mesh, lambda a: lax.psum_scatter(a, "i", scatter_dimension=1), P("i"),
           P(None, "i"), lambda x: x.view(n, k, n * d).sum(0), (n * k, n * d))
    _check("psum_scatter untiled", mesh, lambda a: lax.psum_scatter(a, "i", tiled=False), P("i"), P("i"),
           lambda x: x.view(n, n, d).sum(0).reshape(n * d), (n * n, d))
    _check("all_to_all rows to columns", mesh, lambda a: lax.all_to_all(a, "i", 1, 0), P("i"), P(None, "i"),
           lambda x: x, (n * k, n * d))
    _check("all_to_all 3-d", mesh, lambda a: lax.all_to_all(a, "i", 2, 1), P("i"), P("i"),
           lambda x: x.view(n, k, n, d).permute(2, 0, 1, 3).reshape(n, n * k, d), (n, k, n * d))
    _check("all_to_all untiled", mesh, lambda a: lax.all_to_all(a, "i", 0, 0, tiled=False), P("i"), P("i"),
           lambda x: x.view(n, n, d).transpose(0, 1).reshape(n * n, d), (n * n, d))
    ring = [(j, (j + 1) % n) for j in range(n)]
    _check("ppermute ring", mesh, lambda a: lax.ppermute(a, "i", ring), P("i"), P("i"),
           lambda x: torch.roll(x.view(n, k, d), 1, 0).reshape(n * k, d), (n * k, d))
    _check("ppermute partial", mesh, lambda a: lax.ppermute(a, "i", [(0, n - 1)]), P("i"), P("i"),
           lambda x: torch.cat([torch.zeros((n - 1) * k, d, dtype=x.dtype), x[:k]]), (n * k, d))
    _check("axis_index and axis_size", mesh, lambda a: a * lax.axis_index("i") + lax.axis_size("i"), P("i"),
           P("i"), lambda x: x * torch.arange(n, dtype=x.dtype).repeat_interleave(k)[:, None] + n, (n * k, d))

    # torch.func.grad through a collective (on local blocks, axes bound by hand).
    with bind_axes(mesh):
        assert lax.psum(1, "i") == n
        local = torch.full((2,), float(rank + 1))
        g = torch.func.grad(lambda a: (lax.psum(a, "i") ** 2).sum())(local)
    total = n * (n + 1) / 2
    assert torch.allclose(g, torch.full((2,), 2 * total * n)), g  # psum's transpose is psum (unreduced ct)

    with pytest.raises(pf.ShardingError, match="not bound"):
        lax.psum(torch.ones(1), "i")
    with pytest.raises(pf.ShardingError, match="unknown mesh axis 'j'"):
        shard_map(lambda a: lax.psum(a, "j"), mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(1))
    with pytest.raises(pf.ShardingError, match=r"psum_scatter: dim 0 of shape \(3,\) is not divisible"):
        shard_map(lambda a: lax.psum_scatter(a, "i"), mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(3))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_unsharded(world_size):
    run_world(world_size, _collectives_world)


def _tuple_axes_world(rank: int, n: int) -> None:
    mesh = make_mesh((2, 2), ("dp", "tp"))
    k, d = 2, 3
    both = ("dp", "tp")
    _check("psum over both", mesh, lambda a: lax.psum(a, both), P(both), P(),
           lambda x: x.view(4, k, d).sum(0), (4 * k, d))
    _check("psum over both, any order", mesh, lambda a: lax.psum(a, ("tp", "dp")), P(both), P(),
           lambda x: x.view(4, k, d).sum(0), (4 * k, d))
    _check("psum over tp only", mesh, lambda a: lax.psum(a, "tp"), P("dp", "tp"), P("dp"),
           lambda x: x.view(2 * k, 2, d).sum(1), (2 * k, 2 * d))
    _check("all_gather over both", mesh, lambda a: lax.all_gather(a, both), P(both), P(), lambda x: x, (4 * k, d))
    _check("all_gather over dp on a 2-d spec", mesh, lambda a: lax.all_gather(a, "dp"), P("dp", "tp"),
           P(None, "tp"), lambda x: x, (2 * k, 2 * d))
    _check("psum_scatter over both", mesh, lambda a: lax.psum_scatter(a, both), P(both), P(both),
           lambda x: x.view(4, 4 * k, d).sum(0), (16 * k, d))
    _check("all_to_all over both", mesh, lambda a: lax.all_to_all(a, both, 1, 0), P(both), P(None, both),
           lambda x: x, (4 * k, 4 * d))
    shift = [(j, (j + 1) % 4) for j in range(4)]
    _check("ppermute over both", mesh, lambda a: lax.ppermute(a, both, shift), P(both), P(both),
           lambda x: torch.roll(x.view(4, k, d), 1, 0).reshape(4 * k, d), (4 * k, d))
    _check("axis_index over both", mesh, lambda a: a + lax.axis_index(both) + 10 * lax.axis_size("tp"), P(both),
           P(both), lambda x: x + torch.arange(4, dtype=x.dtype).repeat_interleave(k)[:, None] + 20, (4 * k, d))
    with pytest.raises(pf.ShardingError, match=r"must be listed in mesh order \('dp', 'tp'\)"):
        shard_map(lambda a: lax.all_gather(a, ("tp", "dp")), mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(4))


@pytest.mark.slow
def test_collectives_over_tuple_axes_on_2x2():
    run_world(4, _tuple_axes_world)


def _mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def _tp_mlp_world(rank: int, n: int, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """Megatron MLP by hand: column-parallel W1, row-parallel W2, one psum; equal to the unsharded MLP."""
    mesh = make_mesh(shape, names)
    dp = "dp" if "dp" in names else None
    torch.manual_seed(0)
    x, w1, w2 = (torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64),
                 torch.randn(16, 4, dtype=torch.float64))

    def local_mlp(x, w1, w2):
        return lax.psum(_mlp(x, w1, w2), "tp")

    tp_mlp = shard_map(local_mlp, mesh=mesh, in_specs=(P(dp), P(None, "tp"), P("tp", None)), out_specs=P(dp))
    # Parameters as DTensors (device_put), data as a plain tensor (split by in_specs).
    params = device_put({"w1": w1, "w2": w2}, {"w1": NamedSharding(mesh, P(None, "tp")),
                                               "w2": NamedSharding(mesh, P("tp", None))})
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    xs = x.clone().requires_grad_()
    out = tp_mlp(xs, params["w1"], params["w2"])
    assert isinstance(out, DTensor) and out.placements[0] == (Shard(0) if dp else out.placements[0])
    loss = (out.full_tensor() ** 2).mean()
    loss.backward()

    ref = [t.clone().requires_grad_() for t in (x, w1, w2)]
    ref_loss = (_mlp(*ref) ** 2).mean()
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss)
    assert torch.allclose(xs.grad, ref[0].grad)
    assert params["w1"].grad.placements == params["w1"].placements
    assert torch.allclose(params["w1"].grad.full_tensor(), ref[1].grad)
    assert torch.allclose(params["w2"].grad.full_tensor(), ref[2].grad)


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "names"), [((2,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_tensor_parallel_mlp_matches_unsharded(shape, names):
    run_world(int(torch.tensor(shape).prod()), _tp_mlp_world, shape, names)


def _trace_world(rank: int, n: int) -> str:
    from torch.fx.experimental.proxy_tensor import make_fx

    mesh = make_mesh((n,), ("dp",))
    summed = shard_map(lambda a, w: lax.psum((a @ w).sum(), "dp"), mesh=mesh, in_specs=(P("dp"), P()),
                       out_specs=P())

    def step(x_local, w_local):
        # Local tensors in, wrapped inside: a DTensor given to make_fx as an input traces wrongly.
        x = DTensor.from_local(x_local, mesh.device_mesh, [Shard(0)], run_check=False)
        w = DTensor.from_local(w_local, mesh.device_mesh, [Shard(0)], run_check=False).redistribute(
            mesh.device_mesh, [Shard(0)])
        w = w.detach().requires_grad_()
        loss = summed(x, w.full_tensor())
        (grad,) = torch.autograd.grad(loss.to_local(), [w])
        return loss.to_local(), grad.to_local()

    x_local, w_local = torch.randn(2, 4), torch.randn(4 // n, 3)
    graph = make_fx(step, tracing_mode="fake")(x_local, w_local)
    return graph.code


@pytest.mark.slow
def test_shard_map_traces_to_explicit_collectives():
    code = run_world(2, _trace_world)[0]
    assert "_c10d_functional.all_reduce" in code and "_c10d_functional.wait_tensor" in code


def _mesh_3d_world(rank: int, n: int) -> None:
    """Non-adjacent axes of a 3-d mesh flatten into groups of their own."""
    mesh = make_mesh((2, 2, 2), ("a", "b", "c"))
    a, b, c = rank // 4, rank // 2 % 2, rank % 2
    assert (mesh.axis_index("a"), mesh.axis_index("b"), mesh.axis_index("c")) == (a, b, c)
    assert mesh.axis_index(("a", "c")) == 2 * a + c
    _check("psum over a, c", mesh, lambda x: lax.psum(x, ("a", "c")), P(("a", "c")), P(),
           lambda x: x.view(4, 2, 3).sum(0), (8, 3))
    _check("all_gather over a, c", mesh, lambda x: lax.all_gather(x, ("a", "c"), axis=1), P(None, ("a", "c")), P(),
           lambda x: x, (2, 8))


@pytest.mark.slow
def test_non_adjacent_axes_on_2x2x2():
    run_world(8, _mesh_3d_world)
