"""`pf.jit(..., cuda_graphs=True)`: the option, the refusals (here), and capture/replay (on a GPU only)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import pt3func as pf
from pt3func.runtime.cudagraphs import check_capturable
from tests.dist import run_world

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _sgd(params, x, y, lr):
    def loss_fn(p):
        return F.mse_loss(torch.tanh(x @ p["w"]) @ p["v"], y)

    loss, g = pf.value_and_grad(loss_fn)(params)
    return pf.tree.map(lambda p, gp: p - lr * gp, params, g), {"loss": loss}


def _params(device: str = "cpu") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(8, 16, device=device), "v": torch.randn(16, 4, device=device)}


def _batch(seed: int, device: str = "cpu", n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g).to(device), torch.randn(n, 4, generator=g).to(device)


def test_option_reaches_the_program():
    step = pf.jit(_sgd, donate_argnums=0, cuda_graphs=True)
    assert step.cuda_graphs
    assert pf.jit(cuda_graphs=True)(_sgd).cuda_graphs  # decorator form
    assert not pf.jit(_sgd).cuda_graphs
    lowered = step.lower(_params(), *_batch(0), 0.1)  # lowering alone never needs the GPU
    assert lowered._program.cuda_graphs


@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_cpu_inputs_refused_with_their_path(backend):
    step = pf.jit(_sgd, donate_argnums=0, cuda_graphs=True, backend=backend)
    with pytest.raises(pf.TracingError, match=r"cuda_graphs=True needs CUDA tensors; got a CPU input at params\['v'\]"):
        step(_params(), *_batch(0), 0.1)


# Fake CUDA tensors need a real device of that index where CUDA exists (a CPU-only machine fakes any index).
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs or none")
def test_several_devices_refused():
    with FakeTensorMode():
        a, b = torch.empty(4, device="cuda:0"), torch.empty(4, device="cuda:1")
    gm = make_fx(lambda x, y: x + y.sum())(torch.empty(4), torch.empty(4))
    with pytest.raises(pf.TracingError, match=r"one device.*x is on cuda:0 and y on cuda:1"):
        check_capturable("step", gm, [a, b], ["x", "y"], [])


def _gloo_collective_refused(rank: int, world: int) -> str:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    gm = make_fx(lambda x: funcol.all_reduce(x, "sum", group) * 2)(torch.ones(4))
    with FakeTensorMode():
        x = torch.empty(4, device="cuda")
    try:
        check_capturable("step", gm, [x], ["x"], [])
    except pf.TracingError as e:
        return str(e)
    return "not refused"


@pytest.mark.slow
def test_gloo_collectives_refused():
    (message,) = run_world(1, _gloo_collective_refused)
    assert "cannot capture the collective" in message and "'gloo' backend" in message, message


# ---- the runner's buffer logic on CPU, with a stand-in for CUDA graph capture ----------------------------


class _FakeGraph:
    """Records the program at "capture" (run on copies: a capture executes nothing) and reruns it at replay,
    writing into the captured outputs as a real replay writes into the graph's static buffers."""

    active: _FakeGraph | None = None

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls = []

    def replay(self):
        for fn, args, outs in self.calls:
            for out, new in zip(outs, fn(*args)):
                out.copy_(new)


@contextlib.contextmanager
def _fake_capture(graph, **kwargs):
    _FakeGraph.active = graph
    try:
        yield
    finally:
        _FakeGraph.active = None


def _recording(fn):
    def run(*args):
        graph = _FakeGraph.active
        if graph is None:
            return fn(*args)
        outs = list(fn(*[a.clone() for a in args]))
        graph.calls.append((fn, args, outs))
        return outs

    return run


def test_runner_buffers_with_a_stand_in_graph(monkeypatch):
    import pt3func.stages as stages
    from pt3func.runtime import cudagraphs

    compile_program = stages.compile_program
    monkeypatch.setattr(stages, "compile_program", lambda *a: _recording(compile_program(*a)))
    monkeypatch.setattr(stages, "check_capturable", lambda *a: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(cudagraphs._CaptureSideEffects, "record", classmethod(lambda cls: None))  # no generator

    graphed = pf.jit(_sgd, donate_argnums=0, backend="eager", cuda_graphs=True)
    plain = pf.jit(_sgd, donate_argnums=0, backend="eager")
    p, p_ref = _params(), _params()
    losses, ptrs = [], []
    for i in range(5):
        batch, lr = _batch(i), 0.1 / (i + 1)  # new batch tensors and a new scalar every call: copied in
        p, m = graphed(p, *batch, lr)
        p_ref, m_ref = plain(p_ref, *batch, lr)
        torch.testing.assert_close(p, p_ref)
        torch.testing.assert_close(m["loss"], m_ref["loss"])
        losses.append((m["loss"], m_ref["loss"].clone()))
        ptrs.append({k: v.data_ptr() for k, v in p.items()})
    runner = next(iter(graphed._cache.values()))._runner
    assert runner.captured and runner.replays == 4
    assert ptrs[1] == ptrs[2] == ptrs[3] == ptrs[4]  # after the capture, params stay in the captured buffers
    for loss, expected in losses:  # returned losses are copies: later replays did not overwrite them
        torch.testing.assert_close(loss, expected)
    # Fresh params are copied into the captured buffers; the program then updates those.
    fresh, p_ref = _params(), _params()
    out, _ = graphed(fresh, *_batch(9), 0.05)
    expected, _ = plain(p_ref, *_batch(9), 0.05)
    torch.testing.assert_close(out, expected)
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs[-1]
    with pytest.raises(pf.DonationError):
        fresh["w"] + 1


# ---- on a GPU ----------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_replay_matches_uncaptured_steps(backend):
    plain = pf.jit(_sgd, donate_argnums=0, backend=backend)
    graphed = pf.jit(_sgd, donate_argnums=0, backend=backend, cuda_graphs=True)
    p_ref, p = _params("cuda"), _params("cuda")
    losses = []
    for i in range(5):
        batch = _batch(i, "cuda")
        lr = 0.1 / (i + 1)  # a Python scalar input: copied into its buffer every call
        p_ref, m_ref = plain(p_ref, *batch, lr)
        p, m = graphed(p, *batch, lr)
        losses.append(m["loss"])
        torch.testing.assert_close(m["loss"], m_ref["loss"])
        torch.testing.assert_close(p, p_ref)
    runner = graphed._cache[next(iter(graphed._cache))]._runner
    assert runner.captured and runner.replays == 4  # one warm-up call, then capture + replay
    # Returned non-donated outputs are the caller's: later replays do not overwrite them.
    assert len({loss.data_ptr() for loss in losses}) == len(losses)
    assert all(torch.isfinite(loss) for loss in losses)


@cuda
def test_donated_buffers_are_the_captured_ones():
    step = pf.jit(_sgd, donate_argnums=0, cuda_graphs=True)
    p = _params("cuda")
    for i in range(3):
        p, _ = step(p, *_batch(i, "cuda"), 0.1)
    ptrs = {k: v.data_ptr() for k, v in p.items()}
    p, _ = step(p, *_batch(3, "cuda"), 0.1)
    assert {k: v.data_ptr() for k, v in p.items()} == ptrs  # replayed in place, no copy
    # Fresh params (not what the last call returned) are copied in, and give the same result as without graphs.
    fresh, ref = _params("cuda"), _params("cuda")
    out, _ = step(fresh, *_batch(7, "cuda"), 0.1)
    expected, _ = pf.jit(_sgd)(ref, *_batch(7, "cuda"), 0.1)
    torch.testing.assert_close(out, expected)
    with pytest.raises(pf.DonationError):
        fresh["w"] + 1


@cuda
def test_new_shape_recaptures():
    step = pf.jit(_sgd, donate_argnums=0, cuda_graphs=True)
    p = _params("cuda")
    for n in (32, 32, 32, 16, 16, 16):
        p, _ = step(p, *_batch(n, "cuda", n=n), 0.1)
    assert step.trace_count() == 2
    assert all(c._runner.captured for c in step._cache.values())


@cuda
def test_uncapturable_op_names_the_program():
    @torch.library.custom_op("pt3func_test::host_sync", mutates_args=())
    def host_sync(x: torch.Tensor) -> torch.Tensor:
        return x + float(x.sum().item())  # a device -> host copy: not allowed while capturing

    @host_sync.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        return host_sync(x) * 2

    step = pf.jit(f, cuda_graphs=True)
    x = torch.ones(4, device="cuda")
    step(x)  # the warm-up call runs as usual
    torch.manual_seed(0)
    want = torch.randn(8, device="cuda")
    torch.manual_seed(0)
    with pytest.raises(pf.TracingError, match=r"f: cuda_graphs=True: the compiled program cannot be captured"):
        step(x)
    # The broken capture leaves nothing behind: random draws go on from the same generator state (torch alone
    # leaves the generator marked as capturing, and every later draw raises), on the stream used before.
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.equal(torch.randn(8, device="cuda"), want)
    assert torch.equal(pf.jit(f)(x), f(x))


def test_release_destroys_graphs_before_the_process_group_goes(monkeypatch):
    """A graph holding NCCL collectives must die before its communicator (else exit hangs): the release hook."""
    import torch.distributed as dist

    from pt3func.runtime import cudagraphs

    class FakeGraph:
        resets = 0

        def reset(self):
            FakeGraph.resets += 1

    destroyed = []
    monkeypatch.setattr(cudagraphs, "_HOOKS_INSTALLED", False)
    monkeypatch.setattr(cudagraphs.atexit, "register", lambda fn: None)
    monkeypatch.setattr(dist.distributed_c10d, "destroy_process_group", lambda *a: destroyed.append(FakeGraph.resets))
    monkeypatch.setattr(dist, "destroy_process_group", dist.distributed_c10d.destroy_process_group)
    runner = cudagraphs.CUDAGraphRunner(lambda *xs: list(xs), "step", torch.device("cpu"), [], {})
    runner._graph, runner._warmups_left = FakeGraph(), 0  # as after a warm-up call and a capture
    cudagraphs._LIVE.add(runner)
    cudagraphs._install_release_hooks()
    dist.destroy_process_group()
    assert destroyed == [1], "the graph was not reset before destroy_process_group ran"
    assert not runner.captured and runner._warmups_left == 0  # the next call captures again, no warm-up
    assert cudagraphs.release_cuda_graphs() == 0
