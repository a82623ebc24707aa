"""Session 18: a jitted method's cache holds its instances weakly; `clear_cache()`; the many-signatures warning."""

import gc
import logging
import threading
import weakref

import pytest
import torch
import torch.nn as nn

import pt3func as pf
import pt3func.jitted as jitted_module
from pt3func import P
from pt3func.trace.signature import ModuleKey


def _net_class() -> type:
    """A class of its own per test: its jitted methods' caches start empty."""

    class _Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.big = nn.Parameter(torch.randn(64, 64), requires_grad=False)

        @pf.jit(backend="eager")
        def predict(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.big[:1, :8]

        @pf.jit(backend="eager", static_argnums=0)
        def predict_static(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * 2

    return _Net


def _dead(refs: list) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


def test_jitted_method_does_not_keep_its_instances_alive() -> None:
    # A fresh model per fold: each one and the parameters its program captured are freed once the caller drops it.
    _Net = _net_class()
    refs = []
    for _ in range(3):
        net = _Net().requires_grad_(False)
        x = torch.randn(2, 8)
        assert torch.equal(net.predict(x), net.lin(x) + net.big[:1, :8])
        net.predict(x)  # the fast path: its last call refers to this instance's program
        refs += [weakref.ref(net), weakref.ref(net.big)]
        del net
    assert _dead(refs)
    jitted = _Net.predict
    assert not jitted._cache and not jitted._lowered and not jitted._watches and not jitted._module_refs
    assert jitted.trace_count() == 3  # misses so far: dropping programs does not uncount them


def test_static_module_argument_is_held_weakly() -> None:
    _Net = _net_class()
    net = _Net().requires_grad_(False)
    x = torch.randn(2, 8)
    assert torch.equal(net.predict_static(x), net.lin(x) * 2)
    compiled = net.predict_static.lower(x).compile()
    assert torch.equal(compiled(net, x), net.lin(x) * 2)  # the Compiled checks its static module by identity
    with pytest.raises(pf.TracingError, match="static arguments changed"):
        compiled(_Net(), x)
    refs = [weakref.ref(net), weakref.ref(net.big)]
    del net, compiled
    assert _dead(refs)
    assert not _Net.predict_static._cache and not _Net.predict_static._lowered


def test_module_argument_of_a_function_is_held_weakly() -> None:
    @pf.jit(backend="eager")
    def apply(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    model = nn.Linear(4, 4).requires_grad_(False)
    apply(model, torch.randn(1, 4))
    refs = [weakref.ref(model), weakref.ref(model.weight)]
    del model
    assert _dead(refs)
    assert not apply._cache


def test_dead_module_key_equals_only_itself() -> None:
    model = nn.Linear(2, 2)
    key, again = ModuleKey(model), ModuleKey(model)
    assert key == again and hash(key) == hash(again) and key != ModuleKey(nn.Linear(2, 2))
    del model
    gc.collect()
    assert key == key and key != again  # a new module at the dead one's id must not find its programs


def test_each_thread_frees_its_last_program() -> None:
    _Net = _net_class()
    net = _Net().requires_grad_(False)
    worker = threading.Thread(target=net.predict, args=(torch.randn(2, 8),))  # run() drops its target
    worker.start()
    worker.join()
    net.predict(torch.randn(2, 8))
    refs = [weakref.ref(net), weakref.ref(net.big)]
    del net
    assert _dead(refs)


def test_clear_cache_traces_again() -> None:
    scale = {"value": 2.0}

    @pf.jit(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * scale["value"]  # read once, at the trace

    x = torch.ones(3)
    assert torch.equal(f(x), x * 2) and torch.equal(f(x), x * 2)
    program = weakref.ref(next(iter(f._cache.values())))
    scale["value"] = 3.0
    assert torch.equal(f(x), x * 2)  # a constant of the program
    f.clear_cache()
    assert not f._cache
    assert _dead([program])  # the last call's fast path no longer holds it
    assert torch.equal(f(x), x * 3)
    assert f.trace_count() == 2


def test_clear_cache_of_a_jitted_method() -> None:
    _Net = _net_class()
    net = _Net().requires_grad_(False)
    other = _Net().requires_grad_(False)
    x = torch.randn(2, 8)
    net.predict(x)
    other.predict(x)
    assert len(_Net.predict._cache) >= 2
    net.predict.clear_cache()  # every instance's, as `_Net.predict.clear_cache()`
    assert not _Net.predict._cache
    count = _Net.predict.trace_count()
    assert torch.equal(other.predict(x), other.lin(x) + other.big[:1, :8])
    assert _Net.predict.trace_count() == count + 1


def test_explanations_name_the_instance_and_clear_cache(explain_misses, caplog) -> None:
    _Net = _net_class()
    first, second = _Net(), _Net()
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        first.predict(x)
        second.predict(x)
        _Net.predict.clear_cache()
        second.predict(x)
    text = caplog.text
    assert f"self: _Net at {id(first):#x} in train mode -> _Net at {id(second):#x} in train mode" in text
    assert "module instance" in text and "on another mesh" not in text
    assert "tracing again because clear_cache() dropped its programs" in text


def test_many_signatures_are_logged_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(jitted_module, "_MANY_SIGNATURES", 4)

    @pf.jit(backend="eager")
    def grow(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    with caplog.at_level(logging.WARNING, logger="pt3func.jit"):
        for n in range(1, 3):
            grow(torch.ones(n))
        assert "signatures are now traced" not in caplog.text
        for n in range(3, 9):
            grow(torch.ones(n))
    warned = [r for r in caplog.records if "signatures are now traced" in r.getMessage()]
    assert len(warned) == 1
    assert "grow: 4 signatures" in warned[0].getMessage()
    assert "explain_cache_misses" in warned[0].getMessage()


def test_virtual_ranks_keep_their_own_programs() -> None:
    # Plain tensors under a virtual mesh: the signature names no rank's mesh, so each rank's program overwrote the
    # others' in the cache, and a call whose last call was another signature ran one rank's program on every rank.
    step = pf.jit(pf.shard_map(_axis_numbers, in_specs=P("dp"), out_specs=P("dp")), backend="eager")
    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    with pf.set_mesh(mesh):
        for n in (8, 16, 8):
            got = pf.device_get(step(torch.zeros(n, 2)))
            assert torch.equal(got[:, 0], torch.tensor([2.0] * (n // 2) + [12.0] * (n // 2))), n
    assert step.trace_count() == 2


def _axis_numbers(x: torch.Tensor) -> torch.Tensor:
    return x * 0 + pf.lax.axis_size("dp") + 10 * pf.lax.axis_index("dp")


def test_clear_cache_frees_static_arguments() -> None:
    class Config:  # hashed by identity, holding a big tensor
        def __init__(self) -> None:
            self.table = torch.zeros(1000)

    @pf.jit(static_argnums=(1,), backend="eager")
    def f(x: torch.Tensor, config: Config) -> torch.Tensor:
        return x + 1

    config = Config()
    f(torch.ones(2), config)
    ref = weakref.ref(config)
    del config
    f.clear_cache()
    gc.collect()
    assert ref() is None
