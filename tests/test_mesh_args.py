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
