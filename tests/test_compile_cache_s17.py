"""Inductor's FX graph cache serves pt3func's programs (session 17): before, every compile bypassed it."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

import pt3func as pf


def _step(params: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss, grads = pf.value_and_grad(lambda p: torch.tanh(x @ p["w"] + p["b"]).square().mean())(params)
    return loss, pf.tree.map(lambda p, g: p - 0.1 * g, params, grads)


_OPT = pf.optim.adamw(1e-2)  # its constants are what Inductor's folding failed on, on meta values


def _meta_step(p: torch.Tensor, state: tuple, x: torch.Tensor, lr: torch.Tensor | float = 1.0) -> tuple:
    g = pf.grad(lambda p: (x @ p).pow(2).mean())(p)
    updates, state = _OPT.update(g, state, p)
    return pf.optim.apply_updates(p, pf.tree.map(lambda u: u * lr, updates)), state


def _meta_args() -> tuple:
    p = torch.randn(8, 3, device="meta")
    return p, _OPT.init(p), torch.randn(4, 8, device="meta")


def test_a_program_compiled_again_comes_from_inductors_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold cache of this test's own
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    x = torch.randn(4, 5)
    before = dict(counters["inductor"])

    first = pf.jit(_step, backend="inductor")(params, x)
    second = pf.jit(_step, backend="inductor")(params, x)  # another Jitted: its own trace, the same program

    def delta(name: str) -> int:
        return counters["inductor"][name] - before.get(name, 0)

    assert delta("fxgraph_cache_bypass") == 0
    assert delta("fxgraph_cache_miss") == 1
    assert delta("fxgraph_cache_hit") == 1
    eager = _step(params, x)
    for out in (first, second):
        torch.testing.assert_close(out, eager)


def test_cached_program_keeps_static_shapes_and_its_analysis(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile's ShapeEnv stays empty (another batch size is another program, not a symbolic one), and a
    program from the cache has the generated code and memory analysis of a fresh compile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    step = pf.jit(_step, backend="inductor")
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    for rows in (4, 6, 4):
        x = torch.randn(rows, 5)
        torch.testing.assert_close(step(params, x), _step(params, x))
    assert step.trace_count() == 2

    x = torch.randn(6, 5)
    fresh = step.lower(params, x).compile()
    cached = pf.jit(_step, backend="inductor").lower(params, x).compile()
    assert cached.generated_code() is not None
    assert cached.generated_code() == fresh.generated_code()
    assert re.search(r"\bs\d+\b", fresh.generated_code()) is None  # no symbolic size (s0, s1, ...)
    assert cached.memory_analysis() == fresh.memory_analysis()


def test_a_step_over_meta_tensors_runs_under_the_default_backend() -> None:
    """A shape-only dry run: Inductor's constant folding failed on meta values (torch's, `torch.compile` too)."""
    args = _meta_args()
    new_p, new_state = pf.jit(_meta_step)(*args)
    want_p, want_state = _meta_step(*args)
    assert new_p.device.type == "meta" and new_p.shape == want_p.shape
    assert [t.shape for t in pf.tree.leaves(new_state)] == [t.shape for t in pf.tree.leaves(want_state)]


def test_meta_dry_run_with_a_cpu_scalar_argument_runs() -> None:
    """A 0-d CPU tensor (a learning rate) mixes with meta tensors: still a dry run, not a program for Inductor."""
    out, _ = pf.jit(_meta_step)(*_meta_args(), torch.tensor(0.5))
    assert out.device.type == "meta" and out.shape == (8, 3)


def test_programs_without_pt3func_ops_get_the_loop_split_guard(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's C++ loop split miscompiles `i // d` indexing over a loop d does not divide (torch's bug; see
    `_compat.guard_inductor_cpu_loop_split`). The guard was installed only by programs with pt3func's own ops, so a
    plain program compiled before any of those (or served from the cache) came out wrong."""
    from torch._inductor.codegen import cpp

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    current = cpp.CppScheduling.try_loop_split
    if getattr(current, "pt3func_guarded", False):  # installed by an earlier test: take it off for this one
        cells = dict(zip(current.__code__.co_freevars, current.__closure__))
        monkeypatch.setattr(cpp.CppScheduling, "try_loop_split", cells["original"].cell_contents)

    def f(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (a.view(-1, 256) * s[:, None]).reshape(-1)[:1000] * 3

    a, s = torch.randn(1024), torch.randn(4)
    torch.testing.assert_close(pf.jit(f, backend="inductor")(a, s), f(a, s))


def test_meta_dry_run_of_a_donating_step_runs() -> None:
    """Every meta tensor's data_ptr is 0: the donation overlap check took distinct meta tensors for one buffer."""
    out, _ = pf.jit(_meta_step, donate_argnums=(0, 1))(*_meta_args())
    assert out.device.type == "meta" and out.shape == (8, 3)
