"""Compressed exchange (session 15 fixes): a skipped non-finite step keeps the state on every rank of a 2-D mesh
and when the NaN reaches only an uncompressed leaf; gradients of values computed in the step; argnums=(0, 1)
with one argument's gradients reduced."""

from __future__ import annotations

import pytest
import torch

import pt3func as pf
from pt3func.passes import grad_exchange
from pt3func.sharding import P

C = pf.compress


def _batch(t: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return [torch.randn(*s, generator=g) for s in shapes]


def _with_nan(batch: list[torch.Tensor], which: int) -> list[torch.Tensor]:
    batch = [b.clone() for b in batch]
    batch[which][0, 0] = float("nan")
    return batch


def test_skipped_step_on_a_2d_mesh_keeps_the_state_on_every_rank():
    # The NaN reaches only tp rank 0's shard of w's gradient (reduced over dp alone): before, the tp=1 ranks
    # consumed their residuals while the optimizer skipped, so the replicated v drifted apart across tp.
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 4) * 0.4, "v": torch.randn(6, 4) * 0.4}
    specs = {"w": P(None, "tp"), "v": P()}

    def lf(p, x, y):
        return ((x @ p["w"] - y) ** 2).mean() + ((x @ p["v"] - y.nan_to_num(0.5)) ** 2).mean()

    fmt = C.int8(block=4)
    opt = C.with_state(pf.optim.apply_if_finite(pf.optim.sgd(0.1), 3), fmt, "dp")

    def step(p, s, x, y):
        u, s = opt.update(pf.grad(lf)(p, x, y), s, p)
        return pf.optim.apply_updates(p, u), s

    clean = [_batch(t, (4, 6), (4, 4)) for t in range(3)]
    with pf.set_mesh(pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)):
        j = pf.jit(step, in_shardings=(specs, None, P("dp"), P("dp")), grad_exchange=fmt, backend="eager")

        def run(batches):
            p = pf.device_put(params, specs)
            s = opt.init(p)
            for b in batches:
                p, s = j(p, s, *b)
            v_replicas = [r._local_tensor.clone() for r in p["v"].locals]
            return v_replicas, pf.device_get({"p": p, "ex": s[1].leaves, "nf": s[0].total_notfinite})

        replicas, skipped = run(clean[:1] + [_with_nan(_batch(9, (4, 6), (4, 4)), 1)] + clean[1:])
        _, reference = run(clean)
    assert int(skipped["nf"]) == 1
    for r in replicas[1:]:
        torch.testing.assert_close(r, replicas[0], rtol=0, atol=0)
    # The skipped step changes nothing: parameters and every rank's residuals equal the run without it.
    for a, b in zip(pf.tree.leaves(skipped["p"]), pf.tree.leaves(reference["p"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(pf.tree.leaves(skipped["ex"]), pf.tree.leaves(reference["ex"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_skipped_step_whose_nan_reaches_only_an_uncompressed_leaf_keeps_the_state():
    # skip_small leaves "small" uncompressed; its NaN alone makes apply_if_finite skip, so big's residual stays.
    torch.manual_seed(0)
    params = {"big": torch.randn(8, 8) * 0.4, "small": torch.zeros(8)}
    specs = {k: P() for k in params}

    def lf(p, x, y, z):
        return ((x @ p["big"] - y) ** 2).mean() + ((p["small"] - z) ** 2).mean()

    fmt = C.skip_small(C.int8(block=8), min_numel=16)
    opt = C.with_state(pf.optim.apply_if_finite(pf.optim.sgd(0.1), 3), fmt)

    def step(p, s, x, y, z):
        u, s = opt.update(pf.grad(lf)(p, x, y, z), s, p)
        return pf.optim.apply_updates(p, u), s

    clean = [_batch(t, (4, 8), (4, 8), (4, 8)) for t in range(3)]
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        j = pf.jit(step, in_shardings=(specs, None, P("dp"), P("dp"), P("dp")), grad_exchange=fmt,
                   backend="eager")

        def run(batches):
            p = pf.device_put(params, specs)
            s = opt.init(p)
            for b in batches:
                p, s = j(p, s, *b)
            return pf.device_get({"p": p, "res": s[1].leaves["big"].residual, "nf": s[0].total_notfinite})

        skipped = run(clean[:2] + [_with_nan(_batch(9, (4, 8), (4, 8), (4, 8)), 2)] + clean[2:])
        reference = run(clean)
    assert int(skipped["nf"]) == 1
    assert float(reference["res"].abs().max()) > 0  # the residual is in use: keeping it is a real check
    torch.testing.assert_close(skipped["res"], reference["res"], rtol=0, atol=0)
    for a, b in zip(pf.tree.leaves(skipped["p"]), pf.tree.leaves(reference["p"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _computed_leaves_step():
    params = {"w1": torch.randn(8, 6), "w2": torch.randn(6, 3)}

    def lf(p, x, y):
        return ((torch.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    def step(params, ex, x, y):
        p64 = pf.tree.map(lambda t: t.double(), params)  # the gradients are of values computed in the step
        return pf.grad(lambda p: lf(p, x.double(), y.double()))(p64), ex

    return params, lf, step


def _run_computed_leaves_step(fmt, lower: bool = False):
    """The step of `_computed_leaves_step` on a dp=2 virtual mesh with `fmt`: (params, lf, x, y, grads, text)."""
    torch.manual_seed(0)
    params, lf, step = _computed_leaves_step()
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    specs = {k: P() for k in params}
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        dp = pf.device_put(params, specs)
        j = pf.jit(step, in_shardings=(specs, None, P("dp"), P("dp")), grad_exchange=fmt, backend="eager")
        text = j.lower(dp, fmt.init(dp), x, y).as_text() if lower else None
        grads, _ = j(dp, fmt.init(dp), x, y)
        return params, lf, x, y, pf.device_get(grads), text


def test_gradients_of_values_computed_in_the_step_are_each_compressed_by_a_stateless_format():
    params, lf, x, y, grads, text = _run_computed_leaves_step(C.bf16(), lower=True)
    reductions = [line for line in text.splitlines() if "COLLECTIVE" in line and "grad of" in line]
    # Both leaves compressed (before, only the first: the second went over in fp64, unnoticed).
    assert reductions and all("bf16" in line for line in reductions), reductions
    exact = torch.func.grad(lambda p: lf(p, x.double(), y.double()))({k: v.double() for k, v in params.items()})
    for k in params:
        torch.testing.assert_close(grads[k], exact[k], rtol=2e-2, atol=2e-3)


def test_gradients_of_values_computed_in_the_step_cannot_keep_state():
    with pytest.raises(grad_exchange.GradExchangeError, match="computed inside the step") as info:
        _run_computed_leaves_step(C.int8())
    assert "Differentiate the step's arguments" in str(info.value)
    assert "[6, 3]" in str(info.value) or "[8, 6]" in str(info.value)


def test_argnums_state_keyed_by_name_when_one_arguments_gradients_are_reduced():
    # README: with argnums=(0, 1) build the state from {"a": a, "b": b}; b's gradient is zero here (detached),
    # so only a's is reduced, and the state must still be found under ['a']['w'].
    torch.manual_seed(0)
    a, b = {"w": torch.randn(8, 6)}, {"w": torch.randn(6, 3)}
    x, y = torch.randn(4, 8), torch.randn(4, 3)

    def lf(a, b):
        return ((torch.tanh(x @ a["w"]) @ b["w"].detach() - y) ** 2).mean()

    def step(a, b, ex, x_, y_):
        ga, gb = pf.grad(lambda a, b: ((torch.tanh(x_ @ a["w"]) @ b["w"].detach() - y_) ** 2).mean(),
                         argnums=(0, 1))(a, b)
        return ga, gb, ex

    fmt = C.int8(block=8)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        da, db = pf.device_put(a, {"w": P()}), pf.device_put(b, {"w": P()})
        j = pf.jit(step, in_shardings=({"w": P()}, {"w": P()}, None, P("dp"), P("dp")), grad_exchange=fmt,
                   backend="eager")
        ga, _, ex = j(da, db, fmt.init({"a": da, "b": db}), x, y)
        ga, residual = pf.device_get((ga, ex.leaves["a"]["w"].residual))
    exact = torch.func.grad(lf)(a, b)
    # int8 of one step: close to the exact gradient in norm (entries near zero may round to zero)
    assert float((ga["w"] - exact["w"]).norm() / exact["w"].norm()) < 2e-2
    assert float(residual.abs().max()) > 0  # a's residual is the one the step used


def test_label_of_a_star_args_leaf_splits_at_its_index():
    assert grad_exchange._split_label("args[0]['w']") == ("args[0]", "['w']")
    assert grad_exchange._split_label("params['fc1']['w']") == ("params", "['fc1']['w']")
