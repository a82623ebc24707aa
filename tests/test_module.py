"""functionalize: params trees, pure apply, buffer updates, tied weights, errors and tracing."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func import tree
from pt3func.module import functionalize


def _get(params, path):
    for key in path:
        params = params[key]
    return params


def _snapshot(params):
    return tree.map(lambda t: t.clone(), params)


def _assert_tree_equal(a, b):
    assert tree.structure(a) == tree.structure(b)
    for x, y in zip(tree.leaves(a), tree.leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _requires_grad(params, apply):
    """`params` with fresh leaves, the parameters requiring grad (buffers never do)."""
    wanted = set(apply.param_paths)
    return tree.map_with_path(lambda path, t: t.detach().requires_grad_(path in wanted), params)


def _grads(loss, params, apply):
    grads = torch.autograd.grad(loss, [_get(params, path) for path in apply.param_paths])
    return dict(zip(apply.param_paths, grads, strict=True))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.embed(ids)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.register_buffer("offset", torch.zeros(4))
        self.register_buffer("mask", torch.ones(4), persistent=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.scale * (x + self.offset) * self.mask


class Counter(nn.Module):
    """Updates a buffer by reassigning it rather than in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count = self.count + 1
        return x * 2


def test_params_tree_mirrors_module():
    module = Nested()
    params, apply = functionalize(module)
    assert set(params) == {"scale", "blocks", "offset", "mask"}
    assert set(params["blocks"]) == {"0", "1"}
    assert set(params["blocks"]["0"]) == {"weight", "bias"}
    for leaf in tree.leaves(params):
        assert type(leaf) is torch.Tensor and not leaf.requires_grad
    assert params["blocks"]["1"]["weight"].data_ptr() == module.blocks[1].weight.data_ptr()
    assert set(apply.buffer_paths) == {("offset",), ("mask",)}
    assert ("blocks", "0", "weight") in apply.param_paths and len(apply.param_paths) == 5
    x = torch.randn(3, 4)
    torch.testing.assert_close(apply(params, x), module(x))


def test_transformer_encoder_layer_output_and_grads():
    torch.manual_seed(0)
    module = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True).eval()
    params, apply = functionalize(module)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(apply(params, x), module(x))

    params = _requires_grad(params, apply)
    grads = _grads(apply(params, x).square().mean(), params, apply)
    module(x).square().mean().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[tuple(name.split("."))], p.grad)


def test_batchnorm_train_updates_are_functional():
    torch.manual_seed(0)
    module = ConvBN().train()
    reference = copy.deepcopy(module)
    state_before = {k: v.clone() for k, v in module.state_dict().items()}
    params, apply = functionalize(module)
    given = _snapshot(params)
    x1, x2 = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)

    out, new_params = apply.with_updates(params, x1)
    torch.testing.assert_close(out, reference(x1))
    out, new_params = apply.with_updates(new_params, x2)
    torch.testing.assert_close(out, reference(x2))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(new_params["bn"][name], getattr(reference.bn, name))
    assert new_params["conv"]["weight"] is params["conv"]["weight"]

    apply(params, x1)
    _assert_tree_equal(params, given)
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, state_before[key], rtol=0, atol=0)


def test_reassigned_buffer_is_returned():
    params, apply = functionalize(Counter())
    _, new_params = apply.with_updates(params, torch.ones(2))
    _, new_params = apply.with_updates(new_params, torch.ones(2))
    assert new_params["count"].item() == 2 and params["count"].item() == 0
    assert apply.module.count.item() == 0


def test_other_key_order_and_container():
    module = Nested()
    params, apply = functionalize(module)
    reordered = OrderedDict(reversed(list(params.items())))
    x = torch.randn(3, 4)
    torch.testing.assert_close(apply(reordered, x), module(x))
    _, new_params = apply.with_updates(reordered, x)
    assert type(new_params) is OrderedDict and list(new_params) == list(reordered)


def test_tied_weights_appear_once_and_accumulate_grads():
    torch.manual_seed(0)
    module = TiedLM()
    params, apply = functionalize(module)
    assert params == {"embed": {"weight": params["embed"]["weight"]}}
    assert apply.tied_paths == {("out", "weight"): ("embed", "weight")}
    ids = torch.randint(0, 10, (3, 6))

    params = _requires_grad(params, apply)
    grads = _grads(F.cross_entropy(apply(params, ids).flatten(0, 1), ids.flatten()), params, apply)
    F.cross_entropy(module(ids).flatten(0, 1), ids.flatten()).backward()
    torch.testing.assert_close(grads[("embed", "weight")], module.embed.weight.grad)
    assert module.out.weight is module.embed.weight


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def test_huggingface_gpt2_logits_and_grads():
    module = _gpt2()
    params, apply = functionalize(module)
    assert "lm_head" not in params
    assert apply.tied_paths == {("lm_head", "weight"): ("transformer", "wte", "weight")}
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(apply(params, input_ids=ids).logits, module(input_ids=ids).logits)

    params = _requires_grad(params, apply)
    grads = _grads(apply(params, input_ids=ids, labels=ids).loss, params, apply)
    module(input_ids=ids, labels=ids).loss.backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[tuple(name.split("."))], p.grad)


def test_errors_name_the_path():
    params, apply = functionalize(Nested())
    x = torch.randn(3, 4)

    missing = copy.copy(params)
    missing["blocks"] = {"0": params["blocks"]["0"], "1": {"weight": params["blocks"]["1"]["weight"]}}
    with pytest.raises(ValueError, match=r"params\['blocks'\]\['1'\]\['bias'\]: missing"):
        apply(missing, x)

    wrong = copy.copy(params)
    wrong["blocks"] = {"0": {"weight": torch.zeros(4, 5), "bias": torch.zeros(4)}, "1": params["blocks"]["1"]}
    with pytest.raises(
        ValueError, match=r"params\['blocks'\]\['0'\]\['weight'\]: expected shape \(4, 4\), got \(4, 5\)"
    ):
        apply(wrong, x)

    extra = {**params, "bogus": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"params\['bogus'\]: unexpected key"):
        apply.with_updates(extra, x)

    tied_params, tied_apply = functionalize(TiedLM())
    doubled = {**tied_params, "out": {"weight": tied_params["embed"]["weight"]}}
    with pytest.raises(ValueError, match=r"params\['out'\]\['weight'\]: unexpected key; it is tied to"):
        tied_apply(doubled, torch.zeros(1, 2, dtype=torch.long))


def _sgd_step(apply, loss_fn, lr=0.1):
    """A whole train step: forward with buffer updates, grads by autograd, SGD on the parameters."""

    def step(params, *batch):
        params = _requires_grad(params, apply)
        out, new_params = apply.with_updates(params, *batch[:-1])
        loss = loss_fn(out, batch[-1])
        grads = _grads(loss, params, apply)
        new_params = tree.map_with_path(
            lambda path, t: (t - lr * grads[path]).detach() if path in grads else t.detach(), new_params
        )
        return loss.detach(), new_params

    return step


@pytest.mark.parametrize("model", ["convbn", "gpt2"])
def test_train_step_traces_with_make_fx(model):
    torch.manual_seed(0)
    if model == "convbn":
        module = ConvBN().train()
        batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
        loss_fn = F.cross_entropy
    else:
        module = _gpt2()
        ids = torch.randint(0, 100, (2, 12))
        batch = (ids, ids)
        loss_fn = lambda out, ids: F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    params, apply = functionalize(module)
    step = _sgd_step(apply, loss_fn)
    given = _snapshot(params)

    traced = make_fx(step, tracing_mode="fake")(params, *batch)
    _assert_tree_equal(params, given)
    eager_loss, eager_params = step(params, *batch)
    traced_loss, traced_params = traced(params, *batch)
    torch.testing.assert_close(traced_loss, eager_loss)
    assert tree.structure(traced_params) == tree.structure(params)
    for a, b in zip(tree.leaves(traced_params), tree.leaves(eager_params), strict=True):
        torch.testing.assert_close(a, b)
    _assert_tree_equal(params, given)
    if model == "convbn":
        assert traced_params["bn"]["num_batches_tracked"].item() == 1
        assert not torch.equal(traced_params["bn"]["running_mean"], params["bn"]["running_mean"])


def test_grad_of_a_tree_with_buffers_treats_them_as_constants():
    # BatchNorm in training mode, differentiated with respect to the whole tree functionalize returns
    # (parameters and running statistics): the buffers get zero gradients, the parameters torch's.
    import pt3func as pf

    torch.manual_seed(0)
    module = ConvBN().train()
    reference = copy.deepcopy(module)
    params, apply = functionalize(module)
    x = torch.randn(4, 3, 8, 8)
    grads = pf.grad(lambda p: apply(p, x).square().mean())(params)
    reference(x).square().mean().backward()
    for name, p in reference.named_parameters():
        layer, leaf = name.split(".")
        torch.testing.assert_close(grads[layer][leaf], p.grad)
    for name in ("running_mean", "running_var"):
        assert not grads["bn"][name].any()


class _Remembers(torch.nn.Module):
    """A forward that writes module state: an attribute, a lazily filled buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.last = None
        self.register_buffer("lazy", None)

    def forward(self, x):
        y = self.lin(x)
        self.last = y.detach()
        self.lazy = y.detach().sum(0)
        self.calls = 1
        return y


@pytest.mark.parametrize("jitted", [False, True])
def test_apply_leaves_the_modules_own_state_alone(jitted):
    model = _Remembers()
    params, apply = pf.functionalize(model)
    run = pf.jit(apply, backend="eager") if jitted else apply
    out = run(params, torch.ones(4, 3))
    assert out.shape == (4, 2)
    assert model.last is None and model.lazy is None and not hasattr(model, "calls")
    with_updates = pf.jit(apply.with_updates, backend="eager") if jitted else apply.with_updates
    with_updates(params, torch.ones(4, 3))
    assert model.last is None and model.lazy is None
    assert type(model(torch.ones(1, 3))) is torch.Tensor  # the module still runs eagerly, with real tensors


def test_frozen_parameters_are_named_and_split_off():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"1 parameters have requires_grad=False \(0.weight\)"):
        params, apply = pf.functionalize(model)
    assert apply.frozen_paths == (("0", "weight"),)
    trainable, frozen = apply.partition(params)
    assert frozen == {"0": {"weight": params["0"]["weight"]}}
    assert set(trainable) == {"0", "2"} and set(trainable["0"]) == {"bias"}
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    opt = pf.optim.adamw(0.1, weight_decay=0.1)

    @pf.jit
    def step(trainable, state):
        grads = pf.grad(lambda t: F.mse_loss(apply(apply.combine(t, frozen), x), y))(trainable)
        updates, state = opt.update(grads, state, trainable)
        return pf.optim.apply_updates(trainable, updates), state

    state = opt.init(trainable)
    reference = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    for _ in range(3):
        trainable, state = step(trainable, state)
        reference.zero_grad()
        F.mse_loss(model(x), y).backward()
        reference.step()
    got = apply.combine(trainable, frozen)
    for name, p in model.named_parameters():
        a, b = name.split(".")
        torch.testing.assert_close(got[a][b], p.detach(), rtol=1e-5, atol=1e-6)


class _Counter(torch.nn.Module):
    def __init__(self, shared: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("step", shared)

    def forward(self, x):
        self.step = self.step + 1
        return x * self.step


def test_reassigning_one_name_of_a_tied_buffer_is_refused():
    shared = torch.zeros(())
    model = torch.nn.Sequential(torch.nn.Identity(), _Counter(shared))
    model[0].register_buffer("step", shared)  # the same tensor under 0.step and 1.step
    params, apply = pf.functionalize(model)
    with pytest.raises(ValueError, match=r"params\['1'\]\['step'\]: the forward reassigned it, but it is tied to "
                                         r"params\['0'\]\['step'\]"):
        apply.with_updates(params, torch.ones(2))


def test_a_sparse_embedding_is_refused_when_differentiated_in_a_jitted_step():
    model = torch.nn.Embedding(10, 4, sparse=True, padding_idx=1)
    params, apply = pf.functionalize(model)
    ids = torch.tensor([[1, 2, 3]])

    def step(p):
        return pf.grad(lambda p: apply(p, ids).square().sum())(p)

    with pytest.raises(pf.TracingError, match=r"test_module.py:\d+ .*embedding with sparse=True.*sparse=False"):
        pf.jit(step)(params)
    out = pf.jit(lambda p: apply(p, ids))(params)  # no gradient: the lookup itself is fine
    torch.testing.assert_close(out, model(ids).detach())
