"""pf.make_mesh's arguments: the world's timeout (torch's default unless given) and a str as axis names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pt3func as pf
from pt3func.errors import ShardingError

ROOT = Path(__file__).resolve().parents[1]
PROBE = """\
import sys
from datetime import timedelta
import torch, torch.distributed as dist
import pt3func as pf

given = {} if sys.argv[1] == "default" else {"timeout": timedelta(seconds=float(sys.argv[1]))}
mesh = pf.make_mesh((1,), ("dp",), **given)
world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
print(f"axes={mesh.axis_names} timeout={world.total_seconds():.0f}")
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "mesh_probe.py"
    path.write_text(PROBE)
    return path


def _python(*args: str | Path) -> str:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # keep a caller's own site dirs
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path}, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_world_timeout_is_torchs_default_unless_given(probe):
    # A rank-0-only evaluation between steps keeps the others waiting in a collective: 30 min for gloo, not 60 s.
    under_launcher = _python("-m", "pt3func", "run", probe, "default")  # from torchrun's variables
    assert "axes=('dp',) timeout=1800" in under_launcher
    assert "axes=('dp',) timeout=7" in _python(probe, "7")  # no launcher: a world of one


def test_a_str_names_the_one_axis_of_a_1d_mesh_only():
    with pytest.raises(ShardingError, match=r"axis_names 'dp' is a single str, which names one axis, but mesh shape "
                                            r"\(2, 2\) has 2; pass a tuple of 2 names"):
        pf.make_mesh((2, 2), "dp")
    with pytest.raises(ShardingError, match="single str"):
        pf.make_mesh((1, 1), "dp", virtual=True)
    assert pf.make_mesh((2,), "dp", virtual=True).axis_names == ("dp",)  # not ("d", "p")


def test_a_local_rank_without_a_gpu_is_refused_with_the_way_out(monkeypatch):
    # torch.cuda.set_device(LOCAL_RANK) with more local ranks than GPUs fails with "invalid device ordinal".
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a world is already running in this process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ShardingError, match=r"local rank 1 has no GPU.*sees 1 CUDA device.*device_type='cpu'"):
        pf.make_mesh((2,), ("dp",))
    assert not dist.is_initialized()
    from pt3func.sharding.mesh import _backend_for

    assert _backend_for("cpu") == "gloo"  # a CPU mesh asks for gloo, whatever GPUs there are
