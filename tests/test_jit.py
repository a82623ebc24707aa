"""pf.jit on one device: equivalence with eager PyTorch, caching, donation, stages and every purity error."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pt3func as pf

BACKENDS = ["eager", "inductor"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _adamw_train_step(apply, opt):
    def loss_fn(params, x, y):
        return F.mse_loss(apply(params, x), y)

    def train_step(params, opt_state, batch):
        loss, grads = pf.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return train_step


def _check_against_torch(module: nn.Module, batches, backend: str, steps: int = 10) -> None:
    """Train `module` eagerly with torch.optim.AdamW and a copy through pf.jit; compare losses and params."""
    reference = module
    params, apply = pf.functionalize(_clone_module(module))
    params = pf.tree.map(torch.clone, params)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    opt = pf.optim.adamw(1e-2, weight_decay=0.01)
    opt_state = opt.init(params)
    step = pf.jit(_adamw_train_step(apply, opt), donate_argnums=(0, 1), backend=backend)
    for i in range(steps):
        x, y = batches[i % len(batches)]
        torch_opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        torch_opt.step()
        params, opt_state, metrics = step(params, opt_state, (x, y))
        assert _rel_err(metrics["loss"], ref_loss.detach()) <= 1e-5, f"step {i}"
    ref_params = dict(reference.named_parameters())
    for name, value in ref_params.items():
        node = params
        for key in name.split("."):
            node = node[key]
        assert _rel_err(node, value.detach()) <= 1e-5, name
    assert step.trace_count() == 1


def _clone_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlp_matches_torch_adamw(backend):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(3)]
    _check_against_torch(mlp, batches, backend)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # bias=False: the key projection's bias has an exactly-zero gradient (softmax ignores it), and Adam
        # turns the rounding noise in that zero into full-size steps, so it cannot be compared to 1e-5.
        self.layer = nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, bias=False
        )
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformer_matches_torch_adamw(backend):
    torch.manual_seed(0)
    model = TinyTransformer()
    batches = [(torch.randn(4, 6, 32), torch.randn(4, 6, 3)) for _ in range(2)]
    _check_against_torch(model, batches, backend)


def _sgd_step(params, batch, lr):
    def loss_fn(p):
        return ((torch.tanh(batch[0] @ p["w"]) - batch[1]) ** 2).mean()

    loss, g = pf.value_and_grad(loss_fn)(params)
    return {"w": params["w"] - lr * g["w"]}, loss


def _data(n=8):
    torch.manual_seed(1)
    return {"w": torch.randn(4, 3)}, (torch.randn(n, 4), torch.randn(n, 3))


def test_cache_hits_on_same_signature_and_retraces_on_new_shape(caplog):
    step = pf.jit(_sgd_step, backend="eager")
    params, batch = _data()
    step(params, batch, 0.1)
    step(params, batch, 0.2)  # a Python float is a traced input: a new value is not a new program
    step({"w": torch.randn(4, 3)}, (torch.randn(8, 4), torch.randn(8, 3)), 0.3)
    assert step.trace_count() == 1
    pf.config.explain_cache_misses = True
    try:
        with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
            _, bigger = _data(n=16)
            step(params, bigger, 0.1)
    finally:
        pf.config.explain_cache_misses = False
    assert step.trace_count() == 2
    assert "batch[0]: float32[8, 4] on cpu -> float32[16, 4] on cpu" in caplog.text


def test_a_retrace_for_strides_is_explained_with_them(caplog):
    step = pf.jit(lambda x: x * 2, backend="eager")
    step(torch.randn(3, 2))
    pf.config.explain_cache_misses = True
    try:
        with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
            step(torch.randn(2, 3).t())
    finally:
        pf.config.explain_cache_misses = False
    assert "x: float32[3, 2] on cpu -> float32[3, 2] on cpu strides=(1, 3)" in caplog.text


def test_static_values_equal_but_of_other_types_are_other_programs():
    step = pf.jit(lambda x, n: x * n, static_argnums=1, backend="eager")
    assert step(torch.ones(2), 2).dtype == torch.float32
    assert step(torch.ones(2, dtype=torch.int64), 2).dtype == torch.int64
    assert step(torch.ones(2, dtype=torch.int64), 2.0).dtype == torch.float32  # eager: int * float -> float
    assert step.trace_count() == 3


def test_a_jitted_function_called_inside_another_is_inlined():
    inner = pf.jit(lambda a: a * 2 + 1)
    outer = pf.jit(lambda a: inner(a).sum())
    x = torch.randn(3)
    torch.testing.assert_close(outer(x), (x * 2 + 1).sum())
    assert inner.trace_count() == 0  # traced as part of `outer`, never on its own


def test_donating_an_expanded_view_is_reported_not_run():
    x = torch.randn(1, 4).expand(3, 4)
    with pytest.warns(UserWarning, match=r"p: its elements share memory"):
        out = pf.jit(lambda p: p * 2 + 1, donate_argnums=0)(x)
    torch.testing.assert_close(out, x * 2 + 1)


def test_python_scalar_is_an_input_not_a_constant():
    step = pf.jit(_sgd_step, backend="eager")
    params, batch = _data()
    a, _ = step(params, batch, 0.1)
    b, _ = step(params, batch, 0.5)
    ea, _ = _sgd_step(params, batch, 0.1)
    eb, _ = _sgd_step(params, batch, 0.5)
    torch.testing.assert_close(a["w"], ea["w"])
    torch.testing.assert_close(b["w"], eb["w"])
    assert step.trace_count() == 1
    assert "lr" in step.lower(params, batch, 0.1).as_text()


def test_static_argnums_retrace_per_value():
    def f(x, n):
        for _ in range(n):  # Python control flow on a static value is fine
            x = x * 2
        return x

    step = pf.jit(f, static_argnums=1, backend="eager")
    x = torch.ones(3)
    torch.testing.assert_close(step(x, 2), x * 4)
    torch.testing.assert_close(step(x, 3), x * 8)
    torch.testing.assert_close(step(x, n=3), x * 8)
    assert step.trace_count() == 3  # n=3 by keyword is a different call signature from positional


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_buffers_are_updated_in_place(backend):
    step = pf.jit(_sgd_step, donate_argnums=0, backend=backend)
    params, batch = _data()
    expected, _ = _sgd_step({"w": params["w"].clone()}, batch, 0.1)
    ptr = params["w"].data_ptr()
    new, _ = step(params, batch, 0.1)
    assert new["w"].data_ptr() == ptr
    torch.testing.assert_close(new["w"], expected["w"])
    with pytest.raises(pf.DonationError, match="donated"):
        params["w"] + 1
    with pytest.raises(pf.DonationError, match="donated"):
        step(params, batch, 0.1)
    # The program writes in place (a copy_ into the input) and no longer returns the donated output.
    lowered = step.lower({"w": torch.randn(4, 3)}, batch, 0.1)
    assert "aten.copy_" in lowered.as_text()
    assert lowered.memory_analysis()["aliased_bytes"] == 4 * 3 * 4
    assert lowered.donation_report() == [{"input": "params['w']", "aliased": True, "output": "out[0]['w']"}]


def test_unusable_donation_warns_and_strict_raises():
    def f(x):
        return x.sum()

    step = pf.jit(f, donate_argnums=0, backend="eager")
    with pytest.warns(UserWarning, match=r"x: no output left with shape \(4, 3\)"):
        step(torch.randn(4, 3))
    pf.config.strict_donation = True
    try:
        with pytest.raises(pf.DonationError, match="strict_donation"):
            pf.jit(f, donate_argnums=0, backend="eager")(torch.randn(4, 3))
    finally:
        pf.config.strict_donation = False


def test_donated_output_structure_that_does_not_fit_is_reported():
    # The donated params tree has two leaves but the step returns only one of matching shape.
    def f(params):
        return {"w": params["w"] * 2}

    pf.config.strict_donation = True
    try:
        with pytest.raises(pf.DonationError, match=r"params\['b'\]"):
            pf.jit(f, donate_argnums=0, backend="eager")({"w": torch.randn(3), "b": torch.randn(5)})
    finally:
        pf.config.strict_donation = False


def test_donating_the_same_tensor_twice_raises():
    def f(a, b):
        return a + 1, b + 1

    step = pf.jit(f, donate_argnums=(0, 1), backend="eager")
    x = torch.randn(3)
    with pytest.raises(pf.DonationError, match=r"a and b share one buffer"):
        step(x, x)
    y = torch.randn(3)
    with pytest.raises(pf.DonationError, match="share one buffer"):
        pf.jit(f, donate_argnums=0, backend="eager")(y, y)  # donated and also read through b


def test_output_reading_a_donated_input_is_not_aliased():
    def f(a):
        return a + 1, a.t()

    step = pf.jit(f, donate_argnums=0, backend="eager")
    a = torch.randn(3, 3)
    expected = (a + 1, a.t().clone())
    with pytest.warns(UserWarning, match="reads this input's memory"):
        out = step(a)
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], expected[1])


def test_input_mutation_raises_with_source_line():
    def f(x):
        x.add_(1)  # the offending line
        return x

    with pytest.raises(pf.ImpureFunctionError, match=r"test_jit.py:\d+ `x.add_\(1\)  # the offending line`.*input x"):
        pf.jit(f, backend="eager")(torch.randn(3))


def test_mutating_a_view_of_an_input_raises():
    def f(p):
        p["w"][0].zero_()
        return p["w"]

    with pytest.raises(pf.ImpureFunctionError, match=r"input p\['w'\]"):
        pf.jit(f, backend="eager")({"w": torch.randn(3, 2)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_captured_from_outside_are_read_by_the_program(backend):
    """A closure's tensors (a mask, a table of positions) are constants of the program: gradients flow around
    them, and the program reads the captured tensor itself, as eager PyTorch does (an in-place change is seen)."""
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    table = torch.randn(4, 4)

    def loss(w, x):
        return ((x @ table) * w * mask).pow(2).sum() + table.sum()

    w, x = torch.randn(4), torch.randn(2, 4)
    value, grad = pf.jit(pf.value_and_grad(loss), backend=backend)(w, x)
    want_value, want_grad = torch.func.grad_and_value(loss)(w, x)[::-1]
    torch.testing.assert_close(value, want_value)
    torch.testing.assert_close(grad, want_grad)
    scaled = pf.jit(lambda x: x * mask, backend=backend)
    scaled(x)
    mask.mul_(3.0)
    torch.testing.assert_close(scaled(x), x * mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_whose_fake_strides_differ_from_the_real_ones(backend):
    """`mse_loss_backward` of a transposed prediction (as nn.MultiheadAttention(batch_first=True) returns) has other
    strides in fake mode than for real: the traced `view` of its result failed under the eager backend."""
    g = torch.Generator().manual_seed(0)
    w, x, y = torch.randn(16, 16, generator=g), torch.randn(6, 2, 16, generator=g), torch.randn(2, 6, 16, generator=g)

    def loss(w, x, y):
        return F.mse_loss((x.reshape(12, 16) @ w).view(6, 2, 16).transpose(0, 1), y)

    torch.testing.assert_close(pf.jit(pf.grad(loss), backend=backend)(w, x, y), pf.grad(loss)(w, x, y))


def test_writing_into_a_captured_tensor_raises():
    counts = torch.zeros(3)

    def f(x):
        counts.add_(x)
        return x * 2

    with pytest.raises(pf.ImpureFunctionError, match=r"`counts.add_\(x\)`.*captured from outside the step"):
        pf.jit(f, backend="eager")(torch.ones(3))
    assert torch.equal(counts, torch.zeros(3))


def test_python_if_on_tensor_raises():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(pf.DataDependentControlFlowError, match=r"test_jit.py:\d+ `if x.sum\(\) > 0:`.*torch.where"):
        pf.jit(f, backend="eager")(torch.randn(3))


def test_while_on_tensor_raises():
    def f(x):
        while x.max() < 10:
            x = x * 2
        return x

    with pytest.raises(pf.DataDependentControlFlowError, match="control flow"):
        pf.jit(f, backend="eager")(torch.ones(3))


def test_item_raises():
    def f(x):
        return x * x.sum().item()

    with pytest.raises(pf.DataDependentControlFlowError, match=r"test_jit.py:\d+ `return x \* x.sum\(\).item\(\)`"):
        pf.jit(f, backend="eager")(torch.randn(3))


def test_print_raises():
    def f(x):
        print(x)
        return x * 2

    with pytest.raises(pf.ImpureFunctionError, match=r"test_jit.py:\d+ `print\(x\)`.*printing"):
        pf.jit(f, backend="eager")(torch.randn(3))
    # Printing is restored after the failed trace.
    assert "tensor" in str(torch.ones(1))


def test_boolean_mask_raises():
    def f(x):
        return x[x > 0].sum()

    with pytest.raises(pf.DataDependentControlFlowError, match="shape that depends on tensor values"):
        pf.jit(f, backend="eager")(torch.randn(5))


def test_unhashable_static_leaf_raises():
    def f(x, cfg):
        return x * 2

    with pytest.raises(pf.TracingError, match=r"cfg\[0\]"):
        pf.jit(f, backend="eager")(torch.ones(2), [object.__new__(_Unhashable)])


class _Unhashable:
    __hash__ = None


def test_stages_lower_text_cost_memory_compile():
    def f(a, b):
        return torch.relu(a @ b)  # matmul line

    step = pf.jit(f, backend="eager")
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    lowered = step.lower(a, b)
    text = lowered.as_text()
    assert "aten.mm(%arg0_1, %arg1_1)" in text and "test_jit.py" in text
    assert "# a" in text and "# b" in text
    assert lowered.cost_analysis()["flops"] == 2 * 8 * 16 * 4
    mem = lowered.memory_analysis()
    assert mem["argument_bytes"] == (8 * 16 + 16 * 4) * 4
    assert mem["output_bytes"] == 8 * 4 * 4
    assert set(mem) >= {"peak_bytes", "argument_bytes", "output_bytes", "aliased_bytes", "temp_bytes"}
    compiled = lowered.compile()
    torch.testing.assert_close(compiled(a, b), torch.relu(a @ b))


def test_decorator_forms_and_kwargs():
    import functools

    @pf.jit
    def f(x, *, scale):
        return x * scale

    @functools.partial(pf.jit, donate_argnums=0, backend="eager")
    def g(x):
        return x + 1

    x = torch.ones(3)
    torch.testing.assert_close(f(x, scale=2.0), x * 2)
    torch.testing.assert_close(g(torch.ones(3)), x + 1)


def test_grad_vmap_inside_jit():
    def per_example_grad_norms(w, xs):
        def loss(w, x):
            return (x @ w).pow(2).sum()

        grads = pf.vmap(pf.grad(loss), in_axes=(None, 0))(w, xs)
        return grads.flatten(1).norm(dim=1)

    w, xs = torch.randn(4, 2), torch.randn(5, 4)
    expected = torch.stack([(2 * torch.outer(x, x @ w)).norm() for x in xs])
    torch.testing.assert_close(per_example_grad_norms(w, xs), expected)
    torch.testing.assert_close(pf.jit(per_example_grad_norms, backend="eager")(w, xs), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_ops_draw_from_global_generator(backend):
    def f(x):
        return F.dropout(x, p=0.5, training=True) + torch.rand_like(x)

    x = torch.ones(64)
    torch.manual_seed(7)
    expected = f(x)
    step = pf.jit(f, backend=backend)
    step(x)  # compile outside the seeded region
    torch.manual_seed(7)
    torch.testing.assert_close(step(x), expected)


def test_non_tensor_outputs_and_nested_structures():
    def f(state):
        return {"a": state["x"] * 2, "meta": "fixed", "n": None, "pair": (state["x"], 3)}

    out = pf.jit(f, backend="eager")({"x": torch.ones(2)})
    assert out["meta"] == "fixed" and out["n"] is None and out["pair"][1] == 3
    torch.testing.assert_close(out["a"], torch.full((2,), 2.0))


def test_unknown_backend_and_bad_budget():
    with pytest.raises(ValueError, match="unknown backend"):
        pf.jit(lambda x: x, backend="xla")
    with pytest.raises(ValueError, match="memory_budget"):
        pf.jit(lambda x: x, memory_budget=2.0)
    with pytest.raises(TypeError, match="grad_exchange"):
        pf.jit(lambda x: x, grad_exchange=object())


def test_no_warning_for_fully_used_donation():
    step = pf.jit(_sgd_step, donate_argnums=0, backend="eager")
    params, batch = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, batch, 0.1)


def test_saved_activations_lists_what_the_backward_reads():
    def loss_fn(w, x):
        h = torch.tanh(x @ w)  # saved for tanh's backward
        return h.sum()

    def step(w, x):
        return pf.grad(loss_fn)(w, x)

    rows = pf.jit(step, backend="eager").lower(torch.randn(4, 3), torch.randn(2, 4)).saved_activations()
    by_what = {row["what"]: row for row in rows}
    assert by_what["aten.tanh"]["type"] == "f32[2, 3]" and by_what["aten.tanh"]["bytes"] == 2 * 3 * 4
    assert "test_jit.py" in by_what["aten.tanh"]["where"]
    assert "argument x" in by_what  # the matmul's weight gradient needs the input
    assert all(row["what"] != "aten.sum" for row in rows)
