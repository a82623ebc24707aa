"""Session 18: a virtual mesh's ranks draw random numbers as one device (and a real world's ranks) do.

Rank threads shared the process's one CPU generator, so their draws took turns on it: a dropout on a virtual mesh
dropped other positions than one device, and the run depended on the threads' order."""

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func._compat import TORCH_VERSION


def _loss(p, x):
    h = F.dropout(x @ p["w"], 0.3)
    return (h * torch.rand(h.shape[-1])).square().mean()  # a split dropout and a replicated draw


@pytest.mark.parametrize(
    "shape,names,wspec,xspec",
    [
        ((2,), ("dp",), P(), P("dp")),
        ((2,), ("tp",), P(None, "tp"), P()),
        ((2, 2), ("dp", "tp"), P(None, "tp"), P("dp")),
    ],
)
def test_random_draws_on_a_virtual_mesh_are_one_devices(shape, names, wspec, xspec) -> None:
    torch.manual_seed(0)
    params, x = {"w": torch.randn(8, 16)}, torch.randn(4, 8)
    step = pf.jit(pf.value_and_grad(_loss), backend="eager")
    torch.manual_seed(5)
    want, want_grad = step(params, x)
    want_next = torch.rand(3)
    with pf.set_mesh(pf.make_mesh(shape, names, virtual=True)):
        torch.manual_seed(5)
        got, grad = pf.device_get(step(pf.device_put(params, {"w": wspec}), pf.device_put(x, xspec)))
        got_next = torch.rand(3)  # the caller's generator goes on where one device's does
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad["w"], want_grad["w"])
    assert torch.equal(got_next, want_next)


def test_random_draws_on_a_virtual_mesh_under_inductor() -> None:
    torch.manual_seed(0)
    params, x = {"w": torch.randn(8, 16)}, torch.randn(4, 8)
    step = pf.jit(pf.value_and_grad(_loss))
    torch.manual_seed(5)
    want, want_grad = step(params, x)
    with pf.set_mesh(pf.make_mesh((2,), ("dp",), virtual=True)):
        torch.manual_seed(5)
        got, grad = pf.device_get(step(pf.device_put(params, {"w": P()}), pf.device_put(x, P("dp"))))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad["w"], want_grad["w"])


def test_virtual_jobs_leave_other_threads_draws_alone() -> None:
    # Rank 0 draws from the process's generator and nothing is set back after a job: a thread drawing meanwhile
    # never gets numbers again (setting the generator back to a copy's state after every job repeated them).
    import threading

    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    step = pf.jit(lambda x: x * 2, backend="eager")
    x = pf.device_put(torch.ones(4, 4), pf.NamedSharding(mesh, P("dp")))
    drawn, stop = [], threading.Event()

    def draw() -> None:
        while not stop.is_set():
            drawn.append(torch.rand((), dtype=torch.float64).item())  # (float64: no birthday repeats)

    thread = threading.Thread(target=draw)
    thread.start()
    try:
        for _ in range(30):
            step(x)
    finally:
        stop.set()
        thread.join()
    assert len(set(drawn)) == len(drawn)


def test_rank_generators_are_made_once_per_mesh() -> None:
    from pt3func.passes import random_fills

    mesh = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    step = pf.jit(lambda x: F.dropout(x, 0.5), backend="eager")
    x = pf.device_put(torch.ones(4, 4), pf.NamedSharding(mesh, P("dp")))
    step(x)
    held = len(random_fills._GENERATORS)
    for _ in range(20):
        step(x)
    assert len(random_fills._GENERATORS) == held


@pytest.mark.skipif(TORCH_VERSION < (2, 12), reason="torch 2.11 has no randint_like overload taking a generator")
def test_randint_like_draws_as_one_device() -> None:
    # randint_like(x, low, high) is the `low_dtype` overload, whose generator overload is `low_generator_dtype`
    x = torch.zeros(4, 8)

    def f(x):
        return x + torch.randint_like(x, 0, 100)

    step = pf.jit(f, backend="eager")
    torch.manual_seed(2)
    want = step(x)
    with pf.set_mesh(pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)):
        torch.manual_seed(2)
        got = step(pf.device_put(x, P()))
        assert all(torch.equal(block.to_local(), want) for block in got.locals)
