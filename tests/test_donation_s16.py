"""Donation of KV-cache style updates: outputs that view the donated new state, inference tensors, and
index_put / scatter updates whose first operand is the donated cache."""

from __future__ import annotations

import warnings

import pytest
import torch

import pt3func as pf
from pt3func.errors import DonationError
from pt3func.runtime.donated import refuse_inference_donation

_EXTRA_OUTPUTS = {
    "row_view": lambda toks: {"first_row": toks[0]},
    "slice_view": lambda toks: {"head": toks[:, :2]},
    "same_twice": lambda toks: {"tokens_so_far": toks},
    "all": lambda toks: {"tokens_so_far": toks, "first_row": toks[0], "row_sum": toks.sum(1)},
}


@pytest.mark.parametrize("name", list(_EXTRA_OUTPUTS))
def test_outputs_viewing_the_donated_new_state_keep_their_values(name):
    extra = _EXTRA_OUTPUTS[name]

    def step(state, tok, pos):
        toks = state["tokens"].index_copy(1, pos.reshape(1), tok[:, None])
        return {"tokens": toks}, extra(toks)

    def run(f):
        state, kept = {"tokens": torch.zeros(2, 5, dtype=torch.long)}, []
        for t in range(3):
            state, out = f(state, torch.tensor([t + 1, 10 * (t + 1)]), torch.tensor(t))
            kept.append(out)
        return kept

    expected = run(step)
    js = pf.jit(step, donate_argnums=(0,))
    got = run(js)  # earlier calls' outputs must not change when later calls write the donated buffer
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        for k in e:
            torch.testing.assert_close(g[k], e[k], rtol=0, atol=0)
    report = js.lower({"tokens": torch.zeros(2, 5, dtype=torch.long)}, torch.tensor([1, 2]), torch.tensor(0))
    assert all(row["aliased"] for row in report.donation_report())  # still donated


def test_refuse_inference_donation_names_the_leaf():
    with torch.inference_mode():
        cache = torch.zeros(4, 8)
    labels, leaves = ["c", "x"], [cache, torch.ones(4, 8)]
    with pytest.raises(DonationError, match="donated c is an inference tensor"):
        refuse_inference_donation("step", labels, leaves, [0])
    refuse_inference_donation("step", labels, leaves, [1])  # not donated: fine
    with torch.inference_mode():
        refuse_inference_donation("step", labels, leaves, [0])  # written inside inference mode: allowed


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_donated_inference_tensor_outside_inference_mode_is_named(backend):
    # A KV cache filled under torch.inference_mode() (a prefill) and donated to a decode step called outside it:
    # torch forbids the program's in-place write, and failed inside torch without naming the argument.
    def step(cache, kv):
        return cache.index_copy(0, torch.tensor([1]), kv), kv.sum()

    jitted = pf.jit(step, donate_argnums=0, backend=backend)
    with torch.inference_mode():
        cache = torch.zeros(4, 8)
    with pytest.raises(DonationError, match=r"donated cache is an inference tensor"):
        jitted(cache, torch.ones(1, 8))  # the first call: refused before compiling
    with pytest.raises(DonationError, match=r"donated cache is an inference tensor"):
        jitted(cache, torch.ones(1, 8))  # the first call's trace kept: refused again
    new, _ = jitted(torch.zeros(4, 8), torch.ones(1, 8))  # a normal tensor: donated, as eager computes
    torch.testing.assert_close(new, step(torch.zeros(4, 8), torch.ones(1, 8))[0])
    if backend == "eager":
        with pytest.raises(DonationError, match=r"donated cache is an inference tensor"):
            jitted(cache, torch.ones(1, 8))  # a later call: torch's error, named
    else:  # Inductor's kernels write the buffer without torch's check: the call runs, as donated
        new, _ = jitted(cache, torch.ones(1, 8))
        torch.testing.assert_close(new[1], torch.ones(8))
    with torch.inference_mode():
        fresh = torch.zeros(4, 8)
        new, _ = jitted(fresh, torch.ones(1, 8))  # inside inference mode the write is allowed
    torch.testing.assert_close(new[1], torch.ones(8))


_CACHE_UPDATES = {
    "index_put": lambda c, kv, pos: c.index_put((torch.arange(c.shape[0]), pos.reshape(1).expand(c.shape[0])), kv),
    "scatter": lambda c, kv, pos: c.scatter(1, pos.reshape(1, 1, 1).expand(c.shape[0], 1, c.shape[2]), kv[:, None]),
    "index_copy": lambda c, kv, pos: c.index_copy(1, pos.reshape(1), kv[:, None]),
}


@pytest.mark.parametrize("name", list(_CACHE_UPDATES))
def test_kv_cache_updates_are_donated_and_match_eager(name):
    update = _CACHE_UPDATES[name]

    def step(cache, kv, pos):
        new = update(cache, kv, pos)
        return new, new.sum(1)

    def run(f):
        cache, kept = torch.zeros(3, 5, 2), []
        for t in range(4):
            cache, s = f(cache, torch.full((3, 2), float(t + 1)) * torch.arange(1, 4)[:, None], torch.tensor(t))
            kept.append((cache.clone(), s))
        return kept

    expected = run(step)
    js = pf.jit(step, donate_argnums=(0,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(js)
    assert not [w for w in caught if "cannot be reused" in str(w.message)]
    for (ec, es), (gc, gs) in zip(expected, got):
        torch.testing.assert_close(gc, ec, rtol=0, atol=0)
        torch.testing.assert_close(gs, es, rtol=0, atol=0)
    assert all(row["aliased"] for row in js.lower(torch.zeros(3, 5, 2), torch.ones(3, 2), torch.tensor(0))
               .donation_report())


def test_scatter_that_also_gathers_the_donated_input_is_still_refused():
    def step(c):
        idx = torch.tensor([[1, 0, 2], [2, 1, 0], [0, 2, 1]])
        return c.scatter(0, idx, c)  # c as src: read at other positions than written

    c = torch.randn(3, 3)
    expected = step(c.clone())
    with pytest.warns(UserWarning, match="other positions"):
        out = pf.jit(step, donate_argnums=0)(c)
    torch.testing.assert_close(out, expected)


def test_index_copy_on_a_virtual_tp_mesh_is_donated_and_matches_eager():
    from pt3func import P

    mesh = pf.make_mesh((2,), ("tp",), virtual=True)

    def step(c, kv, pos):
        n = c.index_copy(1, pos.reshape(1), kv)  # DTensor runs it as index_put on the local shards
        return n, n[0]

    def run(f, put):
        c, kept = put(torch.zeros(2, 4, 4)), []
        for t in range(3):
            c, row = f(c, put(torch.full((2, 1, 4), float(t + 1))), torch.tensor(t))
            kept.append((pf.device_get(c).clone(), pf.device_get(row)))
        return kept

    expected = run(step, lambda x: x)
    js = pf.jit(step, in_shardings=(P(None, None, "tp"), P(None, None, "tp"), P()),
                out_shardings=(P(None, None, "tp"), P(None, "tp")), donate_argnums=(0,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(js, lambda x: pf.device_put(x, pf.NamedSharding(mesh, P(None, None, "tp"))))
    assert not [w for w in caught if "cannot be reused" in str(w.message)]
    for (ec, er), (gc, gr) in zip(expected, got):
        torch.testing.assert_close(gc, ec, rtol=0, atol=0)
        torch.testing.assert_close(gr, er, rtol=0, atol=0)
