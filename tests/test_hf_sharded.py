"""Hugging Face Llama (fused attention with the mask the model builds itself) in data parallel and FSDP steps
on a virtual mesh: same losses and parameters as one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.analysis import is_collective

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_llama_sharded_equals_one_device(layout):
    params, apply = pf.functionalize(_llama())
    opt = pf.optim.adamw(1e-3)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def step(p, s, ids):
        def loss_fn(p, ids):  # the batch as an argument: FSDP gathers the params it is used with
            logits = apply(p, input_ids=ids, use_cache=False).logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

        loss, g = pf.value_and_grad(loss_fn)(p, ids)
        updates, s = opt.update(g, s, p)
        return pf.optim.apply_updates(p, updates), s, loss

    def train(jitted, p, batch):
        s, losses = opt.init(p), []
        for _ in range(2):
            p, s, loss = jitted(p, s, batch)
            losses.append(float(pf.device_get(loss)))
        return p, losses

    ref_params, ref_losses = train(pf.jit(step, backend="eager"), params, ids)
    mesh = pf.make_mesh((2,), ("dp",), virtual=True)
    with pf.set_mesh(mesh):
        specs = pf.tree.map(lambda t: P("dp") if layout == "fsdp" and t.shape[0] % 2 == 0 else P(), params)
        batch = pf.device_put(ids, P("dp"))
        sharded, losses = train(pf.jit(step, backend="eager"), pf.device_put(params, specs), batch)
        sharded = pf.device_get(sharded)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for a, b in zip(pf.tree.leaves(sharded), pf.tree.leaves(ref_params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _megatron_spec(path, leaf) -> P:
    """Column-parallel q/k/v/gate/up (output features split), row-parallel o/down (input features split)."""
    key = pf.tree.keystr(path)
    if any(name in key for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return P("tp", None)
    if any(name in key for name in ("o_proj", "down_proj")):
        return P(None, "tp")
    return P()


@pytest.mark.parametrize("axes", [("tp",), ("dp", "tp")])
def test_llama_tensor_parallel_equals_one_device(axes):
    # Hugging Face Llama with its own RMSNorm (x * rsqrt(mean(x**2))): the residual stream is reduced where each
    # row-parallel output joins it, as in Megatron (two all-reduces over tp a layer in the forward), and no weight
    # is gathered (DTensor alone kept the stream a partial sum and gathered every column-parallel weight).
    params, apply = pf.functionalize(_llama())
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def loss_fn(p, ids):
        logits = apply(p, input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

    step = pf.jit(pf.value_and_grad(loss_fn), backend="eager")
    want_loss, want_grads = step(params, ids)
    mesh = pf.make_mesh((2,) * len(axes), axes, virtual=True)
    with pf.set_mesh(mesh):
        sharded = pf.device_put(params, pf.tree.map_with_path(_megatron_spec, params))
        batch = pf.device_put(ids, P("dp") if "dp" in axes else P())
        loss, grads = pf.device_get(step(sharded, batch))
        gm = step.lower(sharded, batch).graph_module
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for got, want in zip(pf.tree.leaves(grads), pf.tree.leaves(want_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    collectives = [n for n in gm.graph.nodes if is_collective(n) and "wait" not in str(n.target)]
    # With the batch split over dp, the loss's mean over it adds its own two scalar all-reduces (sum and count of
    # targets, `spmd/mean_loss.py`): not a layer's.
    forward = [n for n in collectives if not n.meta.get("custom") and "F.cross_entropy(" not in
               n.meta.get("stack_trace", "")]
    assert [str(n.target) for n in forward] == ["_c10d_functional.all_reduce.default"] * 2  # one layer
    assert not [n for n in collectives if "all_gather" in str(n.target)]
