"""Meshes, specs, device_put/get and visualize_sharding: in one process (world of one, fake process group)
and on real multi-process gloo worlds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_world
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import pt3func as pf
from pt3func.sharding import (
    NamedSharding,
    P,
    device_get,
    device_put,
    get_mesh,
    make_mesh,
    placements_for,
    set_mesh,
    sharding_of,
    spec_from_placements,
    visualize_sharding,
    with_sharding_constraint,
)


@pytest.fixture
def world_of_one():
    assert not dist.is_initialized()
    yield
    dist.destroy_process_group()


@pytest.fixture
def fake_2x2():
    """A 2 x 2 mesh in this process over torch's fake process group (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield make_mesh((2, 2), ("dp", "tp"))
    dist.destroy_process_group()


def test_world_of_one_without_launcher(world_of_one, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    mesh = make_mesh((1,), ("dp",))
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL when there is a GPU
    assert dist.get_world_size() == 1
    assert (mesh.shape, mesh.axis_names, mesh.size, mesh.ndim, mesh.device_type) == ((1,), ("dp",), 1, 1, device_type)
    assert mesh.axis_index("dp") == 0 and mesh.axis_size("dp") == 1 and not mesh.virtual
    assert repr(mesh) == f"Mesh(dp=1, device_type='{device_type}')"
    assert make_mesh((1,), ("dp",)) is mesh
    with pytest.raises(pf.ShardingError, match=r"mesh shape \(2,\) has 2 devices but the world has 1 ranks"):
        make_mesh((2,), ("dp",))
    x = torch.arange(6.0).reshape(3, 2)
    with set_mesh(mesh):
        put = device_put({"x": x, "n": 3}, P("dp"))
    assert isinstance(put["x"], DTensor) and put["n"] == 3
    assert torch.equal(device_get(put)["x"].cpu(), x)


def test_set_mesh_is_setter_and_context(fake_2x2):
    assert get_mesh() is None
    with set_mesh(fake_2x2) as m:
        assert m is fake_2x2 and get_mesh() is fake_2x2
        with set_mesh(None):
            assert get_mesh() is None
        assert get_mesh() is fake_2x2
    assert get_mesh() is None
    set_mesh(fake_2x2)
    assert get_mesh() is fake_2x2
    set_mesh(None)
    assert get_mesh() is None


def test_mesh_axes_and_groups(fake_2x2):
    mesh = fake_2x2
    assert (mesh.shape, mesh.axis_names, mesh.size, mesh.ndim) == ((2, 2), ("dp", "tp"), 4, 2)
    assert mesh.axis_size(("dp", "tp")) == 4 and mesh.axis_index(("dp", "tp")) == 0
    assert isinstance(mesh.device_mesh, torch.distributed.device_mesh.DeviceMesh)
    assert mesh.group(("tp", "dp")) is mesh.group(("dp", "tp"))
    assert dist.get_process_group_ranks(mesh.group("dp")) == [0, 2]
    assert dist.get_process_group_ranks(mesh.group("tp")) == [0, 1]
    assert mesh.group_name("dp") == mesh.group("dp").group_name
    with pytest.raises(pf.ShardingError, match=r"unknown mesh axis 'pp'.*axes \('dp', 'tp'\)"):
        mesh.axis_size("pp")


def test_placements_and_back(fake_2x2):
    mesh = fake_2x2
    cases = [
        (P(), (Replicate(), Replicate())),
        (P("dp"), (Shard(0), Replicate())),
        (P(None, "tp"), (Replicate(), Shard(1))),
        (P("tp", "dp"), (Shard(1), Shard(0))),
        (P(("dp", "tp")), (Shard(0), Shard(0))),
        (P(None, ("dp", "tp")), (Shard(1), Shard(1))),
    ]
    for spec, placements in cases:
        assert placements_for(spec, mesh, (8, 8)) == placements
        assert spec_from_placements(placements, mesh, 2) == spec.normalized()
    assert P("dp", None).normalized() == P("dp") and P(("dp",)).normalized() == P("dp")
    assert NamedSharding(mesh, P("dp", None)) == NamedSharding(mesh, P("dp"))
    assert hash(NamedSharding(mesh, P("dp", None))) == hash(NamedSharding(mesh, P("dp")))
    assert NamedSharding(mesh, P(None, ("dp", "tp"))).shard_shape((3, 8)) == (3, 2)
    with pytest.raises(pf.ShardingError, match="pending reduction"):
        spec_from_placements((Partial(), Replicate()), mesh, 1)
    assert repr(P("dp", None, ("dp", "tp"))) == "P('dp', None, ('dp', 'tp'))"


@pytest.mark.parametrize(
    ("spec", "shape", "pattern"),
    [
        (P("dp"), (5, 4), r"at \['params'\]\['w'\]: dim 0 of shape \(5, 4\) \(size 5\) is not divisible by the "
                          r"axis size 2 \(dp=2\) in spec P\('dp'\)"),
        (P(None, ("dp", "tp")), (4, 6), r"at \['params'\]\['w'\]: dim 1 of shape \(4, 6\) \(size 6\) is not "
                                        r"divisible by the axis size 4 \(dp=2 x tp=2\) in spec"),
        (P("pp"), (4, 4), r"at \['params'\]\['w'\]: spec P\('pp'\) for shape \(4, 4\) names axis 'pp', which is "
                          r"not an axis of Mesh\(dp=2, tp=2"),
        (P("dp", None, None), (4, 4), r"at \['params'\]\['w'\]: spec P\('dp', None, None\) has 3 entries but "
                                      r"the value has shape \(4, 4\) \(rank 2\)"),
        (P("dp", "dp"), (4, 4), r"at \['params'\]\['w'\]: spec P\('dp', 'dp'\) for shape \(4, 4\) uses axis 'dp' "
                                r"twice"),
        (P(("tp", "dp")), (4, 4), r"splits dim 0 over \('tp', 'dp'\), against the mesh order \('dp', 'tp'\); "
                                  r"write \('dp', 'tp'\)"),
    ],
)
def test_spec_errors_name_path_shape_spec_and_axis(fake_2x2, spec, shape, pattern):
    with pytest.raises(pf.ShardingError, match=pattern):
        placements_for(spec, fake_2x2, shape, path=("params", "w"))
    with set_mesh(fake_2x2), pytest.raises(pf.ShardingError, match=pattern):
        device_put({"params": {"w": torch.zeros(shape)}}, spec)


def test_device_put_without_mesh():
    x = {"a": torch.ones(2)}
    assert device_put(x)["a"] is x["a"]
    with pytest.raises(pf.ShardingError, match=r"at \['a'\]: spec P\('dp'\) needs a mesh; call pf.set_mesh"):
        device_put(x, P("dp"))
    with pytest.raises(pf.ShardingError, match="not a pytree prefix"):
        device_put(x, {"b": None})
    assert sharding_of(x["a"]) is None


def test_visualize_sharding_text(fake_2x2):
    mesh = fake_2x2
    x = with_sharding_constraint(torch.zeros(8, 4), NamedSharding(mesh, P("dp", "tp")))
    text = visualize_sharding(x)
    assert "(8, 4) P('dp', 'tp') on Mesh(dp=2, tp=2" in text
    for rank, block in enumerate(["[0:4, 0:2]", "[0:4, 2:4]", "[4:8, 0:2]", "[4:8, 2:4]"]):
        assert f"rank {rank}" in text and block in text
    text = visualize_sharding(with_sharding_constraint(torch.zeros(8), NamedSharding(mesh, P("tp"))))
    assert "ranks 0,2" in text and "[0:4]" in text and "ranks 1,3" in text and "[4:8]" in text
    assert text.splitlines()[1].count("┬") == 1  # 1-D: one row of two blocks
    text = visualize_sharding(with_sharding_constraint(torch.zeros(4, 2, 6), NamedSharding(mesh, P(("dp", "tp")))))
    for rank in range(4):
        assert f"[{rank}:{rank + 1}, 0:2, 0:6]: rank {rank}" in text
    text = visualize_sharding(torch.zeros(3, 3))
    assert "not sharded" in text and "ranks 0,1,2,3" in text


# Real gloo worlds. Each world runs many checks: spawning a world is the expensive part.

def _mesh_world(rank: int, world_size: int) -> dict:
    mesh = make_mesh((world_size,), ("dp",))
    assert mesh.axis_index("dp") == rank and mesh.size == world_size
    with pytest.raises(pf.ShardingError, match=f"has {2 * world_size} devices but the world has {world_size}"):
        make_mesh((2 * world_size,), ("dp",))
    torch.manual_seed(0)
    tree = {"w": torch.randn(4 * world_size, 3), "b": torch.randn(3), "step": 7}
    with set_mesh(mesh):
        put = device_put(tree, {"w": P("dp"), "b": None, "step": None})
    assert put["step"] == 7
    assert put["w"].placements == (Shard(0),) and put["b"].placements == (Replicate(),)
    assert torch.equal(put["w"].to_local(), tree["w"][4 * rank:4 * rank + 4])
    assert sharding_of(put["w"]) == NamedSharding(mesh, P("dp"))
    assert sharding_of(put["b"]) == NamedSharding(mesh, P())
    back = device_get(put)
    assert torch.equal(back["w"], tree["w"]) and torch.equal(back["b"], tree["b"]) and back["step"] == 7
    # A DTensor input is redistributed.
    moved = device_put(put["w"], NamedSharding(mesh, P(None)))
    assert moved.placements == (Replicate(),) and torch.equal(moved.to_local(), tree["w"])
    # Rank 0's value is the one placed, even if ranks disagree.
    mine = device_put(torch.full((world_size,), float(rank)), NamedSharding(mesh, P("dp")))
    assert torch.equal(mine.to_local(), torch.zeros(1))
    # with_sharding_constraint: a DTensor is redistributed; a plain tensor is split locally.
    with set_mesh(mesh):
        c = with_sharding_constraint({"a": moved, "b": tree["w"]}, {"a": P("dp"), "b": P(None, None)})
    assert c["a"].placements == (Shard(0),) and torch.equal(c["a"].to_local(), tree["w"][4 * rank:4 * rank + 4])
    assert c["b"].placements == (Replicate(),)
    return {"text": visualize_sharding(put["w"]), "group": mesh.group_name("dp")}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_mesh_and_device_put_on_gloo(world_size):
    results = run_world(world_size, _mesh_world)
    text = results[0]["text"]
    for rank in range(world_size):
        assert f"rank {rank}" in text and f"[{4 * rank}:{4 * rank + 4}, 0:3]" in text
    assert len({r["group"] for r in results}) == 1


def _mesh_2x2_world(rank: int, world_size: int) -> dict:
    mesh = make_mesh((2, 2), ("dp", "tp"))
    dp, tp = divmod(rank, 2)
    assert (mesh.axis_index("dp"), mesh.axis_index("tp"), mesh.axis_index(("dp", "tp"))) == (dp, tp, rank)
    assert mesh.axis_index(("tp", "dp")) == tp * 2 + dp
    assert dist.get_process_group_ranks(mesh.group("tp")) == [2 * dp, 2 * dp + 1]
    assert dist.get_process_group_ranks(mesh.group("dp")) == [tp, tp + 2]
    x = torch.arange(64.0).reshape(8, 8)
    expected = {
        P("dp"): x[4 * dp:4 * dp + 4],
        P(None, "tp"): x[:, 4 * tp:4 * tp + 4],
        P(("dp", "tp")): x[2 * rank:2 * rank + 2],
        P("dp", "tp"): x[4 * dp:4 * dp + 4, 4 * tp:4 * tp + 4],
        P("tp", "dp"): x[4 * tp:4 * tp + 4, 4 * dp:4 * dp + 4],
        P(): x,
    }
    with set_mesh(mesh):
        for spec, block in expected.items():
            put = device_put(x, spec)
            assert torch.equal(put.to_local(), block), spec
            assert sharding_of(put).spec == spec
            assert torch.equal(device_get(put), x)
        # Resharding a DTensor from one spec to another.
        moved = device_put(device_put(x, P("dp")), P(None, ("dp", "tp")))
        assert torch.equal(moved.to_local(), x[:, 2 * rank:2 * rank + 2])
    return visualize_sharding(device_put(x, NamedSharding(mesh, P(("dp", "tp")))))


@pytest.mark.slow
def test_2x2_mesh_on_gloo():
    text = run_world(4, _mesh_2x2_world)[0]
    for rank in range(4):
        assert f"rank {rank}" in text and f"[{2 * rank}:{2 * rank + 2}, 0:8]" in text


def test_world_started_by_pt3func_is_destroyed_at_exit():
    import subprocess
    import sys

    code = (
        "import atexit, torch.distributed as dist, pt3func as pf\n"
        "from pt3func.sharding import mesh\n"
        "hooks = []\n"
        "atexit.register = hooks.append\n"
        "pf.make_mesh((1,), ('dp',))\n"
        "assert dist.is_initialized() and mesh._shutdown_world in hooks\n"
        "mesh._shutdown_world()\n"
        "assert not dist.is_initialized()\n"
        "mesh._shutdown_world()  # a user's own destroy_process_group before exit leaves nothing to do\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
