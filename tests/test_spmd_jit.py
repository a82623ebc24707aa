"""Sharded pf.jit on real gloo worlds of 2 and 4 ranks, each checked against the single-device run."""

from __future__ import annotations

import pytest
import spmd_cases
import torch
from dist import run_world

pytestmark = pytest.mark.slow

FOUR_RANK = ["dp", "fsdp", "zero1", "tp", "dp_tp", "fsdp_tp"]
TWO_RANK = ["dp2", "fsdp2"]
PARAM_BYTES = (16 * 32 + 32 + 32 * 8) * 4


def _run_cases(rank: int, world: int, names: list[str]) -> dict:
    return {name: spmd_cases.run_case(name) for name in names}


def _run_inductor_cases(rank: int, world: int, names: list[str]) -> dict:
    results = {name: spmd_cases.run_case(name, backend="inductor") for name in names}
    spmd_cases.pf.config.gradient_bucket_bytes = 25 * 2**20  # opt-in gradient bucketing (passes/bucketing.py)
    results["dp2_bucketed"] = spmd_cases.run_case("dp2", backend="inductor")
    spmd_cases.pf.config.gradient_bucket_bytes = None
    return results


@pytest.fixture(scope="module")
def reference():
    return spmd_cases.reference()


@pytest.fixture(scope="module")
def four_rank_results():
    return run_world(4, _run_cases, FOUR_RANK)


@pytest.fixture(scope="module")
def two_rank_results():
    return run_world(2, _run_cases, TWO_RANK)


def _assert_matches(result: dict, reference) -> None:
    ref_params, ref_losses = reference
    for got, want in zip(result["losses"], ref_losses):
        assert abs(got - want) <= 1e-5 * max(abs(want), 1.0)
    for path, want in zip(spmd_cases.pf.tree.paths(ref_params), spmd_cases.pf.tree.leaves(ref_params)):
        got = result["params"]
        for key in path:
            got = got[key]
        assert float((got - want).norm() / want.norm().clamp_min(1e-12)) <= 1e-5, path
    assert result["trace_count"] == 1


@pytest.mark.parametrize("name", FOUR_RANK)
def test_four_ranks_match_single_device(four_rank_results, reference, name):
    for rank_result in four_rank_results:
        _assert_matches(rank_result[name], reference)


@pytest.mark.parametrize("name", TWO_RANK)
def test_two_ranks_match_single_device(two_rank_results, reference, name):
    for rank_result in two_rank_results:
        _assert_matches(rank_result[name], reference)


@pytest.fixture(scope="module")
def two_rank_inductor_results():
    return run_world(2, _run_inductor_cases, TWO_RANK)


@pytest.mark.parametrize("name", [*TWO_RANK, "dp2_bucketed"])
def test_inductor_programs_match_single_device(two_rank_inductor_results, reference, name):
    # Compiled programs also go through the overlap passes (collectives issued early, waits sunk, updates
    # reordered), which the op-by-op runs above skip.
    for rank_result in two_rank_inductor_results:
        _assert_matches(rank_result[name], reference)


def test_fsdp_reduce_scatters_are_issued_during_the_backward(two_rank_inductor_results):
    lines = two_rank_inductor_results[0]["fsdp2"]["text"].splitlines()
    scatters = [i for i, line in enumerate(lines) if "reduce_scatter_tensor(" in line]
    mms = [i for i, line in enumerate(lines) if " aten.mm(" in line]
    assert len(scatters) == 3
    assert scatters[0] < max(mms), "the first gradient's reduce-scatter waits for the whole backward"


def test_data_parallel_program(four_rank_results):
    r = four_rank_results[0]["dp"]
    # One all-reduce per gradient (the parameter bytes) and one for the mean loss.
    assert r["comm_bytes"] == {"all_reduce": PARAM_BYTES + 4}
    assert "grad of params['fc1']['w']" in r["text"]
    assert r["local_sizes"] == {"['fc1']['b']": 32, "['fc1']['w']": 512, "['fc2']['w']": 256}


def test_fsdp_program_and_local_sizes(four_rank_results):
    r = four_rank_results[0]["fsdp"]
    # All-gather every parameter for the forward, reduce-scatter every gradient, no gradient all-reduce.
    assert r["comm_bytes"] == {"all_gather_into_tensor": PARAM_BYTES, "reduce_scatter_tensor": PARAM_BYTES,
                               "all_reduce": 4}
    assert r["local_sizes"] == {"['fc1']['b']": 8, "['fc1']['w']": 128, "['fc2']['w']": 64}
    assert sorted(r["state_sizes"]) == sorted([8, 128, 64] * 2)  # Adam moments sharded like the params
    assert "FSDP: gather params['fc1']['w'] over dp" in r["text"]


def test_zero1_shards_only_the_optimizer_state(four_rank_results):
    r = four_rank_results[0]["zero1"]
    assert r["local_sizes"] == {"['fc1']['b']": 32, "['fc1']['w']": 512, "['fc2']['w']": 256}
    assert sorted(n for n in r["state_sizes"] if n > 1) == sorted([8, 128, 64] * 2)
    # Gradients all-reduced, the updated (sharded) parameters gathered back to replicated.
    assert r["comm_bytes"]["all_gather_into_tensor"] == PARAM_BYTES


def test_tensor_parallel_forward_has_one_all_reduce(four_rank_results):
    r = four_rank_results[0]["tp"]
    forward = [line for line in r["text"].splitlines() if "COLLECTIVE" in line and "backward" not in line
               and "grad of" not in line]
    assert len(forward) == 1 and "all_reduce over 'tp'" in forward[0], forward
    assert r["local_sizes"] == {"['fc1']['b']": 8, "['fc1']['w']": 128, "['fc2']['w']": 64}


def test_fsdp_tp_shards_over_both_axes(four_rank_results):
    r = four_rank_results[0]["fsdp_tp"]
    assert r["local_sizes"]["['fc1']['w']"] == 16 * 32 // 4
    assert "over 'dp'" in r["text"] and "over 'tp'" in r["text"]


def test_rank_results_agree(four_rank_results):
    for name in FOUR_RANK:
        first = four_rank_results[0][name]["params"]
        for other in four_rank_results[1:]:
            for a, b in zip(spmd_cases.pf.tree.leaves(first), spmd_cases.pf.tree.leaves(other[name]["params"])):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_sharded_donation_updates_local_shards_in_place(four_rank_results, name):
    r = four_rank_results[0][name]
    assert r["params_in_place"], "the new params do not live in the donated buffers"
    report = r["donation_report"]
    assert report and all(row["aliased"] for row in report), report
    assert {row["input"] for row in report} >= {"params['fc1']['w']", "params['fc2']['w']"}


def test_zero1_donation_reuses_every_buffer(four_rank_results):
    # Params replicated, optimizer state sharded: each donated leaf still finds its own output.
    report = four_rank_results[0]["zero1"]["donation_report"]
    assert all(row["aliased"] for row in report), report


def test_data_parallel_gradients_are_bucketed(two_rank_inductor_results):
    # Bucketed: one all-reduce for the three small gradients (passes/bucketing.py), one for the loss; by
    # default one per gradient.
    text = two_rank_inductor_results[0]["dp2_bucketed"]["text"]
    lines = [line for line in text.splitlines() if "all_reduce(" in line]
    assert len(lines) == 2
    assert "grad of 3 leaves (bucket)" in lines[0]
    assert two_rank_inductor_results[0]["dp2"]["text"].count("all_reduce(") == 4
