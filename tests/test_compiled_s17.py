"""Session 17: a Compiled (`step.lower(...).compile()`) checks the whole signature a Jitted keys on (dicts' key
orders, module modes and hooks), the repeat-call fast path sees a mutated static value, jitted steps and Compiled
called from torch.compile run as opaque calls, a Compiled inside a traced step is refused, and a jitted method's
`.lower` binds its instance."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pt3func as pf


def _cat_values(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(d.values()))


def _cat_kwargs(**kw: torch.Tensor) -> torch.Tensor:
    return torch.cat(list(kw.values()))


def _named(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, b * 2])


def test_compiled_checks_the_key_order_of_dicts_and_kwargs() -> None:
    a, b = torch.arange(2.0), torch.arange(10.0, 13.0)
    compiled = pf.jit(_cat_values, backend="eager").lower({"a": a, "b": b}).compile()
    torch.testing.assert_close(compiled({"a": a, "b": b}), _cat_values({"a": a, "b": b}))
    with pytest.raises(pf.TracingError, match=r"key order .* \('a', 'b'\) -> \('b', 'a'\)"):
        compiled({"b": b, "a": a})  # ran the {"a", "b"} program: the values in the wrong order
    compiled = pf.jit(_cat_kwargs, backend="eager").lower(a=a, b=b).compile()
    with pytest.raises(pf.TracingError, match="key order"):
        compiled(b=b, a=a)
    # Named parameters are order-free, as for the Jitted.
    compiled = pf.jit(_named, backend="eager").lower(a=a, b=b).compile()
    torch.testing.assert_close(compiled(b=b, a=a), _named(a, b))


def test_compiled_checks_the_modes_and_hooks_of_the_modules_it_called() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).eval()
    x = torch.randn(8, 3)
    compiled = pf.jit(lambda x: model(x), backend="eager").lower(x).compile()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model.train()
        with pytest.raises(pf.TracingError, match=r"mode of modules the step calls changed .*eval -> train"):
            compiled(x)  # kept the eval program: no dropout
        model.eval()
        torch.testing.assert_close(compiled(x), model(x))
        handle = model[0].register_forward_hook(lambda m, i, o: o * 10)
        with pytest.raises(pf.TracingError, match="hooks of modules the step calls"):
            compiled(x)  # the program never ran the hook
        handle.remove()
        torch.testing.assert_close(compiled(x), model(x))


def test_compiled_checks_the_mode_of_a_static_module() -> None:
    torch.manual_seed(0)
    drop = nn.Dropout(0.5).eval()
    x = torch.randn(4, 3)

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, m.training)  # calls no module: only the static argument's mode tells

    compiled = pf.jit(step, static_argnums=0, backend="eager").lower(drop, x).compile()
    torch.testing.assert_close(compiled(drop, x), x)
    drop.train()
    with pytest.raises(pf.TracingError, match="module given as a static argument"):
        compiled(drop, x)


@dataclasses.dataclass(unsafe_hash=True)
class _Cfg:
    n: Any


@dataclasses.dataclass(unsafe_hash=True)
class _Net:
    n: int

    @pf.jit(backend="eager")
    def head_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x[: self.n].sum(0)


def _first_rows(x: torch.Tensor, cfg: _Cfg) -> torch.Tensor:
    return x[: cfg.n].sum(0)


def test_fast_path_sees_a_mutated_value_hashed_static() -> None:
    x = torch.arange(15.0).reshape(5, 3)
    step = pf.jit(_first_rows, static_argnums=1, backend="eager")
    cfg = _Cfg(2)
    torch.testing.assert_close(step(x, cfg), _first_rows(x, cfg))
    cfg.n = 4  # the same object, equal to itself: the last call's program ran (rows 0-1)
    torch.testing.assert_close(step(x, cfg), _first_rows(x, cfg))
    assert step.trace_count() == 2
    torch.testing.assert_close(step(x, cfg), _first_rows(x, cfg))  # and the fast path again
    assert step.trace_count() == 2
    cfg.n = [1]  # now unhashable: named as on any call
    with pytest.raises(pf.TracingError, match="hashable"):
        step(x, cfg)
    # A jitted method's `self` (a static leaf) mutated likewise.
    net = _Net(2)
    torch.testing.assert_close(net.head_sum(x), x[:2].sum(0))
    net.n = 4
    torch.testing.assert_close(net.head_sum(x), x[:4].sum(0))


def _sgd_step(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    loss, g = pf.value_and_grad(lambda p: F.mse_loss(x @ p["w"], y))(p)
    return {"w": p["w"] - 0.1 * g["w"]}, loss


def test_torch_compile_calls_a_donated_jitted_step_as_it_is() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    step = pf.jit(_sgd_step, donate_argnums=0, backend="eager")

    def body(p: dict[str, torch.Tensor]) -> Any:
        p, loss = step(p, x, y)
        return p, loss * 2

    compiled_body = torch.compile(body, backend="eager")
    p = {"w": torch.randn(8, 4)}
    ref = {"w": p["w"].clone()}
    for _ in range(3):
        p, loss = compiled_body(p)  # Dynamo traced into pt3func: a DonationError
        ref, ref_loss = _sgd_step(ref, x, y)
        torch.testing.assert_close(p["w"], ref["w"])
        torch.testing.assert_close(loss, ref_loss * 2)
    # A Compiled likewise.
    compiled = pf.jit(_sgd_step, backend="eager").lower(p, x, y).compile()
    got = torch.compile(lambda p: compiled(p, x, y)[1] + 1, backend="eager")(p)
    torch.testing.assert_close(got, _sgd_step(p, x, y)[1] + 1)


def test_a_compiled_inside_a_traced_step_is_refused() -> None:
    x = torch.randn(4, 3)
    compiled = pf.jit(torch.sin, backend="eager").lower(x).compile()
    with pytest.raises(pf.TracingError, match="Call the jitted function itself"):
        pf.jit(lambda x: compiled(x) * 2, backend="eager")(x)
    inner = pf.jit(torch.sin, backend="eager")  # the jitted function is inlined
    torch.testing.assert_close(pf.jit(lambda x: inner(x) * 2, backend="eager")(x), x.sin() * 2)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    @pf.jit(backend="eager")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's forward."""
        return self.lin(x)


def test_a_jitted_method_lowers_with_its_instance() -> None:
    torch.manual_seed(0)
    net, x = _Model(), torch.randn(4, 3)
    with torch.no_grad():
        expected = net.lin(x)
        compiled = net.forward.lower(x).compile()  # missing 1 required positional argument: 'x'
        torch.testing.assert_close(compiled(net, x), expected)
        torch.testing.assert_close(net(x), expected)
        assert net.forward.trace_count() == _Model.forward.trace_count() >= 1
        assert list(inspect.signature(net.forward).parameters) == ["x"]
        assert net.forward == net.forward and net.forward.__self__ is net and net.forward.__func__ is _Model.forward
        assert net.forward.__name__ == "forward"
        # Copies and pickles bind the copied instance, as a bound method's do.
        copied = copy.deepcopy(net.forward)
        assert copied.__self__ is not net and isinstance(copied.__self__, _Model)
        loaded = pickle.loads(pickle.dumps(net.forward))
        assert loaded.__self__ is not net
        for other in (copied.__self__, loaded.__self__):
            other.lin.weight.zero_()
        torch.testing.assert_close(copied(x), net.lin.bias.expand(4, 2))
        torch.testing.assert_close(loaded(x), net.lin.bias.expand(4, 2))
        torch.testing.assert_close(net(x), expected)  # the original is untouched
