"""Session 16: checkpoint dict order without a target; optimizer updates of another shape than their parameter."""

import pytest
import torch

import pt3func as pf


def test_restore_without_target_keeps_dict_insertion_order(tmp_path):
    # optree lists a dict's keys sorted; the manifest must keep the saved order, or a jitted step called with the
    # restored params traces again (dict order is part of its signature) and iteration order changes.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params, apply = pf.functionalize(model)
    tree = {"params": params, "z": {"b": torch.ones(1), "a": [{"y": torch.zeros(2), "x": torch.ones(2)}]}}
    manager = pf.checkpointing.CheckpointManager(tmp_path / "ck", async_save=False)
    manager.save(0, tree)
    back = manager.restore()
    assert list(back["params"]["0"]) == list(params["0"]) == ["weight", "bias"]
    assert list(back["z"]) == ["b", "a"] and list(back["z"]["a"][0]) == ["y", "x"]
    assert pf.tree.paths(back) == pf.tree.paths(tree)
    step = pf.jit(lambda p, x: apply(p, x).sum(), backend="eager")
    x = torch.randn(5, 4)
    torch.testing.assert_close(step(params, x), step(back["params"], x))
    assert step.trace_count() == 1


@pytest.mark.parametrize("jitted", [False, True])
def test_optimizer_names_a_gradient_of_another_shape(jitted):
    params = {"enc": {(1, 2): [torch.randn(3), torch.randn(4)]}, "head": torch.randn(2)}
    grads = {"enc": {(1, 2): [torch.randn(3), torch.randn(5)]}, "head": torch.randn(2)}
    opt = pf.optim.adam(0.1)

    def update(p, g, s):
        return opt.update(g, s, p)

    run = pf.jit(update, backend="eager") if jitted else update
    with pytest.raises(ValueError, match=r"\['enc'\]\[\(1, 2\)\]\[1\] has shape \(5,\), its parameter \(4,\)"):
        run(params, grads, opt.init(params))


def test_broadcastable_gradient_shape_is_refused_not_broadcast():
    # A (4, 4) gradient for a (4,) parameter would broadcast: the parameter and Adam's moments silently grow.
    params = {"w": torch.randn(4)}
    opt = pf.optim.adamw(0.1)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4, 4\), its parameter \(4,\)"):
        opt.update({"w": torch.randn(4, 4)}, state, params)
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4, 4\)"):
        pf.optim.apply_updates(params, {"w": torch.randn(4, 4)})


@pytest.mark.usefixtures("explain_misses")
def test_hooks_registered_or_removed_after_the_trace_trace_again(caplog):
    # A trace runs the hooks registered then; a program that kept a hook's effect after its removal (or missed a
    # new one) is not eager PyTorch's. Both programs are kept, as for train / eval modes.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(3, 4)
    step = pf.jit(lambda x: model(x).sum(), backend="eager")
    plain = step(x)
    handle = model[1].register_forward_hook(lambda m, args, out: out * 2)
    with caplog.at_level("INFO", logger="pt3func.jit"):
        hooked = step(x)
    torch.testing.assert_close(hooked, model(x).sum())
    assert not torch.allclose(hooked, plain)
    assert "hooks of modules the step calls were registered or removed (Tanh)" in caplog.text
    handle.remove()
    torch.testing.assert_close(step(x), plain)
    assert step.trace_count() == 2  # the first program again
    glob = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: out + 1 if m is model else None)
    try:
        torch.testing.assert_close(step(x), model(x).sum())
    finally:
        glob.remove()
    torch.testing.assert_close(step(x), plain)
    assert step.trace_count() == 3

