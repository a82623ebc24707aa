"""pf.jit's argument spec: an nn.Module's forward signature, names that go into **kwargs, and errors that name the
culprit briefly (trace/signature.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import pt3func as pf
from pt3func.runtime.donated import is_donated
from pt3func.trace.signature import ArgSpec, check_hashable


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, n: int = 2) -> torch.Tensor:
        assert isinstance(n, int)  # static: a Python int, not a traced 0-d tensor
        return self.lin(x[:n])


def test_module_static_argnames_use_forwards_signature():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 3)
    step = pf.jit(net, static_argnames="n", backend="eager")
    with torch.no_grad():
        for n in (3, 2, 3):
            torch.testing.assert_close(step(x, n=n), net(x, n))
    assert step.trace_count() == 2  # one program per value of n
    with torch.no_grad():
        torch.testing.assert_close(step(x=x, n=2), net(x, 2))  # x by keyword: bound to forward's x


def test_module_negative_static_argnums_counts_forwards_parameters():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 3)
    step = pf.jit(net, static_argnums=-1, backend="eager")  # n
    with torch.no_grad():
        for n in (3, 2, 3):
            torch.testing.assert_close(step(x, n), net(x, n))
        assert step.trace_count() == 2
        torch.testing.assert_close(step(x, n=3), net(x, 3))  # the same parameter by keyword: static too


def test_module_donate_argnames_invalidates_the_donated_input():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3))

    class Res(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = net

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + self.inner(y)

    model = Res()
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    with torch.no_grad():
        expected = model(x, y)
        x_in = x.clone()
        got = pf.jit(model, donate_argnames="x", backend="eager")(y=y, x=x_in)
    torch.testing.assert_close(got, expected)
    assert is_donated(x_in) and not is_donated(y)


def test_module_keyword_order_does_not_retrace():
    class Two(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * 2 + b

    model = Two()
    a, b = torch.randn(3), torch.randn(3)
    step = pf.jit(model, backend="eager")
    torch.testing.assert_close(step(a=a, b=b), model(a=a, b=b))
    torch.testing.assert_close(step(b=b, a=a), model(a=a, b=b))
    assert step.trace_count() == 1  # as pf.jit(model.forward): forward has no **kwargs to iterate


def test_module_unknown_name_is_refused_by_type_name_not_repr():
    with pytest.raises(ValueError, match=r"^_Net has no parameter named 'm'$"):
        pf.jit(_Net(), static_argnames="m")


def _no_wraps(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # no functools.wraps: signature (*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def test_static_argname_going_into_kwargs_is_static():
    seen: list[Any] = []

    @_no_wraps
    def f(x: torch.Tensor, *, n: int) -> torch.Tensor:
        seen.append(type(n))
        return x[:n].sum(0)  # a traced n here would be a data-dependent slice bound

    x = torch.randn(4, 3)
    step = pf.jit(f, static_argnames="n", backend="eager")
    for n in (2, 3, 2):
        torch.testing.assert_close(step(x, n=n), x[:n].sum(0))
    assert step.trace_count() == 2  # a new value retraces, the same one does not
    assert set(seen) == {int}


def test_donate_argname_going_into_kwargs_is_donated():
    @_no_wraps
    def f(x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y

    x, y = torch.randn(3), torch.randn(3)
    expected = x * 2 + y
    x_in = x.clone()
    got = pf.jit(f, donate_argnames="x", backend="eager")(x=x_in, y=y)
    torch.testing.assert_close(got, expected)
    assert is_donated(x_in) and not is_donated(y)


def test_unknown_name_still_refused_without_kwargs():
    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match=r"^f has no parameter named 'm'$"):
        pf.jit(f, static_argnames="m")


def test_argspec_errors_name_a_partial_by_its_function_not_its_bound_values():
    big = torch.randn(50, 50)

    def p(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    with pytest.raises(ValueError) as info:
        pf.jit(functools.partial(p, big), static_argnums=3)
    message = str(info.value)
    assert message == "static_argnums=[3] but partial(p) takes 1 positional arguments (w)"


def test_unhashable_static_argument_names_parameter_and_function():
    def f(x: torch.Tensor, cfg: Any) -> torch.Tensor:
        return x * len(cfg)

    spec = ArgSpec.build(f, 1, (), (), ())
    static = (((1, [1, 2]),), (("opts", {"a": 1}),))
    with pytest.raises(pf.TracingError) as info:
        check_hashable(static, lambda: [], spec)
    message = str(info.value)
    assert message.startswith("f: static arguments cfg (unhashable type: 'list'), opts (unhashable type: 'dict')")
    check_hashable((((1, (1, 2)),), ()), lambda: [], spec)  # hashable: no error


def test_unhashable_static_argument_through_jit_names_the_argument():
    def f(x: torch.Tensor, cfg: Any) -> torch.Tensor:
        return x * len(cfg)

    with pytest.raises(pf.TracingError, match=r"f: static argument cfg \(unhashable type: 'list'\)"):
        pf.jit(f, static_argnums=1, backend="eager")(torch.ones(2), [1, 2])
