"""Random draws on CUDA (run on the H200; skipped without a GPU).

On a 1-rank CUDA mesh a split value is whole on its rank, so pt3func's redraws (`spmd/random_ops.py`) must give
exactly the numbers the ops draw on one device: F.dropout through the fused kernel (mask from `native_dropout`,
output from `native_dropout_backward`), `rand_like` / `randn_like`. And jitted steps with several random ops keep
eager torch's draws with both backends, sharded or not (Inductor's `reorder_for_locality` once swapped two draws).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.spmd.random_ops import dropout, random_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist

    yield pf.make_mesh((1,), ("dp",), device_type="cuda")
    # The 1-rank world this starts must not outlive the module: later tests build virtual meshes, which refuse
    # to run inside a torch.distributed world, and test_sharding.py checks that none is left.
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_redraws_equal_the_ops_bit_for_bit(mesh, dtype):
    x = torch.randn(64, 1000, device="cuda", dtype=dtype)
    with pf.set_mesh(mesh):
        split = pf.device_put(x, P("dp"))
    for p in (0.1, 0.5):
        torch.manual_seed(0)
        want = F.dropout(x, p, True)
        torch.manual_seed(0)
        assert torch.equal(dropout(F.dropout, (split, p, True), {}).full_tensor(), want), p
    for fn in (torch.rand_like, torch.randn_like):
        torch.manual_seed(0)
        want = fn(x)
        torch.manual_seed(0)
        assert torch.equal(random_like(fn, (split,), {}).full_tensor(), want), fn.__name__


def _dropout(h):
    return F.dropout(h, 0.3, True)


def _dropout2d(h):
    return F.dropout2d(h.reshape(128, 16, 16, 1), 0.25, True).reshape(128, 256)


def _uniform(h):
    return h + 0.05 * torch.empty_like(h).uniform_(-1, 1)


def _bernoulli(h):
    return h * torch.empty_like(h).bernoulli_(0.5)


COMBOS = {
    "dropout + uniform_": (_dropout, _uniform),
    "dropout2d + bernoulli_": (_dropout2d, _bernoulli),
    "all four": (_dropout, _dropout2d, _uniform, _bernoulli),
}
OPT = pf.optim.adamw(1e-2)


def _losses(parts, backend, mesh=None):
    def loss_fn(params, x, y):
        h = torch.tanh(x @ params["w1"])
        for part in parts:
            h = part(h)
        return ((h @ params["w2"] - y) ** 2).mean()

    def step(params, s, x, y):
        loss, g = pf.value_and_grad(loss_fn)(params, x, y)
        updates, s = OPT.update(g, s, params)
        return pf.optim.apply_updates(params, updates), s, loss

    gen = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 256, generator=gen) * 0.1, "w2": torch.randn(256, 32, generator=gen) * 0.1}
    data = [(torch.randn(128, 64, generator=gen), torch.randn(128, 32, generator=gen)) for _ in range(2)]
    params, data = pf.tree.map(torch.Tensor.cuda, (params, data))
    torch.manual_seed(7)
    if backend == "not jitted":
        s, losses = OPT.init(params), []
        for x, y in data:
            params, s, loss = step(params, s, x, y)
            losses.append(float(loss))
        return losses
    if mesh is None:
        jitted, s, losses = pf.jit(step, backend=backend), OPT.init(params), []
        for x, y in data:
            params, s, loss = jitted(params, s, x, y)
            losses.append(float(loss))
        return losses
    replicated = {"w1": P(), "w2": P()}
    jitted = pf.jit(step, in_shardings=(replicated, None, P("dp"), P("dp")), backend=backend)
    with pf.set_mesh(mesh):
        params = pf.device_put(params, replicated)
        s, losses = pf.jit(OPT.init, backend="eager")(params), []
        for x, y in data:
            params, s, loss = jitted(params, s, x, y)
            losses.append(float(pf.device_get(loss)))
    return losses


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_jitted_steps_draw_what_eager_torch_draws(mesh, combo, backend):
    want = _losses(COMBOS[combo], "not jitted")
    assert _losses(COMBOS[combo], backend) == pytest.approx(want, rel=1e-5)
    assert _losses(COMBOS[combo], backend, mesh) == pytest.approx(want, rel=1e-5)
