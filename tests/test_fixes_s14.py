"""Session 14 fixes: optimizer norms and schedules in the leaves' precision, bernoulli under Inductor, the caller's
modes and other meshes on a virtual mesh, apply_if_finite under ZeRO, and checkpoint errors and restores."""

from __future__ import annotations

import enum
import math

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import pt3func as pf
from pt3func import P, optim
from pt3func.checkpointing import CheckpointError, CheckpointManager, rng_state, set_rng_state
from pt3func.runtime.virtual import scatter_tree


@pytest.fixture(scope="module")
def mesh2():
    return pf.make_mesh((2,), ("dp",), virtual=True)


# -- optim: global_norm and schedules --


def test_global_norm_counts_a_complex_element_as_two_reals():
    torch.manual_seed(0)
    grads = {"c": torch.randn(4, 3, dtype=torch.complex64), "r": torch.randn(5)}
    want = torch.linalg.vector_norm(torch.cat([torch.view_as_real(grads["c"]).flatten(), grads["r"]]))
    torch.testing.assert_close(optim.global_norm(grads), want)
    clip = optim.clip_by_global_norm(0.1)
    clipped, _ = clip.update(grads, clip.init(grads))
    assert clipped["c"].dtype == torch.complex64
    torch.testing.assert_close(optim.global_norm(clipped), torch.tensor(0.1))
    torch.testing.assert_close(clipped["c"], grads["c"] * (0.1 / want))


def test_global_norm_keeps_float64_and_float32_is_unchanged():
    torch.manual_seed(0)
    grads = [torch.randn(100, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    norm = optim.global_norm(grads)
    want = torch.linalg.vector_norm(torch.cat(grads))
    assert norm.dtype == torch.float64
    assert abs(norm.item() - want.item()) / want.item() < 1e-15  # float32 gives ~1e-8
    clip = optim.clip_by_global_norm(0.5)
    clipped, _ = clip.update(grads, clip.init(grads))
    for c, g in zip(clipped, grads, strict=True):
        torch.testing.assert_close(c, g * (0.5 / want), rtol=1e-15, atol=0)
    # float32 (and lower) leaves: a float32 norm, computed exactly as before.
    low = [torch.randn(9), torch.randn(3, dtype=torch.bfloat16)]
    before = torch.sqrt(torch.stack([torch.sum(torch.square(x.float())) for x in low]).sum())
    assert optim.global_norm(low).dtype == torch.float32 and torch.equal(optim.global_norm(low), before)


def test_schedules_are_computed_in_float64():
    count = torch.tensor(3, dtype=torch.int32)
    want = 0.1 * 0.5 * (1 + math.cos(math.pi * 3 / 7))
    got = optim.cosine_decay(0.1, decay_steps=7)(count)
    assert got.dtype == torch.float64 and abs(got.item() - want) / want < 1e-15  # float32: ~1e-8
    lin = optim.linear(0.3, 0.1, transition_steps=3)(count - 1)
    assert abs(lin.item() - (0.3 + (0.1 - 0.3) * 2 / 3)) < 1e-16


def test_float64_sgd_on_a_schedule_matches_torch_optim():
    torch.manual_seed(0)
    w0, x, y = (torch.randn(*s, dtype=torch.float64) for s in ((6, 3), (16, 6), (16, 3)))

    def loss_fn(w):
        return ((x @ w - y) ** 2).mean()

    schedule = optim.warmup_cosine_decay(0.0, 0.1, warmup_steps=2, decay_steps=7)
    opt = optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(schedule))
    w, state = w0.clone(), opt.init(w0)
    tw = w0.clone().requires_grad_()
    torch_opt = torch.optim.SGD([tw], lr=0.0)
    for t in range(6):
        updates, state = opt.update(pf.grad(loss_fn)(w), state, w)
        w = optim.apply_updates(w, updates)
        torch_opt.zero_grad()
        loss_fn(tw).backward()
        g = tw.grad
        g.mul_(0.05 / max(torch.linalg.vector_norm(g).item(), 0.05))  # clip without clip_grad_norm_'s 1e-6
        lr = 0.1 * t / 2 if t < 2 else 0.1 * 0.5 * (1 + math.cos(math.pi * (t - 2) / 5))
        torch_opt.param_groups[0]["lr"] = lr
        torch_opt.step()
    err = ((w - tw.detach()).norm() / tw.detach().norm()).item()
    assert err < 1e-14, err  # float32 norm and schedule: ~1e-9


def test_float32_steps_with_a_constant_schedule_are_bit_identical_to_a_float():
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 4)}
    grads = {"w": torch.randn(5, 4)}
    for a, b in [(optim.sgd(optim.constant(0.1)), optim.sgd(0.1)),
                 (optim.adamw(optim.constant(3e-3)), optim.adamw(3e-3))]:
        ua, _ = a.update(grads, a.init(params), params)
        ub, _ = b.update(grads, b.init(params), params)
        assert ua["w"].dtype == torch.float32 and torch.equal(ua["w"], ub["w"])


# -- random fills: bernoulli(p) under Inductor --


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bernoulli_of_a_probability_tensor_draws_what_eager_draws(dtype):
    p = torch.rand(9, 7, dtype=torch.float64).to(dtype)

    def step(p):
        return torch.bernoulli(p), torch.bernoulli(p.t())  # a transposed p: eager's output is contiguous

    torch.manual_seed(0)
    want, want_next = step(p), torch.rand(3)
    jitted = pf.jit(step)
    for _ in range(2):
        torch.manual_seed(0)
        got = jitted(p)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == dtype and a.stride() == b.stride() and torch.equal(a, b)
        assert torch.equal(torch.rand(3), want_next)  # the generator is left where eager leaves it


# -- virtual mesh: the caller's modes, requires-grad values, other meshes --


def test_autocast_and_grad_mode_reach_the_rank_threads(mesh2):
    w, x = torch.randn(8, 4), torch.randn(4, 8)
    step = pf.jit(lambda w, x: x @ w, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = step(w, x)
    assert want.dtype == torch.bfloat16
    with pf.set_mesh(mesh2):
        vw, vx = pf.device_put(w, P()), pf.device_put(x, P("dp"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = pf.device_get(step(vw, vx))
            eager = pf.device_get(vx @ vw)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert eager.dtype == torch.bfloat16 and torch.equal(eager, want)
        assert pf.device_get(step(vw, vx)).dtype == torch.float32  # the mode ends with the caller's block
        trainable = pf.device_put(torch.nn.Parameter(torch.randn(4)), P())
        assert (trainable * 2).requires_grad
        with torch.no_grad():
            assert not (trainable * 2).requires_grad


def test_a_rank_copy_of_a_trainable_tensor_is_a_leaf(mesh2):
    w = torch.nn.Parameter(torch.randn(4, 3))
    shards = mesh2.run(lambda rank: distribute_tensor(scatter_tree(w, rank), mesh2.device_mesh, [Shard(0)]))
    assert all(s.requires_grad and s.is_leaf for s in shards)
    assert torch.equal(torch.cat([s.to_local() for s in shards]).detach(), w.detach())


def test_device_put_onto_another_virtual_mesh(mesh2):
    mesh4 = pf.make_mesh((2, 2), ("dp", "tp"), virtual=True)
    full = torch.arange(16.0).reshape(4, 4)
    a = pf.device_put(full, pf.NamedSharding(mesh2, P("dp")))
    b = pf.device_put({"a": a}, pf.NamedSharding(mesh4, P(None, "tp")))["a"]
    assert b.mesh is mesh4 and pf.sharding_of(b).spec == P(None, "tp")
    assert torch.equal(pf.device_get(b), full)
    assert torch.equal(pf.device_get([a, b])[1], full)  # a device_get of arrays of two meshes
    two_meshes = r"(?s)argument args\[1\] lives on Mesh\(dp=2, tp=2.*runs on Mesh\(dp=2,"
    with pytest.raises(pf.ShardingError, match=two_meshes):
        pf.jit(lambda x, y: x + y, backend="eager")(a, b)
    with pytest.raises(pf.ShardingError, match=r"(?s)Mesh\(dp=2, tp=2.*another virtual mesh \(Mesh\(dp=2,"):
        pf.jit(lambda x: x * 2, in_shardings=pf.NamedSharding(mesh4, P("tp")), backend="eager")(a)


# -- optim under ZeRO: apply_if_finite --


def test_apply_if_finite_under_zero_matches_one_device(mesh2):
    g = torch.Generator().manual_seed(0)
    p0 = {"w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 4, generator=g)}
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    opt = optim.apply_if_finite(optim.adamw(1e-2), 3)

    def step(params, state, x, y, scale):
        grads = pf.grad(lambda p: ((torch.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean() * scale)(params)
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    scales = [torch.tensor(1.0), torch.tensor(float("inf")), torch.tensor(1.0)]  # the second step is skipped
    want, want_state = p0, opt.init(p0)
    one = pf.jit(step, backend="eager")
    for s in scales:
        want, want_state = one(want, want_state, x, y, s)
    with pf.set_mesh(mesh2):
        zero = pf.jit(step, in_shardings=({"w1": P(), "w2": P()}, P("dp"), P("dp"), P("dp"), None), backend="eager")
        params = pf.device_put(p0, P())
        state = opt.init(params)
        for s in scales:
            params, state = zero(params, state, x, y, s)
        got = pf.device_get(params)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert int(pf.device_get(state.total_notfinite)) == int(want_state.total_notfinite) == 1


# -- checkpointing --


def test_virtual_restore_keeps_plain_leaves_plain(tmp_path, mesh2):
    with pf.set_mesh(mesh2):
        params = pf.device_put({"w": torch.randn(4, 4)}, {"w": P("dp")})
        torch.manual_seed(3)
        state = {"params": params, "rng": rng_state(), "pos": torch.tensor(5), "step": 0}
        want = torch.rand(3)
        manager = CheckpointManager(tmp_path)
        manager.save(0, state)
        torch.manual_seed(99)
        out = manager.restore(target=state)
    assert type(out["pos"]) is torch.Tensor and int(out["pos"]) == 5 and out["step"] == 0
    assert type(out["params"]["w"]) is type(params["w"])
    assert torch.equal(pf.device_get(out["params"]["w"]), pf.device_get(params["w"]))
    set_rng_state(out["rng"])  # the README's restart recipe
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_leaf_dcp_cannot_stage_is_a_checkpoint_error_naming_it(tmp_path, async_save):
    manager = CheckpointManager(tmp_path, async_save=async_save)
    with pytest.raises(CheckpointError, match="emb/sparse_w"):
        manager.save(1, {"emb": {"sparse_w": torch.eye(3).to_sparse()}})
    manager.save(2, {"w": torch.ones(2)})
    manager.wait()
    assert manager.all_steps() == [2]


def test_an_async_staging_failure_is_a_checkpoint_error(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def cannot_stage(*args, **kwargs):
        raise RuntimeError("Cannot access data pointer of Tensor that doesn't have storage")

    manager = CheckpointManager(tmp_path, async_save=True)
    with monkeypatch.context() as m:
        m.setattr(dcp, "async_save", cannot_stage)
        with pytest.raises(CheckpointError, match="(?s)saving step 1 .* failed .*data pointer"):
            manager.save(1, {"w": torch.ones(2)})
    manager.save(2, {"w": torch.ones(2)})
    manager.wait()
    assert manager.all_steps() == [2]


class _Mode(enum.Enum):
    TRAIN = 1


@pytest.mark.parametrize("key", [_Mode.TRAIN, torch.float32])
def test_a_dict_key_json_cannot_hold_is_refused_before_writing(tmp_path, key):
    manager = CheckpointManager(tmp_path)  # async: the commit would have failed later, naming nothing
    with pytest.raises(CheckpointError, match=f"at 'heads/{key}'"):
        manager.save(1, {"heads": {key: torch.ones(2)}})
    manager.wait()
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
