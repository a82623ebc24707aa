"""pf.jit behaviour fixed in session 16: the default dtype and the current mesh in the signature, a failed or
interrupted compile kept for the retry, lower() not counted as a miss, misspelt config settings refused."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import fx

import pt3func as pf
import pt3func.stages as stages
from pt3func import P


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.usefixtures("explain_misses")
def test_default_dtype_change_retraces_as_eager(caplog: pytest.LogCaptureFixture) -> None:
    def f(x: torch.Tensor, s: float) -> torch.Tensor:
        return x + torch.ones(3) * s  # torch.ones and the float's 0-d tensor take the default dtype

    jf = pf.jit(f, backend="eager")
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        assert jf(x, 2.0).dtype == torch.float32
        with _default_dtype(torch.float64):
            got, want = jf(x, 2.0), f(x, 2.0)
        again = jf(x, 2.0)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)
    assert again.dtype == torch.float32 and jf.trace_count() == 2  # back to float32: the first program again
    assert "default_dtype" in caplog.text and "float64" in caplog.text


@pytest.mark.usefixtures("explain_misses")
def test_strict_donation_refusal_then_retry_does_not_trace_again(caplog: pytest.LogCaptureFixture) -> None:
    def step(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (p * x).sum()  # no output can take p's buffer: an unused donation

    js = pf.jit(step, donate_argnums=0, backend="eager")
    p, x = torch.randn(4), torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        pf.config.strict_donation = True
        try:
            with pytest.raises(pf.DonationError):
                js(p, x)
        finally:
            pf.config.strict_donation = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = js(p, x)
    torch.testing.assert_close(got, step(p, x))
    assert js.trace_count() == 1
    assert "tracing again" not in caplog.text


@pytest.mark.usefixtures("explain_misses")
def test_interrupted_compile_is_retried_from_an_untouched_trace(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def step(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return p * x.sum()

    real = stages.compile_program

    def interrupted(gm: fx.GraphModule, examples: list, backend: str) -> object:
        # Ctrl-C part-way through the backend's in-place rewrites: the graph is left wrong (p * x.sum() -> p).
        monkeypatch.setattr(stages, "compile_program", real)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
        output.args = ([placeholder] * len(output.args[0]),)
        gm.recompile()
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "compile_program", interrupted)
    js = pf.jit(step, backend="eager")
    p, x = torch.randn(4), torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        with pytest.raises(KeyboardInterrupt):
            js(p, x)
        got = js(p, x)
    torch.testing.assert_close(got, step(p, x))
    assert js.trace_count() == 1
    assert "tracing again" not in caplog.text


def test_lower_of_a_called_signature_is_no_cache_miss() -> None:
    def step(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return p * x.sum()

    js = pf.jit(step, backend="eager")
    p, x = torch.randn(4), torch.randn(4)
    js(p, x)
    js(p, x)
    assert "mul" in js.lower(p, x).as_text()
    torch.testing.assert_close(js(p, x), step(p, x))
    assert js.trace_count() == 1
    js.lower(p, torch.randn(5))  # a new signature lowered: that one is a miss
    assert js.trace_count() == 2


def test_misspelt_config_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AttributeError, match="explain_cache_miss'.*did you mean 'explain_cache_misses'"):
        pf.config.explain_cache_miss = True
    assert not hasattr(pf.config, "explain_cache_miss")
    with pytest.raises(AttributeError, match="no setting 'zzz'"):
        pf.config.zzz = 1
    monkeypatch.setattr(pf.config, "strict_donation", True)  # the settings themselves, as tests set them
    assert pf.config.strict_donation is True


@pytest.mark.usefixtures("explain_misses")
def test_bare_out_shardings_follow_the_current_mesh(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.arange(8 * 4.0).reshape(8, 4)
    f = pf.jit(lambda v: v * 3, out_shardings=P("dp"), backend="eager")
    a = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    d = pf.make_mesh((4, 1), ("dp", "tp"), virtual=True)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        for mesh in (a, d, a):
            with pf.set_mesh(mesh):
                out = f(x)
            sharding = pf.sharding_of(out)
            assert sharding.mesh is mesh and sharding.spec == P("dp")
            torch.testing.assert_close(pf.device_get(out), x * 3)
    assert f.trace_count() == 2  # back on the first mesh: its program again
    assert "current mesh" in caplog.text


def test_named_out_shardings_keep_their_mesh_under_any_current_mesh() -> None:
    x = torch.arange(8 * 4.0).reshape(8, 4)
    a = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    f = pf.jit(lambda v: v * 3, out_shardings=pf.NamedSharding(a, P("dp")), backend="eager")
    for mesh in (None, a, None):  # a NamedSharding names its mesh, whichever is current
        with pf.set_mesh(mesh):
            out = f(x)
        assert pf.sharding_of(out).mesh is a
        torch.testing.assert_close(pf.device_get(out), x * 3)
    assert f.trace_count() == 1  # the step runs in the virtual mesh's rank threads, under that mesh each time


def _axis_numbers(x: torch.Tensor) -> torch.Tensor:
    return x * 0 + pf.lax.axis_size("dp") + 10 * pf.lax.axis_index("dp")


@pytest.mark.parametrize("inside", ["shard_map", "with_sharding_constraint"])
def test_steps_resolving_specs_through_the_current_mesh_trace_again_under_another(inside: str) -> None:
    # shard_map without mesh= and with_sharding_constraint(x, P(...)) read pf.set_mesh's mesh while traced: a call
    # under another mesh ran the first mesh's program (its process groups: an error on virtual meshes, the wrong
    # layout on real ones).
    if inside == "shard_map":
        step = pf.shard_map(_axis_numbers, in_specs=P("dp"), out_specs=P("dp"))
    else:
        def step(v: torch.Tensor) -> torch.Tensor:
            return pf.with_sharding_constraint(v * 2, P("dp"))
    f = pf.jit(step, backend="eager")
    x = torch.arange(8 * 2.0).reshape(8, 2)
    a = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    b = pf.make_mesh((4, 1), ("dp", "tp"), virtual=True)
    for mesh in (a, b, a):
        with pf.set_mesh(mesh):
            want = pf.device_get(pf.jit(step, backend="eager")(x))  # a fresh jit under this mesh
            out = f(x)
        assert pf.sharding_of(out).mesh is mesh
        torch.testing.assert_close(pf.device_get(out), want)
    assert f.trace_count() == 2


def test_compiled_under_another_default_dtype_names_the_trace_modes() -> None:
    compiled = pf.jit(lambda x: x + 1.0, backend="eager").lower(torch.zeros(2)).compile()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(pf.TracingError, match=r"trace modes .* changed: .*default_dtype"):
            compiled(torch.zeros(2))
    finally:
        torch.set_default_dtype(previous)
