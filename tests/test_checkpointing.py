"""pf.checkpointing: round trips of any pytree, atomic commits, pruning, corruption, async saves, resharding."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import pt3func as pf
from pt3func import P
from pt3func.checkpointing import CheckpointError, CheckpointManager, rng_state, set_rng_state
from pt3func.optim.transform import ScaleByAdamState
from tests.dist import run_world

# pytest resets warning filters per test; the module's own filter of DCP's single-process note does not apply.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    params = {"fc1": {"w": torch.randn(8, 4), "b": torch.randn(4)}, "fc2": {"w": torch.randn(4, 2)}}
    opt = pf.optim.apply_if_finite(pf.optim.adamw(1e-2), 3)
    return {"params": params, "opt_state": opt.init(params), "step": 7, "lr": 0.5, "run": "a",
            "data": {"position": 123}, "rng": rng_state()}


def assert_tree_equal(a, b) -> None:
    assert pf.tree.structure(a) == pf.tree.structure(b)
    for x, y in zip(pf.tree.leaves(a), pf.tree.leaves(b)):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert type(x) is type(y) and x == y


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_without_and_with_target(tmp_path: Path, async_save: bool) -> None:
    state = make_state()
    manager = CheckpointManager(tmp_path, async_save=async_save)
    manager.save(7, state)
    manager.wait()
    assert manager.all_steps() == [7] and manager.latest_step() == 7

    restored = manager.restore()
    assert_tree_equal(restored, state)  # NamedTuples come back as their own classes
    assert isinstance(restored["opt_state"].inner_state[0], ScaleByAdamState)

    target = make_state(seed=1)
    assert_tree_equal(manager.restore(target=target), state)
    part = manager.restore(target={"params": target["params"], "data": {"position": 0}})
    assert_tree_equal(part, {"params": state["params"], "data": state["data"]})

    manifest = json.loads((tmp_path / "step_7" / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["tensors"]["opt_state/inner_state/0/mu/fc1/w"] == {"shape": [8, 4], "dtype": "float32"}
    assert manifest["values"] == {"step": 7, "lr": 0.5, "run": "a", "data/position": 123}
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert {"pt3func", "torch"} <= set(manifest["versions"])


def test_object_leaves_and_rng(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    torch.manual_seed(3)
    saved_rng = rng_state()
    expected = torch.rand(5)
    manager.save(1, {"rng": saved_rng, "odd": frozenset({1, 2})})  # not JSON: DCP's object storage
    manager.wait()
    restored = manager.restore()
    assert restored["odd"] == frozenset({1, 2})
    torch.manual_seed(99)
    set_rng_state(restored["rng"])
    assert torch.equal(torch.rand(5), expected)


def test_async_save_snapshots_before_donation(tmp_path: Path) -> None:
    params, apply = pf.functionalize(nn.Linear(4, 2))
    opt = pf.optim.sgd(0.1)

    @pf.jit(donate_argnums=(0, 1), backend="eager")
    def step(params, opt_state, x):
        grads = pf.grad(lambda p: F.mse_loss(apply(p, x), torch.zeros(8, 2)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state

    params = {k: v.clone() for k, v in params.items()}
    before = {k: v.clone() for k, v in params.items()}
    manager = CheckpointManager(tmp_path)
    manager.save(0, params)
    new_params, _ = step(params, opt.init(params), torch.randn(8, 4))  # writes into the saved buffers
    manager.wait()
    assert not torch.equal(new_params["weight"], before["weight"])
    assert_tree_equal(manager.restore(), before)


def test_max_to_keep_prunes_oldest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in range(1, 6):
        manager.save(step, {"x": torch.full((3,), float(step))})
    manager.wait()
    assert manager.all_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    assert torch.equal(manager.restore(step=4)["x"], torch.full((3,), 4.0))
    with pytest.raises(CheckpointError, match="no committed checkpoint for step 1"):
        manager.restore(step=1)


def test_crash_before_commit_keeps_previous(tmp_path: Path) -> None:
    def crash(step: int, tmp: Path) -> None:
        if step == 2:
            raise RuntimeError("simulated crash after the write, before the commit")

    manager = CheckpointManager(tmp_path, before_commit=crash)
    manager.save(1, {"x": torch.ones(3)})
    manager.save(2, {"x": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="saving step 2 .* failed .*simulated crash"):
        manager.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("step_2")]
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0]
    # A committed-looking directory without a manifest (a crash before the manifest) is ignored too.
    (tmp_path / "step_9").mkdir()
    fresh = CheckpointManager(tmp_path)
    assert fresh.latest_step() == 1
    assert torch.equal(fresh.restore()["x"], torch.ones(3))
    fresh.save(3, {"x": torch.full((3,), 3.0)})
    fresh.wait()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the next save cleans up
    assert fresh.all_steps() == [1, 3]


def _first_data_file(step_dir: Path) -> Path:
    return next(p for p in sorted(step_dir.iterdir()) if p.suffix == ".distcp")


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corruption_is_named_and_fallback_warns(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"x": torch.arange(1000.0)})
    manager.save(2, {"x": torch.arange(1000.0) * 2})
    manager.wait()
    victim = _first_data_file(tmp_path / "step_2")
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        expected = f"{victim} fails its sha256 checksum"
    elif damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
        expected = f"{victim} has .* bytes, the manifest says"
    else:
        victim = tmp_path / "step_2" / "manifest.json"
        victim.write_text(victim.read_text()[:50])
        expected = f"{victim} is unreadable or corrupt"
    with pytest.raises(CheckpointError, match=expected.replace(".", r"\.").replace(r"\.*", ".*")):
        manager.restore()
    with pytest.warns(UserWarning, match="skipping checkpoint step 2"):
        restored = manager.restore(fallback=True)
    assert torch.equal(restored["x"], torch.arange(1000.0))


def test_target_mismatch_names_the_key(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, {"w": torch.zeros(2, 3)})
    with pytest.raises(CheckpointError, match=r"'w' has shape \(3, 2\) but checkpoint .* saved \(2, 3\)"):
        manager.restore(target={"w": torch.zeros(3, 2)})
    with pytest.raises(CheckpointError, match="'v' is not in checkpoint .*holds: w"):
        manager.restore(target={"v": torch.zeros(2, 3)})
    with pytest.raises(CheckpointError, match="no committed checkpoint in"):
        CheckpointManager(tmp_path / "empty").restore()


# -- multi-process: FSDP on 4 ranks -> data parallel on 2 ranks -> one process --

def _init_state() -> tuple[dict, pf.optim.GradientTransformation]:
    torch.manual_seed(0)
    params = {"fc1": {"w": torch.randn(8, 4), "b": torch.randn(8)}, "fc2": {"w": torch.randn(4, 8)}}
    return params, pf.optim.adamw(1e-2)


def _save_fsdp(rank: int, world: int, directory: str) -> dict:
    mesh = pf.make_mesh((world,), ("dp",))
    params, opt = _init_state()
    with pf.set_mesh(mesh):
        params = pf.device_put(params, P("dp"))
        opt_state = pf.jit(opt.init, backend="eager")(params)
        # One real update, so the moments are not zeros.
        grads = pf.tree.map(lambda p: p * 0.5, params)
        _, opt_state = opt.update(grads, opt_state, params)
        tree = {"params": params, "opt_state": opt_state, "step": 1, "scalar": pf.device_put(torch.tensor(5.0), P())}
        expected = pf.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, pf.device_get(tree))
        manager = CheckpointManager(directory)
        manager.save(1, tree)
        # As a donated step would: overwrite every shard in place (0-d ones included) while the write runs,
        # and run training's collectives meanwhile (the manager writes on a group of its own).
        for leaf in pf.tree.leaves(tree):
            if isinstance(leaf, torch.Tensor):
                (leaf.to_local() if isinstance(leaf, DTensor) else leaf).add_(1)
        for _ in range(20):
            torch.distributed.all_reduce(torch.ones(1000))
        manager.wait()
        placements = str(params["fc1"]["w"].placements)
        return {"full": expected, "placements": placements, "steps": manager.all_steps()}


def _restore_dp(rank: int, world: int, directory: str) -> dict:
    mesh = pf.make_mesh((world,), ("dp",))
    params, opt = _init_state()
    with pf.set_mesh(mesh):
        zeros = pf.device_put(pf.tree.map(torch.zeros_like, params), P())
        target = {"params": zeros, "opt_state": pf.jit(opt.init, backend="eager")(zeros), "step": 0,
                  "scalar": pf.device_put(torch.tensor(0.0), P())}
        restored = CheckpointManager(directory).restore(target=target)
        placements = str(restored["params"]["fc1"]["w"].placements)
        plain = CheckpointManager(directory).restore()  # no target: full plain tensors on every rank
        return {"full": pf.device_get(restored), "placements": placements, "plain": plain}


@pytest.mark.slow
def test_reshard_fsdp4_to_dp2_to_one_process(tmp_path: Path) -> None:
    saved = run_world(4, _save_fsdp, str(tmp_path))
    assert saved[0]["placements"] == "(Shard(dim=0),)" and saved[1]["steps"] == [1]
    expected = saved[0]["full"]
    manifest = json.loads((tmp_path / "step_1" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    assert manifest["tensors"]["params/fc1/w"]["placements"] == ["Shard(dim=0)"]

    for result in run_world(2, _restore_dp, str(tmp_path)):
        assert result["placements"] == "(Replicate(),)"
        assert_tree_equal(result["full"], expected)
        assert_tree_equal(result["plain"], expected)

    plain = CheckpointManager(tmp_path).restore()
    assert_tree_equal(plain, expected)
    params, opt = _init_state()
    target = {"params": params, "opt_state": opt.init(params), "step": 0, "scalar": torch.tensor(0.0)}
    assert_tree_equal(CheckpointManager(tmp_path).restore(target=target), expected)


def test_restore_refuses_a_target_of_another_dtype(tmp_path):
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, {"w": torch.tensor([1.7, -2.5]), "n": torch.tensor(2**40 + 1)})
    with pytest.raises(CheckpointError, match=r"leaf 'w' is int32 but .* saved float32"):
        manager.restore(target={"w": torch.zeros(2, dtype=torch.int32), "n": torch.zeros((), dtype=torch.int64)})
    with pytest.raises(CheckpointError, match=r"leaf 'n' is float32 but .* saved int64"):
        manager.restore(target={"w": torch.zeros(2), "n": torch.zeros(())})


def test_steps_must_grow_and_be_non_negative(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=1, async_save=False)
    manager.save(30, {"w": torch.ones(2)})
    # Older than the latest: it would be pruned at once (max_to_keep) or shadowed (latest_step, restore()).
    with pytest.raises(CheckpointError, match="step 25 is older than the latest committed step 30"):
        manager.save(25, {"w": torch.zeros(2)})
    for bad in (-1, True, 2.5, "3"):
        with pytest.raises(CheckpointError, match="a checkpoint step is an int >= 0"):
            manager.save(bad, {"w": torch.zeros(2)})
    assert manager.all_steps() == [30]
    manager.save(30, {"w": torch.zeros(2)})  # the same step again replaces it
    assert torch.equal(manager.restore()["w"], torch.zeros(2))


def test_save_leaves_other_tmp_directories_alone(tmp_path):
    (tmp_path / "eval_results.tmp-2024").mkdir()
    (tmp_path / "step_3.tmp-deadbeef").mkdir()  # an unfinished save of ours
    CheckpointManager(tmp_path, async_save=False).save(4, {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_results.tmp-2024", "step_4"]


def test_tuple_dict_keys_come_back_without_a_target(tmp_path):
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, {("layer", 0): torch.ones(2), "x": {(1, 2): 3}})
    out = manager.restore()
    assert torch.equal(out[("layer", 0)], torch.ones(2)) and out["x"] == {(1, 2): 3}


def test_dcp_failures_are_checkpoint_errors(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, {"w": torch.ones(4)})

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(dcp.FileSystemWriter, "write_data", no_space)
        with pytest.raises(CheckpointError, match="(?s)saving step 2 .* failed .*No space left"):  # not DCP's own
            manager.save(2, {"w": torch.ones(4)})
    assert manager.all_steps() == [1]
    data = next(p for p in (tmp_path / "step_1").iterdir() if p.suffix == ".distcp")
    with open(data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="(?s)loading .* failed"):
        manager.restore(verify=False)
