"""pf.grad / pf.vmap / pf.checkpoint composed the ways users compose them, against eager autograd and torch.func;
and the errors pf.jit gives for arguments and outputs it cannot trace faithfully."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import pt3func as pf


def _critic() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(5, 3)


@pytest.mark.parametrize("jit", [False, True])
def test_gradient_penalty_keeps_the_inner_gradients_graph(jit):
    # WGAN-GP: the inner gradient is over the data; the outer one over the params the inner function closes over.
    critic, x = _critic()
    params, apply = pf.functionalize(critic)

    def loss(params, x):
        gx = pf.grad(lambda xx: apply(params, xx).sum())(x)
        return apply(params, x).mean() + 10 * ((gx.norm(dim=1) - 1) ** 2).mean()

    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(critic(xr).sum(), xr, create_graph=True)
    want = torch.autograd.grad(critic(xr).mean() + 10 * ((gx.norm(dim=1) - 1) ** 2).mean(), list(critic.parameters()))
    step = pf.jit(pf.grad(loss), backend="eager") if jit else pf.grad(loss)
    got = step(params, x)
    for (name, _), w in zip(critic.named_parameters(), want):
        layer, kind = name.split(".")
        torch.testing.assert_close(got[layer][kind], w)
    # Only the penalty: it too depends on the params (it raised "does not require grad" before).
    only = pf.grad(lambda p, x: (pf.grad(lambda xx: apply(p, xx).sum())(x) ** 2).sum())(params, x)
    assert pf.tree.leaves(only)[0].abs().sum() > 0


def test_torch_backward_through_pf_grad_reaches_closure_parameters():
    critic, x = _critic()
    gx = pf.grad(lambda xx: critic(xx).sum())(x)  # x is plain data; critic's parameters require grad
    (gx ** 2).sum().backward()
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(critic(xr).sum(), xr, create_graph=True)
    expected = torch.autograd.grad((want ** 2).sum(), critic[0].weight)[0]
    torch.testing.assert_close(critic[0].weight.grad, expected)


def test_outer_pf_grad_returns_plain_values():
    critic, x = _critic()
    params, apply = pf.functionalize(critic)
    g = pf.grad(lambda p, x: pf.grad(lambda xx: apply(p, xx).sum())(x).sum())(params, x)
    assert all(not leaf.requires_grad for leaf in pf.tree.leaves(g))


def test_grad_of_a_function_that_ignores_its_argument_is_zero():
    f = lambda a, b: (b ** 2).sum()  # noqa: E731
    assert torch.equal(pf.grad(f)(torch.ones(2), torch.ones(2)), torch.zeros(2))
    assert torch.equal(pf.jit(pf.grad(f), backend="eager")(torch.ones(2), torch.ones(2)), torch.zeros(2))
    value, g = pf.value_and_grad(lambda a: torch.tensor(3.0))(torch.ones(3))
    assert float(value) == 3.0 and torch.equal(g, torch.zeros(3))


def test_vmap_out_axes_none_refuses_a_per_example_output():
    x = torch.arange(6.0).reshape(3, 2)
    with pytest.raises(ValueError, match=r"out_axes is None for output\[1\]"):
        pf.vmap(lambda a: (a.sum(), a * 2), out_axes=(0, None))(x)
    total, const = pf.vmap(lambda a: (a.sum(), torch.ones(2)), out_axes=(0, None))(x)
    assert torch.equal(total, x.sum(1)) and torch.equal(const, torch.ones(2))
    # Unmapped at this level, mapped at the outer one: fine.
    out = pf.vmap(lambda a: pf.vmap(lambda b: a * 2, out_axes=None)(torch.ones(4)))(x)
    assert torch.equal(out, x * 2)


def test_vmap_passes_keyword_arguments_unmapped():
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(pf.vmap(lambda a, *, s: a * s)(x, s=2.0), x * 2)
    w = torch.tensor([1.0, -1.0])
    assert torch.equal(pf.vmap(lambda a, w: (a * w).sum())(x, w=w), (x * w).sum(1))


def test_eager_checkpoint_composes_with_per_sample_grads_and_hessian_vector_products():
    torch.manual_seed(0)
    w, xs, v0, u = torch.randn(3, 3), torch.randn(4, 3), torch.randn(3), torch.randn(3)

    def f(v, w):
        return (torch.tanh(v @ w) ** 2).sum()

    want = torch.func.vmap(torch.func.grad(f, argnums=1), in_dims=(0, None))(xs, w)
    got = pf.vmap(pf.grad(pf.checkpoint(f), argnums=1), in_axes=(0, None))(xs, w)
    torch.testing.assert_close(got, want)
    dots = pf.checkpoint(f, policy=pf.checkpoint_policies.dots_saveable)
    hvp = pf.grad(lambda v: pf.grad(dots)(v, w) @ u)(v0)
    torch.testing.assert_close(hvp, torch.func.jvp(lambda v: torch.func.grad(f)(v, w), (v0,), (u,))[1])


def test_jit_returns_hugging_face_outputs_with_real_tensors():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    params, apply = pf.functionalize(model)
    ids = torch.randint(0, 50, (1, 8))
    out = pf.jit(lambda p, i: apply(p, i, use_cache=False), backend="eager")(params, ids)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert type(out.logits) is torch.Tensor
    torch.testing.assert_close(out.logits, model(ids, use_cache=False).logits)
    # The model's cache object is no pytree: refused, naming it, instead of returning trace-time tensors.
    with pytest.raises(pf.TracingError, match="holding tensors"):
        pf.jit(lambda p, i: apply(p, i, use_cache=True), backend="eager")(params, ids)


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    logits: torch.Tensor


def test_jit_refuses_an_output_object_that_is_not_a_pytree():
    with pytest.raises(pf.TracingError, match=r"output\['stats'\] is a _Out holding tensors \(loss, logits\)"):
        pf.jit(lambda x: {"stats": _Out(x.sum(), x * 2)}, backend="eager")(torch.ones(3))


def test_jit_argument_errors():
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"static_argnums=\[3\] but <lambda> takes 1 positional"):
        pf.jit(lambda x: x, static_argnums=3)
    with pytest.raises(pf.TracingError, match="static argument 1 holds a tensor"):
        pf.jit(lambda x, t: x + t, static_argnums=1, backend="eager")(x, torch.ones(4))
    pf.jit(lambda *xs: xs[0], static_argnums=3)  # a *args function may get a fourth argument
    with pytest.raises(pf.TracingError, match=r"Python numbers among the arguments \(n\)"):
        pf.jit(lambda x, n: x[:n], backend="eager")(x, 2)


def test_data_dependent_error_names_the_library_line():
    params, apply = pf.functionalize(nn.BatchNorm1d(3, momentum=None).train())
    with pytest.raises(pf.TracingError, match=r"batchnorm\.py:\d+ `.*float\(self\.num_batches_tracked\)"):
        pf.jit(apply.with_updates, backend="eager")(params, torch.randn(4, 3))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_autocast_is_part_of_the_signature(backend):
    w = torch.randn(4, 4)
    step = pf.jit(lambda x: x @ w, backend=backend)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step(x).dtype == torch.bfloat16
    out = step(x)  # outside autocast: another program, in fp32
    assert out.dtype == torch.float32 and step.trace_count() == 2
    torch.testing.assert_close(out, x @ w)


def test_grad_inside_inference_mode_is_refused():
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inside torch.inference_mode"):
        pf.grad(lambda w: (w ** 2).sum())(torch.ones(3))


def test_static_values_of_other_types_inside_containers_are_other_programs():
    from collections import namedtuple

    cfg = namedtuple("cfg", "scale")
    step = pf.jit(lambda x, c: x * c.scale, static_argnums=1, backend="eager")
    x = torch.full((1,), 200, dtype=torch.uint8)
    assert step(x, cfg(2)).dtype == torch.uint8
    out = step(x, cfg(2.0))
    assert out.dtype == torch.float32 and float(out) == 400.0 and step.trace_count() == 2


def test_reseeding_inside_a_step_is_refused():
    def f(x):
        torch.manual_seed(0)
        return x + torch.rand(3)

    with pytest.raises(pf.ImpureFunctionError, match=r"manual_seed\(\) inside jitted '.*f'"):
        pf.jit(f, backend="eager")(torch.zeros(3))
    torch.manual_seed(0)  # the generator still works after a refused trace
    torch.rand(1)


def test_op_fx_cannot_print_is_a_tracing_error():
    with pytest.raises(pf.TracingError, match=r"random_\.from"):
        pf.jit(lambda x: x + torch.empty(3).random_(0, 7), backend="eager")(torch.zeros(3))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_donating_a_buffer_the_step_captures_is_refused(backend):
    w = torch.randn(4, 4)

    def step(p, x):
        return p - 0.1 * (p @ x), (w @ x).sum()

    with pytest.raises(pf.DonationError, match="shares its buffer with a tensor the step captures"):
        pf.jit(step, donate_argnums=0, backend=backend)(w.view(4, 4), torch.randn(4, 4))
    p, _ = pf.jit(step, donate_argnums=0, backend=backend)(w.clone(), torch.eye(4))  # a copy is fine
    torch.testing.assert_close(p, w * 0.9)


def test_library_code_formatting_a_traced_tensor_gets_torchs_own_error():
    # torch's Tensor.__repr__ passes tensor_contents= back to itself; pt3func's print guard refused the keyword
    # (a TypeError) where a library (optree's structure-mismatch message) formatted a tensor.
    params = {"w": torch.ones(4), "pos": torch.arange(4)}  # an int buffer in the optimised tree
    opt = pf.optim.adamw(1e-3)

    def step(p, s):
        g = pf.grad(lambda p: (p["w"] * p["pos"]).sum())(p)
        return opt.update(g, s, p)

    with pytest.raises(ValueError, match="Expected None, got FakeTensor"):
        pf.jit(step, backend="eager")(params, opt.init(params))
