"""pf.jit call semantics: wrapped jitted functions, grad of jit, dict order in the cache key, argnums checks,
in_shardings for keyword arguments, errors inside a trace (backward, data-dependent reads in a sharded step)."""

from __future__ import annotations

import functools
from collections import OrderedDict, defaultdict

import pytest
import torch

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION


def _loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((x @ w) ** 2).mean()


def test_jit_of_grad_of_jit_returns_the_gradient():
    w, x = torch.randn(3), torch.randn(5, 3)
    want = torch.func.grad(_loss)(w, x)
    got = pf.jit(pf.grad(pf.jit(_loss)), backend="eager")(w, x)
    torch.testing.assert_close(got, want)


def test_jit_of_a_wraps_decorator_around_jit_runs_the_decorator():
    inner = pf.jit(_loss, backend="eager")

    @functools.wraps(inner)
    def times_ten(w, x):
        return inner(w, x) * 10

    w, x = torch.randn(3), torch.randn(5, 3)
    torch.testing.assert_close(pf.jit(times_ten, backend="eager")(w, x), _loss(w, x) * 10)


def test_jit_keeps_a_users_attributes_of_the_function():
    def f(a):
        return a + 1

    f.tag = "mine"
    assert pf.jit(f).tag == "mine"


def test_jit_of_jit_keeps_its_own_donation():
    f = pf.jit(lambda a: a + 1, backend="eager")
    a = torch.randn(4)
    pf.jit(f, donate_argnums=0, backend="eager")(a)
    assert pf.runtime.donated.is_donated(a)  # donated: unreadable


def _stack_values(d):
    return torch.stack(list(d.values()))


@pytest.mark.parametrize("first, second", [
    ({"b": torch.ones(2), "a": torch.zeros(2)}, {"a": torch.zeros(2), "b": torch.ones(2)}),
    (OrderedDict(b=torch.ones(2), a=torch.zeros(2)), OrderedDict(a=torch.zeros(2), b=torch.ones(2))),
])
def test_dict_key_order_is_part_of_the_signature(first, second):
    step = pf.jit(_stack_values, backend="eager")
    torch.testing.assert_close(step(first), _stack_values(first))
    torch.testing.assert_close(step(second), _stack_values(second))  # right after: the fast path
    torch.testing.assert_close(step(first), _stack_values(first))


def test_dict_type_and_default_factory_are_part_of_the_signature():
    step = pf.jit(lambda d: (type(d) is OrderedDict) * d["a"] + 1, backend="eager")
    a = torch.ones(2)
    torch.testing.assert_close(step({"a": a}), a * 0 + 1)
    torch.testing.assert_close(step(OrderedDict(a=a)), a * 1 + 1)
    ident = pf.jit(lambda d: d, backend="eager")
    assert ident(defaultdict(list, a=a)).default_factory is list
    assert ident(defaultdict(int, a=a)).default_factory is int


def test_explain_cache_misses_names_the_dict_order(caplog, monkeypatch):
    monkeypatch.setattr(pf.config, "explain_cache_misses", True)
    step = pf.jit(_stack_values, backend="eager")
    a, b = torch.zeros(2), torch.ones(2)
    step({"a": a, "b": b})
    with caplog.at_level("WARNING", logger="pt3func"):
        step({"b": b, "a": a})
    assert "key order or type of a dict" in caplog.text and step.trace_count() == 2


def test_keyword_only_argument_under_per_argument_in_shardings():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)

    def step(w, *, batch):
        return batch * w

    with pf.set_mesh(mesh):
        # no entry for it: a missing prefix, kept as it is (a plain tensor: replicated)
        out = pf.jit(step, in_shardings=(P(),), backend="eager")(torch.ones(4), batch=torch.ones(8, 4))
        torch.testing.assert_close(pf.device_get(out), torch.ones(8, 4))
        # an entry meant for it has no position to go to
        with pytest.raises(pf.ShardingError, match="2 entries but the call passes 1 arguments"):
            pf.jit(step, in_shardings=(P(), P("dp")), backend="eager")(torch.ones(4), batch=torch.ones(8, 4))


def test_kwargs_order_is_part_of_the_signature():
    def f(**kw):
        return torch.stack(list(kw.values()))

    step = pf.jit(f, backend="eager")
    a, b = torch.zeros(2), torch.ones(2)
    torch.testing.assert_close(step(a=a, b=b), f(a=a, b=b))
    torch.testing.assert_close(step(b=b, a=a), f(b=b, a=a))


def test_backward_inside_a_step_is_refused_at_the_users_line():
    model = torch.nn.Linear(3, 1)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        return loss.detach()

    with pytest.raises(pf.ImpureFunctionError, match=r"test_jit_calls.py:\d+.*backward\(\).*pf.grad"):
        pf.jit(step, backend="eager")(torch.randn(4, 3))
    assert model.weight.grad is None


@pytest.mark.parametrize("options, match", [
    ({"donate_argnums": -5}, "donate_argnums -5 is out of range"),
    ({"static_argnums": (-3,)}, "static_argnums -3 is out of range"),
    ({"donate_argnums": ("params",)}, "donate_argnums must hold ints.*donate_argnames"),
    ({"donate_argnums": 0.0}, "donate_argnums must be an int"),
    ({"static_argnums": [None]}, "static_argnums must hold ints"),
])
def test_bad_argnums_name_the_option_and_function(options, match):
    def step(params, batch):
        return params * batch

    with pytest.raises(ValueError, match=match) as info:
        pf.jit(step, **options)
    assert "step" in str(info.value)


def test_negative_argnums_in_range_still_work():
    step = pf.jit(lambda a, n: a * n, static_argnums=-1, backend="eager")
    torch.testing.assert_close(step(torch.ones(2), 3), torch.full((2,), 3.0))


def test_in_shardings_apply_to_keyword_arguments():
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)

    def step(w, batch):
        return batch * w

    w, batch = torch.ones(4), torch.randn(8, 4)
    with pf.set_mesh(mesh):
        ref = pf.jit(step, in_shardings=(P(), P("dp")), backend="eager")(w, batch)
        for shardings, call in [((P(), P("dp")), lambda j: j(w, batch=batch)),
                                (P("dp"), lambda j: j(w, batch=batch)),
                                ((P(), P("dp")), lambda j: j(w=w, batch=batch))]:
            out = call(pf.jit(step, in_shardings=shardings, backend="eager"))
            if shardings == P("dp"):  # w split too: the batch dim of the output still follows dp
                assert pf.sharding_of(out).spec[0] == "dp" or pf.sharding_of(out).spec[-1] == "dp"
            else:
                assert pf.sharding_of(out) == pf.sharding_of(ref)
            torch.testing.assert_close(pf.device_get(out), batch * w)


@pytest.mark.parametrize("body", [
    lambda x: x * x.mean().item(),
    lambda x: x * max(x.mean(0).tolist()),
    pytest.param(lambda x: x[x > 0].sum(), marks=pytest.mark.skipif(
        TORCH_VERSION < (2, 13), reason="torch 2.11's DTensor indexes the block with the global mask (IndexError)")),
    lambda x: x.nonzero().float().sum(),
])
def test_data_dependent_reads_in_a_sharded_step_name_the_line(body):
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh), pytest.raises(pf.DataDependentControlFlowError, match=r"test_jit_calls.py:\d+"):
        pf.jit(body, in_shardings=P("dp"), backend="eager")(torch.randn(8, 4))


def test_grad_of_jit_is_refused_with_the_way_out():
    # Its program runs without autograd: the gradient through it was silently zero.
    w, x = torch.randn(3), torch.randn(5, 3)
    step = pf.jit(_loss, backend="eager")
    step(w, x)  # a cached program too
    with pytest.raises(pf.TracingError, match=r"pf.grad\(pf.jit\(f\)\).*pf.jit\(pf.grad\(f\)\)"):
        pf.grad(step)(w, x)
    torch.testing.assert_close(pf.jit(pf.grad(_loss), backend="eager")(w, x), torch.func.grad(_loss)(w, x))


def test_inputs_that_require_grad_still_compile_and_warn_once():
    w, x = torch.randn(3, requires_grad=True), torch.randn(5, 3)
    step = pf.jit(_loss, backend="eager")
    with pytest.warns(UserWarning, match="outputs carry no autograd graph"):
        out = step(w, x)
    step(w, x)
    assert step.trace_count() == 1 and not out.requires_grad
    torch.testing.assert_close(out, _loss(w.detach(), x))


def test_lower_after_call_is_no_cache_miss_and_shows_the_lowered_program(monkeypatch, caplog):
    j = pf.jit(lambda x: x.reshape(2, 3).t() * 2, backend="eager")
    x = torch.randn(6)
    before = j.lower(x).as_text()
    j(x)
    monkeypatch.setattr(pf.config, "explain_cache_misses", True)
    with caplog.at_level("WARNING"):
        lowered = j.lower(x)
    assert "tracing again" not in caplog.text  # it said "static arguments changed: ((), ())"
    assert lowered.as_text() == before  # not the compiled program's graph, which its backend rewrote
    torch.testing.assert_close(lowered.compile()(x), x.reshape(2, 3).t() * 2)


def test_empty_tensors_with_other_strides_share_a_program():
    k = pf.jit(lambda x: x * 2, backend="eager")
    k(torch.randn(0, 4))
    out = k(torch.randn(4, 0).t())
    assert k.trace_count() == 1 and out.shape == (0, 4)


def test_out_shardings_not_fitting_a_namedtuple_output_is_a_sharding_error():
    from collections import namedtuple

    NT = namedtuple("NT", "mu nu")
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh), pytest.raises(pf.ShardingError, match="out_shardings"):
        pf.jit(lambda a: NT(a, a * 2), out_shardings=(P("dp"), P()), backend="eager")(torch.randn(4, 2))


def test_pprint_of_a_traced_tensor_is_refused_at_the_users_line():
    import pprint

    def step(x):
        y = x * 2
        pprint.pprint(y)  # formats through the standard library, not the user's own call
        return y

    refused = r"test_jit_calls.py:\d+ `pprint.pprint\(y\).*printing or formatting"
    with pytest.raises(pf.ImpureFunctionError, match=refused):
        pf.jit(step, backend="eager")(torch.randn(3))


def test_keyword_order_of_named_parameters_and_fresh_lambda_factories_share_a_program():
    step = pf.jit(lambda a, b: a - b, backend="eager")
    x, y = torch.ones(2), torch.zeros(2)
    torch.testing.assert_close(step(a=x, b=y), x - y)
    torch.testing.assert_close(step(b=y, a=x), x - y)
    f = pf.jit(lambda d: d["k"] * 2, backend="eager")
    for _ in range(3):
        f(defaultdict(lambda: 0, k=torch.ones(2)))  # a factory made anew each call
    assert step.trace_count() == 1 and f.trace_count() == 1
