"""with_sharding_constraint in a step, shard_map vs automatic TP, a TP+DP transformer, sharding errors."""

from __future__ import annotations

import pytest
import spmd_more_cases
import torch
from dist import run_world

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    return run_world(4, spmd_more_cases.run_all)


def test_with_sharding_constraint_inside_step(results):
    r = results[0]["constraint"]
    assert r["placements"] == "(Shard(dim=0),)"
    torch.testing.assert_close(r["full"], torch.arange(8.0).reshape(8, 1) * 2 + 1)


def test_shard_map_tp_layer_equals_automatic_tp(results):
    r = results[0]["shard_map"]
    for name in ("automatic", "by_hand"):
        torch.testing.assert_close(r[name]["loss"], r["single"]["loss"], rtol=1e-5, atol=1e-6)
        for k in ("w1", "w2"):
            torch.testing.assert_close(r[name]["grads"][k], r["single"]["grads"][k], rtol=1e-5, atol=1e-6)
    # Same forward traffic: one all-reduce of the (8, 16) row-parallel output.
    assert r["automatic_comm"]["all_reduce"] >= 8 * 16 * 4
    assert r["by_hand_comm"]["all_reduce"] >= 8 * 16 * 4


def test_gpt_with_tp_attention_and_dp_matches_one_device(results):
    r = results[0]["gpt"]
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want))
    assert r["max_param_err"] <= 1e-5
    assert "over 'tp'" in r["text"] and "over 'dp'" in r["text"]
    # Megatron's forward: one all-reduce over tp per attention and per MLP (2 layers -> 4); besides, only the
    # loss's mean over the dp-split batch (its sum and its count of targets: two 4-byte all-reduces over dp).
    forward = [line for line in r["text"].splitlines() if "COLLECTIVE" in line and "gpt.py" in line]
    over_tp = [line for line in forward if "all_reduce over 'tp'" in line]
    assert len(over_tp) == 4, forward
    assert all("all_reduce over 'dp', 4 B" in line for line in forward if line not in over_tp), forward
    assert len(forward) <= 6, forward


def test_sharding_errors_name_the_culprit(results):
    m = results[0]["errors"]
    assert "(3,) has 3 devices but the world has 4" in m["world"]
    assert "donated input params['w']" in m["donation"] and "Shard(dim=0)" in m["donation"]
    assert "in_shardings of params['w']" in m["divisible"] and "dim 1 of shape (8, 6)" in m["divisible"]
    assert "axis size 4" in m["divisible"] and "P(None, 'dp')" in m["divisible"]


def test_unusable_sharded_donation_is_reported_with_its_placements(results):
    message = results[0]["errors"]["unused_donation"]
    assert "cannot be reused" in message and "placements (Shard(dim=0),)" in message, message
