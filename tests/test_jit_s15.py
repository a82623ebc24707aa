"""pf.jit behaviour fixed in session 15: module modes in the signature, methods, copies, names, and errors."""

from __future__ import annotations

import copy
import functools
import logging
import pickle
import warnings

import pytest
import torch
from torch import nn

import pt3func as pf
from pt3func import P


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))


@pytest.mark.parametrize("first", ["train", "eval"])
def test_module_mode_change_retraces_and_keeps_both_programs(first: str) -> None:
    model = _dropout_model()
    params, apply = pf.functionalize(model)
    x = torch.randn(16, 4)
    loss = pf.jit(lambda p, x: apply(p, x).square().mean(), backend="eager")
    modes = ["train", "eval", "train", "eval"] if first == "train" else ["eval", "train", "eval", "train"]
    for mode in modes:
        getattr(model, mode)()
        torch.manual_seed(1)
        got = loss(params, x)
        torch.manual_seed(1)
        want = apply(params, x).square().mean()
        torch.testing.assert_close(got, want)
    assert loss.trace_count() == 2  # one program per mode, both kept


def test_closure_module_mode_is_part_of_the_signature() -> None:
    drop = nn.Dropout(0.5)
    step = pf.jit(lambda x: drop(x).sum(), backend="eager")
    x = torch.ones(64)
    assert float(step(x)) != 64.0  # training: some elements dropped, the rest scaled
    drop.eval()
    assert float(step(x)) == 64.0


@pytest.mark.usefixtures("explain_misses")
def test_mode_change_is_explained(caplog: pytest.LogCaptureFixture) -> None:
    model = _dropout_model()
    params, apply = pf.functionalize(model)
    loss = pf.jit(lambda p, x: apply(p, x).sum(), backend="eager")
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, "pt3func.jit"):
        loss(params, x)
        model.eval()
        loss(params, x)
    assert "the mode of modules the step calls changed (Sequential, Linear, Dropout): train -> eval" in caplog.text


class _Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    @functools.partial(pf.jit, static_argnums=0, backend="eager")
    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k

    @pf.jit
    def shift(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.k


def test_jitted_methods_bind_their_instance() -> None:
    x = torch.arange(3.0)
    torch.testing.assert_close(_Scaler(2.0).scale(x), x * 2)
    torch.testing.assert_close(_Scaler(3.0).scale(x), x * 3)  # another instance: another static value
    torch.testing.assert_close(_Scaler(1.0).shift(x), x + 1)
    assert isinstance(_Scaler.__dict__["scale"], pf.Jitted) and _Scaler.scale is _Scaler.__dict__["scale"]


@pf.jit
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_copies_and_pickles_of_a_jitted_function() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.step = _double
            self.weights = torch.ones(2)

    trainer = Trainer()
    trainer.step(torch.ones(1))  # a compiled program (and a thread-local memo) inside
    snapshot = copy.deepcopy(trainer)
    assert snapshot.step is _double and snapshot.weights is not trainer.weights
    assert pickle.loads(pickle.dumps(_double)) is _double
    torch.testing.assert_close(snapshot.step(torch.ones(1)), torch.full((1,), 2.0))


def test_partial_is_named_by_its_function(caplog: pytest.LogCaptureFixture) -> None:
    def f(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return table[x]

    step = pf.jit(functools.partial(f, torch.randn(100, 100)), backend="eager")
    assert step.name.startswith("partial(") and "f" in step.name and len(step.name) < 80


@pytest.mark.usefixtures("explain_misses")
def test_trace_count_and_explanations_on_a_virtual_mesh_count_once(caplog: pytest.LogCaptureFixture) -> None:
    mesh = pf.make_mesh((4,), ("dp",), virtual=True)
    step = pf.jit(lambda w, x: (x @ w).sum(), in_shardings=(P(), P("dp")), backend="eager")
    with pf.set_mesh(mesh), \
            caplog.at_level(logging.WARNING, "pt3func.jit"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = pf.device_put(torch.randn(16, 8), P())
        for _ in range(3):
            step(w, torch.randn(32, 16))
        assert step.trace_count() == 1
        step(w, torch.randn(64, 16))
        assert step.trace_count() == 2
    assert caplog.text.count("tracing for the first time") == 1
    assert caplog.text.count("tracing again because") == 1


def test_vmap_of_a_jitted_function_is_refused_clearly() -> None:
    def f(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return s * 0.9 + x.sum()

    for donate in ((), (0,)):
        with pytest.raises(pf.TracingError, match=r"pf\.jit\(pf\.vmap\(f\)\)"):
            pf.vmap(pf.jit(f, donate_argnums=donate))(torch.randn(4, 3), torch.randn(4, 3))
    torch.testing.assert_close(
        pf.jit(pf.vmap(f))(torch.ones(4, 3), torch.ones(4, 3)), torch.full((4, 3), 3.9)
    )


def test_a_donated_argument_passed_again_is_named() -> None:
    def step(params: dict, x: torch.Tensor) -> tuple:
        return {k: v - 0.1 * x.sum() for k, v in params.items()}, x.sum()

    params = {"w": torch.randn(3), "b": torch.randn(3)}
    s = pf.jit(step, donate_argnums=0, backend="eager")
    new, _ = s(params, torch.randn(2))
    with pytest.raises(pf.DonationError, match=r"argument params\['w'\] was donated"):
        s({"w": params["w"], "b": new["b"]}, torch.randn(2))


def test_donated_keyword_arguments_keep_their_outputs_layout() -> None:
    opt = pf.optim.adam(1e-2)

    def step(params: dict, opt_state: object, x: torch.Tensor) -> tuple:
        loss, g = pf.value_and_grad(lambda p, x: ((x @ p["w"]).tanh() ** 2).mean())(params, x)
        u, opt_state = opt.update(g, opt_state, params)
        return pf.optim.apply_updates(params, u), opt_state, loss

    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    layouts = {}
    with pf.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped donation warns
        for by_keyword in (False, True):
            torch.manual_seed(0)
            params = pf.device_put({"w": torch.randn(4, 6)}, P())
            state = pf.jit(opt.init, backend="eager")(params)
            state = pf.device_put(state, pf.tree.map(lambda t: None if t.ndim == 0 else P("dp"), state))
            x = pf.device_put(torch.randn(8, 4), P("dp"))
            j = pf.jit(step, donate_argnums=(0, 1), backend="eager")
            out = j(params=params, opt_state=state, x=x) if by_keyword else j(params, state, x)
            layouts[by_keyword] = tuple(out[0]["w"].placements)
    assert layouts[True] == layouts[False]


def test_lower_keeps_no_argument_alive() -> None:
    import gc

    def storage_alive(ptr: int) -> bool:
        gc.collect()
        for o in gc.get_objects():
            if type(o) in (torch.Tensor, torch.nn.Parameter):  # not fake tensors a trace may keep
                try:
                    if o.untyped_storage().data_ptr() == ptr:
                        return True
                except NotImplementedError:  # a functorch wrapper an earlier test's torch.compile kept: no storage
                    continue
        return False

    step = pf.jit(lambda w, x: (x @ w).sum(), backend="eager")
    w = torch.randn(8, 4)
    x = torch.randn(16, 8)
    lowered = step.lower(w, x)
    ptr = x.data_ptr()
    del x
    assert not storage_alive(ptr)  # the lowered program keeps shapes, not the batch
    torch.testing.assert_close(lowered.compile()(w, torch.ones(16, 8)), (torch.ones(16, 8) @ w).sum())


def test_a_torch_compiled_model_inside_a_step_is_traced_through() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    params, apply = pf.functionalize(torch.compile(model))
    loss, _ = pf.jit(pf.value_and_grad(lambda p: nn.functional.mse_loss(apply(p, x), y)), backend="eager")(params)
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y))


def test_distribution_validation_names_validate_args() -> None:
    def step(p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=x @ p["w"], validate_args=True).entropy().mean()

    with pytest.raises(pf.DataDependentControlFlowError, match="validate_args=False"):
        pf.jit(step, backend="eager")({"w": torch.randn(4, 3)}, torch.randn(5, 4))
    want = torch.distributions.Categorical(logits=torch.ones(5, 3)).entropy().mean()
    got = pf.jit(lambda p, x: torch.distributions.Categorical(logits=x @ p["w"], validate_args=False).entropy().mean(),
                 backend="eager")({"w": torch.ones(4, 3)}, torch.ones(5, 4) / 4)
    torch.testing.assert_close(got, want)


def test_a_jitted_forward_reading_self_training_retraces_on_eval() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        @functools.partial(pf.jit, backend="eager")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x @ self.w, 0.5, self.training)

    torch.manual_seed(0)
    m, x = Block(), torch.randn(3, 4)
    with torch.no_grad():
        m(x)
        m.eval()
        torch.testing.assert_close(m(x), x @ m.w)


def test_modules_made_or_set_by_the_step_do_not_retrace() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))

    def fresh_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.CrossEntropyLoss()(model(x), y)  # a module made at every trace

    def set_mode(x: torch.Tensor, train: bool) -> torch.Tensor:
        model.train(train)  # the step sets the mode from a static flag
        return model(x)

    fresh = pf.jit(fresh_loss, backend="eager")
    for n in (8, 5, 8, 5, 8, 5):
        fresh(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    assert fresh.trace_count() == 2
    by_flag = pf.jit(set_mode, static_argnames=("train",), backend="eager")
    x = torch.randn(3, 4)
    for i in range(6):
        by_flag(x, train=i % 2 == 0)
    assert by_flag.trace_count() == 2
    torch.testing.assert_close(by_flag(x, train=False), model.eval()(x))


def test_non_functions_are_not_bound_and_copy_as_themselves() -> None:
    class Holder:
        scaled = pf.jit(functools.partial(torch.mul, 2.0), backend="eager")
        neg = pf.jit(torch.neg, backend="eager")

    x = torch.ones(2)
    torch.testing.assert_close(Holder().scaled(x), 2 * x)
    torch.testing.assert_close(Holder().neg(x), -x)
    assert copy.copy(Holder.scaled) is Holder.scaled
    # Not by name (no module-level name points to it): rebuilt from the partial and the options (session 17).
    torch.testing.assert_close(pickle.loads(pickle.dumps(Holder.scaled))(x), 2 * x)


def test_a_jitted_helper_on_unbatched_values_inside_vmap_runs() -> None:
    table = torch.randn(3)
    helper = pf.jit(lambda t, o: t * o, backend="eager")
    got = torch.func.vmap(lambda x: (x * helper(table, torch.ones(3))).sum())(torch.ones(4, 3))
    torch.testing.assert_close(got, torch.full((4,), float(table.sum())))
