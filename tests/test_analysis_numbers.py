"""The numbers `Lowered` / `Compiled` report (FLOPs, bytes, source lines) against hand counts and eager PyTorch, and
`step.lower(*args).compile()(*args)` on the arguments `lower` took."""

import os
import re
import threading

import pytest
import torch
import torch.nn.functional as F

import pt3func as pf
from pt3func import P
from pt3func.errors import TracingError
from pt3func.passes import remat_budget
from pt3func.trace.source import is_user_file

HERE = os.path.basename(__file__)


@pytest.fixture(scope="module")
def mesh():
    return pf.make_mesh((2,), ("dp",), virtual=True)


def _flops(fn, *args):
    return pf.jit(fn).lower(*args).cost_analysis()["flops"]


def test_flops_count_cpu_attention_forward_and_backward():
    b, h, s, d = 2, 4, 16, 8
    qkv = [torch.randn(b, h, s, d) for _ in range(3)]

    def loss(q, k, v):
        return F.scaled_dot_product_attention(q, k, v).sum()

    lowered = pf.jit(loss).lower(*qkv)
    assert "_scaled_dot_product_flash_attention_for_cpu" in lowered.as_text()
    fwd = 2 * (2 * b * h * s * s * d)  # Q K^T and P V
    assert lowered.cost_analysis()["flops"] == fwd
    # torch's backward formula: the scores recomputed, then the four products of the gradients (5 of 2 b h s s d)
    both = pf.jit(pf.grad(loss, argnums=(0, 1, 2))).lower(*qkv).cost_analysis()["flops"]
    assert both == fwd + 5 * (2 * b * h * s * s * d)
    # grouped-query attention: every query head does its own products
    kv = torch.randn(b, h // 2, s, d)
    gqa = pf.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum())
    assert gqa.lower(qkv[0], kv, kv).cost_analysis()["flops"] == fwd


def test_flops_count_vector_products_and_bilinear():
    m, n = 64, 32
    W, v, u, bias = torch.randn(m, n), torch.randn(n), torch.randn(m), torch.randn(m)
    assert _flops(lambda W, v: W @ v, W, v) == 2 * m * n  # aten.mv
    assert _flops(lambda a, b: a @ b, v, v) == 2 * n  # aten.dot
    assert _flops(lambda c, W, v: torch.addmv(c, W, v), bias, W, v) == 2 * m * n
    assert _flops(lambda c, u, v: torch.addr(torch.zeros(m, n), u, v) + c[:, None], bias, u, v) == 2 * m * n
    bt, k = 3, 5
    b1, b2 = torch.randn(bt, m, k), torch.randn(bt, k, n)
    assert _flops(lambda c, x, y: torch.addbmm(c, x, y), torch.randn(m, n), b1, b2) == 2 * bt * m * n * k
    N, I, J, O = 4, 6, 7, 3  # noqa: E741 - the layer's dims
    x1, x2, weight = torch.randn(N, I), torch.randn(N, J), torch.randn(O, I, J)
    lowered = pf.jit(lambda a, b, w: F.bilinear(a, b, w)).lower(x1, x2, weight)
    assert "_trilinear" in lowered.as_text()
    assert lowered.cost_analysis()["flops"] == 2 * N * O * I * J


def test_memory_budget_cost_sees_cpu_attention():
    b, h, s, d = 1, 2, 512, 64
    q = torch.randn(b, h, s, d)
    gm = pf.jit(lambda q: F.scaled_dot_product_attention(q, q, q)).lower(q).graph_module
    node = next(n for n in gm.graph.nodes if "flash_attention_for_cpu" in str(n.target))
    assert remat_budget._flops(node) == 2 * (2 * b * h * s * s * d)
    assert remat_budget.compute_bound(node)  # kept rather than run twice, as a matmul is (at 0 FLOPs it was not)


def _distinct_storage_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("returns", ["twice", "views", "split"])
def test_output_bytes_count_each_storage_once(returns):
    def f(x):
        y = x * 2
        if returns == "split":
            return (y, *y.split(8))
        return (y, y) if returns == "twice" else (y, y[:4], y.t())

    x = torch.randn(16, 16)
    memory = pf.jit(f, backend="eager").lower(x).memory_analysis()
    assert memory["output_bytes"] == _distinct_storage_bytes(f(x)) == 16 * 16 * 4
    assert memory["temp_bytes"] == 0


def test_argument_bytes_count_the_memory_arguments_hold():
    row, w = torch.randn(1, 256), torch.randn(256, 8)
    x = row.expand(256, 256)  # a broadcast view: one row of memory

    def f(x, w, w_again, w_t):
        y = x @ w + w_again.sum() + w_t.sum()
        return y, y[:4]

    lowered = pf.jit(f).lower(x, w, w, w.t())
    held = _distinct_storage_bytes([row, w])
    lowered_memory = lowered.memory_analysis()
    assert lowered_memory["argument_bytes"] == held
    assert lowered_memory["output_bytes"] == 256 * 8 * 4
    compiled = lowered.compile()
    assert compiled.generated_code() is not None  # Inductor's figures, not the traced program's again
    compiled_memory = compiled.memory_analysis()
    for key in ("argument_bytes", "output_bytes", "aliased_bytes"):
        assert compiled_memory[key] == lowered_memory[key], key


def test_compiled_signature_error_names_the_leaf_and_shapes():
    def step(params, batch):
        return (batch["x"] @ params["w"]).sum()

    params, batch = {"w": torch.randn(8, 4)}, {"x": torch.randn(16, 8), "y": torch.randn(16)}
    compiled = pf.jit(step, backend="eager").lower(params, batch).compile()
    with pytest.raises(TracingError, match=re.escape("batch['x']: float32[16, 8] on cpu -> float32[12, 8] on cpu")):
        compiled(params, {"x": torch.randn(12, 8), "y": torch.randn(16)})
    with pytest.raises(TracingError, match=re.escape("batch['y']: float32[16] on cpu -> float64[16] on cpu")):
        compiled(params, {"x": torch.randn(16, 8), "y": torch.randn(16, dtype=torch.float64)})


def _loss_fn(p, x):
    return (torch.tanh(x @ p["w1"]) @ p["w2"]).pow(2).mean()


def _step(p, x):
    loss, g = pf.value_and_grad(_loss_fn)(p, x)
    return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def test_virtual_compile_before_the_first_call_and_compiled_takes_lowers_arguments(mesh):
    """Inductor compiles in the rank thread that owns the process groups; the Compiled places the plain batch as
    in_shardings did at lower() and runs every rank's program: the same numbers as eager PyTorch."""
    torch.manual_seed(0)
    p = {"w1": torch.randn(8, 16), "w2": torch.randn(16, 8)}
    x = torch.randn(4, 8)
    (want_p, want_loss) = _step(p, x)
    with pf.set_mesh(mesh):
        step = pf.jit(_step, in_shardings=(P(), P("dp")))
        lowered = step.lower(p, x)
        compiled = lowered.compile()  # before any call: no jitted call has compiled it in a rank thread yet
        assert compiled.memory_analysis()["argument_bytes"] > 0
        new_p, loss = compiled(p, x)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name in p:
        torch.testing.assert_close(pf.device_get(new_p[name]), want_p[name])


def test_stdlib_frames_are_not_the_users():
    assert not is_user_file(threading.__file__)
    assert not is_user_file(os.__file__)
    assert is_user_file(__file__)
    assert is_user_file(pytest.__file__)  # a third-party library is code of the user's, as before


def test_virtual_as_text_names_no_stdlib_line_and_buckets_get_their_first_members(mesh, monkeypatch):
    monkeypatch.setattr(pf.config, "gradient_bucket_bytes", 25 * 2**20)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    params, apply = pf.functionalize(model)

    def loss_fn(p, x, y):
        return F.mse_loss(apply(p, x), y)

    def step(p, x, y):
        loss, g = pf.value_and_grad(loss_fn)(p, x, y)  # the gradients' line
        return pf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    grad_line = step.__code__.co_firstlineno + 1
    with pf.set_mesh(mesh):
        lowered = pf.jit(step, in_shardings=(P(), P("dp"), P("dp"))).lower(
            pf.device_put(params, P()), torch.randn(8, 8), torch.randn(8, 4)
        )
        text = lowered.as_text()
    lines = [line for line in text.splitlines() if "COLLECTIVE" in line]
    assert not [line for line in lines if "threading.py" in line]
    bucket = [line for line in lines if "(bucket)" in line]
    assert len(bucket) == 1
    assert bucket[0].rstrip().endswith(f"{HERE}:{grad_line}")
