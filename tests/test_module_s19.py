"""Session 19: `apply` keeps a module's one-time setup flag (Hugging Face installs its output-capturing hooks once
and flags it; dropping the flag after each call installed the hooks again: hidden states came back duplicated)."""

from __future__ import annotations

import torch
import torch.nn as nn

import pt3func as pf


class _LazilyHooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.seen = []

    def forward(self, x):
        if not getattr(self, "_hooks_installed", False):  # Hugging Face's output capturing, in miniature
            self.inner.register_forward_hook(lambda m, args, out: self.seen.append(out.shape))
            self._hooks_installed = True
        return self.inner(x)


def test_a_setup_flag_set_by_the_forward_is_kept():
    model = _LazilyHooked()
    params, apply = pf.functionalize(model)
    x = torch.randn(2, 3)
    for _ in range(3):
        apply(params, x)
    assert len(model.seen) == 3  # one hook, run once a call (1 + 2 + 3 = 6 when it was installed each call)
    step = pf.jit(lambda p, x: apply(p, x).sum(), backend="eager")
    torch.testing.assert_close(step(params, x), model(x).sum())
    assert len(model.inner._forward_hooks) == 1


def test_hugging_face_hidden_states_are_not_duplicated():
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(config)
    params, apply = pf.functionalize(model)
    x = torch.randint(0, 64, (2, 5))
    counts = [len(apply(params, input_ids=x, output_hidden_states=True).hidden_states) for _ in range(3)]
    jitted = pf.jit(lambda p, x: apply(p, input_ids=x, output_hidden_states=True).hidden_states, backend="eager")
    counts += [len(jitted(params, x)), len(jitted(params, torch.randint(0, 64, (2, 6))))]
    assert counts == [3] * 5
    assert len(model(input_ids=x, output_hidden_states=True).hidden_states) == 3
