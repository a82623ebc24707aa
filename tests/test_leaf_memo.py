"""A call's DTensor leaves that the previous call returned are not read again (pt3func/trace/leaf_memo.py).

On a virtual mesh every rank thread calls the jitted step with its own DTensors, as a process of a real world
would: the memo is per thread. What is checked: keys are read only for leaves no call returned or kept; the
numbers are those of the same step on one device; a leaf donated to another program, a leaf of a new shape and a
dropped output are all seen for what they are.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import pt3func as pf
from pt3func import P
from pt3func.errors import DonationError


def sgd_step(params, x):
    def loss_fn(p):
        return ((x @ p["w"] + p["b"]) ** 2).mean()

    loss, grads = pf.value_and_grad(loss_fn)(params)
    return {k: params[k] - 0.1 * grads[k] for k in params}, loss


def init(d: int = 4):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(d, 3, generator=g), "b": torch.randn(3, generator=g)}, torch.randn(8, d, generator=g)


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def counting(step):
    """Count the leaf keys `step` reads, per rank thread."""
    counts: dict[str, int] = {}
    read = step._leaf_memo._leaf_key

    def leaf_key(leaf):
        name = threading.current_thread().name
        counts[name] = counts.get(name, 0) + 1
        return read(leaf)

    step._leaf_memo._leaf_key = leaf_key
    return counts


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_returned_leaves_are_not_read_again_and_numbers_match_one_device(mesh, backend):
    params0, x0 = init()
    step = pf.jit(sgd_step, donate_argnums=(0,), backend=backend)
    counts = counting(step)
    with pf.set_mesh(mesh):
        params = pf.device_put(params0, P())
        x = pf.device_put(x0, P("dp"))
        reads = []
        for _ in range(4):
            counts.clear()
            params, loss = step(params, x)
            reads.append(sum(counts.values()))
        got = pf.device_get(params)
    # First call: all 3 leaves on each of the 2 ranks; then none (params returned, the batch kept).
    assert reads == [6, 0, 0, 0]
    assert step.trace_count() == 1  # each rank thread traces its own program, once: counted once
    want = params0
    for _ in range(4):
        want, want_loss = sgd_step(want, x0)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_leaf_donated_to_another_program_is_refused(mesh):
    params0, x0 = init()
    keep = pf.jit(sgd_step)  # returns new params, donates nothing
    consume = pf.jit(lambda p: {k: v * 2 for k, v in p.items()}, donate_argnums=(0,))
    with pf.set_mesh(mesh):
        params = pf.device_put(params0, P())
        x = pf.device_put(x0, P("dp"))
        params, _ = keep(params, x)
        params, _ = keep(params, x)  # remembered by `keep` now
        consume(params)  # donated: these DTensors are gone
        with pytest.raises(DonationError, match="donated"):
            keep(params, x)


def test_a_new_shape_in_a_remembered_place_is_traced_again(mesh):
    params0, x0 = init()
    step = pf.jit(sgd_step, donate_argnums=(0,))
    with pf.set_mesh(mesh):
        params = pf.device_put(params0, P())
        x = pf.device_put(x0, P("dp"))
        params, _ = step(params, x)
        params, _ = step(params, x)
        wider, xw = init(6)
        new, _ = step(pf.device_put(wider, P()), pf.device_put(xw, P("dp")))
        assert step.trace_count() == 2
        got = pf.device_get(new)
    want, _ = sgd_step(wider, xw)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_remembered_outputs_are_not_kept_alive(mesh):
    params0, x0 = init()
    step = pf.jit(sgd_step)
    with pf.set_mesh(mesh):
        params = pf.device_put(params0, P())
        x = pf.device_put(x0, P("dp"))
        out, loss = step(params, x)
        locals_ = [leaf for leaf in pf.tree.leaves(out)]
        refs = [weakref.ref(t) for t in _rank_tensors(locals_)]
        del out, locals_
        gc.collect()
    assert refs and all(r() is None for r in refs)


def _rank_tensors(leaves):
    """The per-rank DTensors behind a virtual mesh's values (what the rank threads' calls returned)."""
    found = []
    for leaf in leaves:
        found.extend(leaf.locals)
    return found


def test_another_structure_after_a_cached_call_is_traced_again():
    """The fast path takes the leaves along the last call's structure (`flatten_up_to`): a subtree where a leaf
    was, an extra key, another static value are all new signatures, with the right numbers."""

    def total(tree, scale):
        return sum(leaf.sum() for leaf in pf.tree.leaves(tree)) * scale

    step = pf.jit(total, static_argnums=(1,))
    t = torch.arange(4.0)
    assert step({"w": t}, 2.0).item() == 12.0
    assert step({"w": t}, 2.0).item() == 12.0
    assert step({"w": {"a": t, "b": t + 1}}, 2.0).item() == 32.0  # a subtree where the leaf was
    assert step({"w": t, "v": t}, 2.0).item() == 24.0  # an extra key
    assert step({"w": t, "v": t}, 3.0).item() == 36.0  # another static value
    assert step({"w": t}, 2.0).item() == 12.0  # back to the first signature: cached
    assert step.trace_count() == 4
