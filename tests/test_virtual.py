"""The virtual mesh: every rank in one process, results equal to the multi-process run and to one device."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import spmd_cases
import torch
from dist import run_world

pytestmark = pytest.mark.slow

CASES = ["dp", "fsdp", "tp", "dp_tp"]
HERE = os.path.dirname(__file__)


def _run_cases(rank: int, world: int, names: list[str]) -> dict:
    return {name: spmd_cases.run_case(name) for name in names}


@pytest.fixture(scope="module")
def virtual_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("virtual") / "results.pkl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "virtual_main.py"), str(out), ",".join(CASES)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def process_results():
    return run_world(4, _run_cases, CASES)[0]


@pytest.mark.parametrize("name", CASES)
def test_virtual_equals_multiprocess_and_single_device(virtual_results, process_results, name):
    ref_params, ref_losses = spmd_cases.reference()
    virtual, process = virtual_results[name], process_results[name]
    for a, b, ref in zip(virtual["losses"], process["losses"], ref_losses):
        assert abs(a - b) <= 1e-6 and abs(a - ref) <= 1e-5
    for leaf_v, leaf_p, leaf_r in zip(*(spmd_cases.pf.tree.leaves(t) for t in
                                        (virtual["params"], process["params"], ref_params))):
        torch.testing.assert_close(leaf_v, leaf_p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(leaf_v, leaf_r, rtol=1e-5, atol=1e-6)
    assert virtual["local_sizes"] == process["local_sizes"]
    assert virtual["comm_bytes"] == process["comm_bytes"]
