"""Session 18: module watches after a model is replaced, Python ints beyond int64."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pt3func as pf


class _Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x @ self.w, 0.5, self.training)


def test_replaced_model_modes_are_watched_again() -> None:
    # A step reading a global model; the model replaced by a fresh one (CPython gives it the dead one's id): its
    # train / eval switches must still pick the program traced in that mode, and the dead model's programs go.
    holder = {}

    @pf.jit(backend="eager")
    def predict(x: torch.Tensor) -> torch.Tensor:
        return holder["model"](x)

    x = torch.ones(4, 8)
    for fold in range(3):
        holder.pop("model", None)
        torch.manual_seed(fold)
        holder["model"] = _Dropper().requires_grad_(False)
        for training in (False, True, False):
            holder["model"].train(training)
            torch.manual_seed(1)
            got = predict(x)
            torch.manual_seed(1)
            want = holder["model"](x)
            assert torch.equal(got, want), (fold, training)
    assert len(predict._cache) <= 2  # the dead models' programs were dropped with their watches


def test_int_beyond_int64_is_named() -> None:
    f = pf.jit(lambda x, s: x * s, backend="eager")
    x = torch.ones(2, dtype=torch.float64)
    with pytest.raises(pf.TracingError, match=r"argument s = 9223372036854775808 does not fit in int64"):
        f(x, 2**63)
    assert torch.equal(f(x, 3), x * 3)
    with pytest.raises(pf.TracingError, match=r"argument s = -9223372036854775809 .*static_argnums"):
        f(x, -(2**63) - 1)  # a cached program: the value is converted at call time


def test_packed_sequence_is_named_as_a_value_read() -> None:
    # torch's RNN sizes its initial state by a packed sequence's batch_sizes[0]: a traced tensor as a size gave a
    # bare TypeError ("argument 'size' ... got FakeTensor") without the user's line.
    from torch.nn.utils.rnn import pack_padded_sequence

    params, apply = pf.functionalize(nn.GRU(4, 6, batch_first=True))

    def loss(p, x, lengths):
        _, h = apply(p, pack_padded_sequence(x, lengths, batch_first=True))
        return h.square().mean()

    with pytest.raises(pf.DataDependentControlFlowError, match=r"test_jit_s18.py:\d+"):
        pf.jit(loss, backend="eager")(params, torch.randn(3, 5, 4), torch.tensor([5, 3, 2]))
