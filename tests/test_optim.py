"""pf.optim: parity with torch.optim, schedules, wrappers, and tracing under make_fx."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func.optim as optim
from pt3func import tree as pftree

STEPS = 20


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _nested(flat: dict[str, torch.Tensor]) -> dict:
    """{'0.weight': w, ...} -> {'0': {'weight': w}, ...}: a nested pytree like real params."""
    out: dict = {}
    for name, value in flat.items():
        layer, leaf = name.split(".")
        out.setdefault(layer, {})[leaf] = value
    return out


def _flat(nested: dict) -> dict[str, torch.Tensor]:
    return {f"{layer}.{leaf}": v for layer, d in nested.items() for leaf, v in d.items()}


def _loss_and_grads(model, params, x, y):
    def loss_fn(p):
        out = torch.func.functional_call(model, _flat(p), (x,))
        return torch.nn.functional.mse_loss(out, y)

    return torch.func.grad(loss_fn)(params)


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda: optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
        (lambda: optim.sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        (
            lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        ),
        (lambda: optim.adam(1e-2), lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False)),
        (
            lambda: optim.adam(3e-3, b1=0.8, b2=0.95, eps=1e-6),
            lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, foreach=False),
        ),
        (
            lambda: optim.adamw(1e-2, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
        ),
    ],
    ids=["sgd", "sgd-momentum", "sgd-nesterov-wd", "adam", "adam-betas", "adamw"],
)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_matches_torch_optim(ours, theirs, dtype, tolerance):
    model = _model().to(dtype)
    params = _nested({k: v.detach().clone() for k, v in model.named_parameters()})
    opt = ours()
    state = opt.init(params)
    torch_opt = theirs(model.parameters())
    for step in range(STEPS):
        x, y = (t.to(dtype) for t in _batch(step))
        grads = _loss_and_grads(model, params, x, y)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)

        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch_opt.step()
    for name, p in model.named_parameters():
        ours_p = _flat(params)[name]
        assert ours_p.dtype == p.dtype
        assert _max_rel_err(ours_p, p.detach()) < tolerance, name


def test_state_follows_params_structure_and_dtype():
    params = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": [torch.zeros(2, 2), (torch.zeros(()),)]}
    state = optim.adamw(1e-3).init(params)
    adam_state = state[0]
    assert isinstance(adam_state, optim.ScaleByAdamState)
    assert adam_state.count.dtype == torch.int32 and adam_state.count.dim() == 0
    for moments in (adam_state.mu, adam_state.nu):
        assert pftree.structure(moments) == pftree.structure(params)
        assert [m.dtype for m in pftree.leaves(moments)] == [p.dtype for p in pftree.leaves(params)]
    grads = pftree.map(torch.ones_like, params)
    updates, _ = optim.adamw(1e-3).update(grads, state, params)
    new_params = optim.apply_updates(params, updates)
    assert [p.dtype for p in pftree.leaves(new_params)] == [p.dtype for p in pftree.leaves(params)]


def test_schedules_at_known_points():
    def at(schedule, count):
        return schedule(count).item()

    assert at(optim.constant(0.3), 0) == pytest.approx(0.3)
    assert at(optim.constant_schedule(0.3), torch.tensor(7, dtype=torch.int32)) == pytest.approx(0.3)

    lin = optim.linear(1.0, 0.0, transition_steps=10, transition_begin=5)
    assert [at(lin, c) for c in (0, 5, 10, 15, 100)] == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])

    cos = optim.cosine_decay(2.0, decay_steps=100, alpha=0.1)
    assert at(cos, 0) == pytest.approx(2.0)
    assert at(cos, 50) == pytest.approx(2.0 * (0.9 * 0.5 + 0.1))
    assert at(cos, 100) == pytest.approx(0.2)
    assert at(cos, 1000) == pytest.approx(0.2)
    assert at(cos, 25) == pytest.approx(2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi / 4)) + 0.1), rel=1e-6)

    wcd = optim.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=110, end_value=0.1)
    assert [at(wcd, c) for c in (0, 5, 10, 60, 110, 500)] == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1, 0.1])
    # A tensor count (what optimizer states hold) gives the same values as an int, as a 0-d tensor.
    value = wcd(torch.tensor(60, dtype=torch.int32))
    assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.item() == pytest.approx(0.55)
    assert optim.schedules.cosine_decay_schedule is optim.cosine_decay


def test_learning_rate_schedule_drives_the_step():
    schedule = optim.linear(1.0, 0.0, transition_steps=4)
    opt = optim.sgd(schedule)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    seen = []
    for _ in range(5):
        updates, state = opt.update({"w": torch.ones(3)}, state, params)
        seen.append(-updates["w"][0].item())
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_clip_by_global_norm():
    clip = optim.clip_by_global_norm(1.0)
    state = clip.init(None)
    big = {"a": torch.tensor([3.0, 0.0]), "b": [torch.tensor([[0.0, 4.0]])]}  # global norm 5
    clipped, _ = clip.update(big, state)
    assert optim.global_norm(clipped).item() == pytest.approx(1.0)
    torch.testing.assert_close(clipped["a"], torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(clipped["b"][0], torch.tensor([[0.0, 0.8]]))
    small = {"a": torch.tensor([0.3, 0.0]), "b": [torch.tensor([[0.0, 0.4]])]}
    unchanged, _ = clip.update(small, state)
    for u, s in zip(pftree.leaves(unchanged), pftree.leaves(small), strict=True):
        torch.testing.assert_close(u, s)
    zeros, _ = clip.update({"a": torch.zeros(3)}, state)
    assert torch.equal(zeros["a"], torch.zeros(3))


def test_apply_if_finite_skips_and_counts_nonfinite_steps():
    opt = optim.apply_if_finite(optim.adam(0.1), max_consecutive_errors=2)
    params = {"w": torch.tensor([1.0, 2.0])}
    state = opt.init(params)
    good = {"w": torch.tensor([0.5, -0.5])}
    bad = {"w": torch.tensor([float("nan"), 1.0])}

    updates, state = opt.update(good, state, params)
    params = optim.apply_updates(params, updates)
    before_params, before_inner = params, state.inner_state

    updates, state = opt.update(bad, state, params)
    params = optim.apply_updates(params, updates)
    assert torch.equal(params["w"], before_params["w"])
    for a, b in zip(pftree.leaves(state.inner_state), pftree.leaves(before_inner), strict=True):
        assert torch.equal(a, b)
    assert state.notfinite_count.item() == 1 and state.total_notfinite.item() == 1
    assert not state.last_finite.item()

    updates, state = opt.update({"w": torch.tensor([float("inf"), 0.0])}, state, params)
    assert torch.equal(updates["w"], torch.zeros(2))
    assert state.notfinite_count.item() == 2 and state.total_notfinite.item() == 2

    updates, state = opt.update(good, state, params)
    assert state.notfinite_count.item() == 0 and state.total_notfinite.item() == 2
    assert state.last_finite.item()
    assert state.inner_state[0].count.item() == 2  # only the two finite steps reached adam
    assert torch.isfinite(updates["w"]).all() and (updates["w"] != 0).all()


def test_apply_if_finite_gives_up_after_max_consecutive_errors():
    opt = optim.apply_if_finite(optim.sgd(1.0), max_consecutive_errors=1)
    params = {"w": torch.zeros(1)}
    state = opt.init(params)
    bad = {"w": torch.tensor([float("nan")])}
    updates, state = opt.update(bad, state, params)
    assert torch.equal(updates["w"], torch.zeros(1))
    updates, state = opt.update(bad, state, params)
    assert torch.isnan(updates["w"]).all()


def test_multisteps_equals_one_big_batch_step():
    k, micro = 4, 8
    model = _model()
    init_params = _nested({n: p.detach().clone() for n, p in model.named_parameters()})
    x, y = _batch(0, n=k * micro)

    big = optim.adamw(1e-2)
    big_updates, _ = big.update(_loss_and_grads(model, init_params, x, y), big.init(init_params), init_params)
    expected = optim.apply_updates(init_params, big_updates)

    acc = optim.MultiSteps(optim.adamw(1e-2), every_k_schedule=k)
    state = acc.init(init_params)
    params = init_params
    for i in range(k):
        sl = slice(i * micro, (i + 1) * micro)
        updates, state = acc.update(_loss_and_grads(model, params, x[sl], y[sl]), state, params)
        params = optim.apply_updates(params, updates)
        if i < k - 1:
            assert all(torch.equal(u, torch.zeros_like(u)) for u in pftree.leaves(updates))
            assert not acc.has_updated(state).item()
    assert acc.has_updated(state).item()
    assert state.mini_step.item() == 0 and state.gradient_step.item() == 1
    assert all(torch.equal(a, torch.zeros_like(a)) for a in pftree.leaves(state.acc_grads))
    for a, b in zip(pftree.leaves(params), pftree.leaves(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # The same thing through the GradientTransformation interface, composed in a chain.
    opt = optim.chain(optim.identity(), optim.MultiSteps(optim.sgd(1.0), 2).gradient_transformation())
    state = opt.init({"w": torch.zeros(2)})
    u1, state = opt.update({"w": torch.tensor([1.0, 2.0])}, state)
    u2, state = opt.update({"w": torch.tensor([3.0, 4.0])}, state)
    assert torch.equal(u1["w"], torch.zeros(2))
    torch.testing.assert_close(u2["w"], torch.tensor([-2.0, -3.0]))


def test_chain_composes_in_order():
    params = {"w": torch.tensor([1.0, -2.0])}
    grads = {"w": torch.tensor([30.0, 40.0])}  # norm 50
    opt = optim.chain(optim.clip_by_global_norm(5.0), optim.add_decayed_weights(0.5), optim.scale(-0.1))
    state = opt.init(params)
    assert isinstance(state, tuple) and len(state) == 3
    updates, _ = opt.update(grads, state, params)
    # clip to [3, 4], add 0.5 * [1, -2] -> [3.5, 3], scale by -0.1
    torch.testing.assert_close(updates["w"], torch.tensor([-0.35, -0.3]))
    with pytest.raises(ValueError, match="needs the params"):
        opt.update(grads, state)


def test_add_decayed_weights_mask():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    grads = pftree.map(torch.zeros_like, params)
    masked = optim.add_decayed_weights(0.1, mask=lambda p: {"w": True, "b": False})
    updates, _ = masked.update(grads, masked.init(params), params)
    torch.testing.assert_close(updates["w"], torch.full((2,), 0.1))
    torch.testing.assert_close(updates["b"], torch.zeros(2))


def test_lion_matches_reference_step():
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 4), "b": [torch.randn(4)]}
    opt = optim.lion(lr, b1=b1, b2=b2, weight_decay=wd)
    state = opt.init(params)
    ref_params = pftree.map(torch.clone, params)
    ref_mu = pftree.map(torch.zeros_like, params)
    for _ in range(5):
        grads = pftree.map(torch.randn_like, params)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)

        def ref_param(p, g, m):
            return p - lr * (torch.sign(b1 * m + (1 - b1) * g) + wd * p)

        ref_params = pftree.map(ref_param, ref_params, grads, ref_mu)
        ref_mu = pftree.map(lambda g, m: b2 * m + (1 - b2) * g, grads, ref_mu)
    for a, b in zip(pftree.leaves(params), pftree.leaves(ref_params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(pftree.leaves(state[0].mu), pftree.leaves(ref_mu), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert state[0].count.item() == 5


def _traced_step(opt):
    """A step `(params, grads, state) -> (params, state)` over flat leaves, for make_fx."""

    def step(params, grads, state):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return step


def test_adamw_step_traces_with_make_fx_and_matches_eager():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "layers": [{"b": torch.randn(3)}, (torch.randn(2, 2),)]}
    grads = pftree.map(torch.randn_like, params)
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.apply_if_finite(
            optim.adamw(optim.warmup_cosine_decay(0.0, 1e-2, 2, 10), weight_decay=0.1),
            max_consecutive_errors=3,
        ),
    )
    state = opt.init(params)
    # One eager step first so that the traced step starts from a non-trivial state.
    step = _traced_step(opt)
    params, state = step(params, grads, state)

    inputs, in_spec = pftree.flatten((params, grads, state))
    out_spec = []

    def flat_step(*leaves):
        outputs, spec = pftree.flatten(step(*pftree.unflatten(in_spec, list(leaves))))
        out_spec.append(spec)
        return outputs

    graph = make_fx(flat_step, tracing_mode="fake")(*inputs)
    text = graph.code
    assert "item" not in text and "_local_scalar_dense" not in text
    traced = pftree.unflatten(out_spec[-1], graph(*inputs))
    eager = step(params, grads, state)
    for a, b in zip(pftree.leaves(traced), pftree.leaves(eager), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_multisteps_traces_with_make_fx():
    params = {"w": torch.ones(3)}
    opt = optim.MultiSteps(optim.adam(0.1), every_k_schedule=2)
    state = opt.init(params)
    inputs, in_spec = pftree.flatten((params, {"w": torch.full((3,), 0.5)}, state))
    step = _traced_step(opt)

    def flat_step(*leaves):
        return pftree.leaves(step(*pftree.unflatten(in_spec, list(leaves))))

    graph = make_fx(flat_step, tracing_mode="fake")(*inputs)
    for a, b in zip(graph(*inputs), flat_step(*inputs), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_apply_if_finite_over_split_and_whole_params():
    # DTensor's isfinite(x).all() of a split leaf is a pending product, which could not be stacked with a whole
    # leaf's flag (apply_if_finite raised on every FSDP spec that leaves a small leaf whole); and the counters
    # must stay plain 0-d tensors, or the next call is another signature (a retrace, undonatable counters).
    from tests import optim_cases
    from tests.dist import run_world

    want = optim_cases.apply_if_finite_one_device()
    for rank_result in run_world(2, optim_cases.apply_if_finite_mixed_layouts):
        assert rank_result["trace_count"] == 1
        for name in ("eager", "jit"):
            got = rank_result[name]
            assert got["total_notfinite"] == 1
            assert got["counter_types"] == ["Tensor"], name
            for key in want:
                torch.testing.assert_close(got["params"][key], want[key])


@pytest.mark.slow
def test_zero_state_annotated_by_one_prefix_spec():
    from tests import optim_cases
    from tests.dist import run_world

    opt = optim.adam(0.1)
    p = {"w": optim_cases._params()["w"]}
    s = opt.init(p)
    for t in range(2):
        x = torch.full((2, 4), float(t + 1))
        g = {"w": torch.func.grad(lambda w, x: (x @ w).square().mean())(p["w"], x)}
        u, s = opt.update(g, s, p)
        p = optim.apply_updates(p, u)
    for rank_result in run_world(2, optim_cases.zero_by_prefix):
        torch.testing.assert_close(rank_result["params"]["w"], p["w"])
        assert rank_result["placements"] == {"count": "(Replicate(),)", "mu": "(Shard(dim=0),)",
                                             "nu": "(Shard(dim=0),)"}


def test_weight_decay_mask_may_be_a_prefix_of_the_params():
    params = {"dense": {"w": torch.ones(2, 2), "b": torch.ones(2)}, "norm": {"scale": torch.ones(2)}}
    grads = pftree.map(torch.zeros_like, params)

    def decayed(mask):
        opt = optim.add_decayed_weights(0.5, mask)
        updates, _ = opt.update(grads, opt.init(params), params)
        return {k: sorted(float(x.flatten()[0]) for x in pftree.leaves(v)) for k, v in updates.items()}

    assert decayed({"dense": True, "norm": False}) == {"dense": [0.5, 0.5], "norm": [0.0]}
    with pytest.raises(ValueError, match="weight-decay mask is not a pytree prefix of the params"):
        decayed({"dense": True})
