"""Trace capture fixes (session 16): escaped traced values, anomaly mode, a user's nn.Module.train patch, captured
tensors changed after the first call."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pt3func as pf
from pt3func.errors import TracingError


def test_value_escaped_through_a_hook_raises_when_used():
    """A forward hook storing its output (notebook activation inspection) kept the trace's FakeTensor: `a.sum()`
    gave another FakeTensor and `float(a.mean())` raised torch's GuardOnDataDependentSymNode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    params, apply = pf.functionalize(model)
    acts = {}
    handle = model[1].register_forward_hook(lambda m, i, o: acts.__setitem__("relu", o))
    x = torch.randn(5, 3)
    try:
        loss = pf.jit(lambda p, x: apply(p, x).sum())(params, x)
        escaped = acts["relu"]
        assert escaped.shape == (5, 4)  # metadata stays readable
        for use in (lambda: escaped.sum(), lambda: float(escaped.mean()), lambda: escaped[0, 0].item(),
                    lambda: escaped + torch.ones(5, 4)):
            with pytest.raises(TracingError, match="escaped from inside jitted .* only exists during tracing"):
                use()
        # the step itself is unaffected, and eager calls of the model store real values again
        torch.testing.assert_close(loss, apply(params, x).sum())
        torch.testing.assert_close(acts["relu"].sum(), torch.relu(model[0](x)).sum())
    finally:
        handle.remove()


def test_trace_in_an_outer_fake_mode_leaves_that_mode_alone():
    """Only the trace's own fake mode is closed: fake tensors of a mode the user made keep working."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        a = torch.ones(3)
    pf.jit(lambda x: x * 2)(torch.ones(3))
    assert (a + 1).shape == (3,)


def test_grad_under_anomaly_detection_traces_and_restores_the_mode(monkeypatch):
    """Anomaly mode's NaN checks read values: pf.jit(pf.grad(loss)) failed with a DataDependentControlFlowError."""
    from pt3func.trace import capture

    monkeypatch.setattr(capture, "_warned_anomaly", False)

    def loss(w, x):
        return (w * x).sum()

    w, x = torch.randn(3), torch.randn(3)
    torch.autograd.set_detect_anomaly(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g = pf.jit(pf.grad(loss))(w, x)
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    finally:
        torch.autograd.set_detect_anomaly(False)
    torch.testing.assert_close(g, torch.func.grad(loss)(w, x))
    ours = [c for c in caught if "anomaly" in str(c.message)]
    assert len(ours) == 1 and "does not run inside a compiled program" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the call of the jitted step


def test_user_patch_of_module_train_is_kept_and_called():
    """module_modes saved nn.Module.train at import: a later patch was bypassed while tracing and reverted after."""
    original = nn.Module.train
    calls = []

    def patched(self, mode=True):
        calls.append(mode)
        return original(self, mode)

    model = nn.Linear(3, 3)

    def step(x):
        model.train()
        return model(x)

    nn.Module.train = patched
    try:
        out = pf.jit(step)(torch.randn(2, 3))
        assert nn.Module.train is patched
        assert calls  # the step's model.train() went through the user's patch
        assert out.shape == (2, 3)
    finally:
        nn.Module.train = original
    pf.jit(step)(torch.randn(2, 3))
    assert nn.Module.train is original


@pytest.mark.parametrize("change", ["double", "bigger_weight"])
def test_captured_tensor_changed_after_first_call_names_it(change):
    """A closure model changed after the first call: Inductor read a float64 weight as float32 (silent garbage) or
    failed with an assertion about a fake kernel; now the call names the captured tensor, old -> new."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3, bias=False)
    x = torch.randn(6, 4)

    def step(x):
        return x * 1.0 @ lin.weight.t().to(x.dtype) if change == "double" else lin(x)

    jitted = pf.jit(step)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), step(x))
        lin.weight.add_(1.0)  # in-place value changes are read by the program
        torch.testing.assert_close(jitted(x), step(x))
        lin.weight.data = torch.randn(3, 4)  # so is a new buffer of the same layout
        torch.testing.assert_close(jitted(x), step(x))
        if change == "double":
            lin.double()
            expected = r"float32\[3, 4\] on cpu to float64\[3, 4\] on cpu"
        else:
            lin.weight.data = torch.randn(5, 4)
            expected = r"float32\[3, 4\] on cpu to float32\[5, 4\] on cpu"
        with pytest.raises(TracingError, match="captures from outside.*" + expected):
            jitted(x)
        with pytest.raises(TracingError, match="test_capture_s16.py"):  # where the step uses it
            jitted(x)
