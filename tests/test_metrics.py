"""pf.metrics.RunMetrics (JSONL rows, rates, rank-0 writing, TensorBoard, Prometheus) and scripts/plot_run.py."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

import pt3func as pf
from pt3func.metrics import RunMetrics, from_lowered

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_rows_and_rates(tmp_path):
    clock = FakeClock()
    metrics = RunMetrics(
        tmp_path, flops_per_step=4e9, peak_flops=1e12, tokens_per_step=1000,
        comm_bytes_per_step={"all_reduce": 300, "all_gather_into_tensor": 100},
        tensorboard=False, clock=clock,
    )
    clock.now += 0.5  # step 1: wall clock since construction
    metrics.step(1, loss=3.0)
    with metrics.timed(2) as record:  # step 2: only the block is timed
        clock.now += 0.25
        record["loss"] = torch.tensor(2.5)
        record["skipped"] = 0
    clock.now += 7.0  # an evaluation between steps
    metrics.reset_clock()
    clock.now += 1.0  # steps 3..6 logged at once: 4 steps in 1 s
    metrics.step(6, loss=float("nan"))
    clock.now += 5.0
    assert metrics.log(6, val_loss=1.5) == {"step": 6, "time": pytest.approx(metrics.latest["time"]), "val_loss": 1.5}
    clock.now += 0.5  # log() did not restart the clock: step 7 counts the 5 s too
    metrics.step(7)

    rows = read_jsonl(tmp_path / "metrics.jsonl")  # flushed per line: readable before close
    assert [r["step"] for r in rows] == [1, 2, 6, 6, 7]
    assert [r.get("step_time_s") for r in rows] == [0.5, 0.25, 0.25, None, 5.5]
    assert set(rows[3]) == {"step", "time", "val_loss"}
    assert rows[0]["tokens_per_s"] == pytest.approx(2000.0)
    assert rows[1]["tokens_per_s"] == pytest.approx(4000.0)
    assert rows[0]["flops_per_s"] == pytest.approx(8e9)
    assert rows[0]["mfu"] == pytest.approx(0.008)
    assert rows[1]["mfu"] == pytest.approx(0.016)
    assert rows[0]["comm_bytes"] == 400 and rows[0]["comm_bytes/all_reduce"] == 300
    assert rows[1]["loss"] == 2.5 and rows[1]["skipped"] == 0.0
    assert rows[2]["loss"] is None  # NaN is not JSON: written as null
    assert rows[0]["peak_mem_bytes"] > 0  # max RSS on CPU
    metrics.close()
    metrics.close()


def test_postfix(tmp_path):
    clock = FakeClock()
    metrics = RunMetrics(None, flops_per_step=1e9, peak_flops=1e11, tokens_per_step=50_000, clock=clock, window=3)
    assert metrics.postfix() == {}
    for i, dt in enumerate([30.0, 0.1, 0.1, 0.1], start=1):  # a compile step, then steady state
        clock.now += dt
        metrics.step(i, loss=1.23456)
        if i == 2:
            metrics.log(i, val_loss=2.0)
    post = metrics.postfix()
    assert post["loss"] == "1.23" and post["val_loss"] == "2"  # the newest of each, however old
    assert metrics.postfix("loss").keys() == {"loss", "tok/s", "mfu", "mem"}
    assert post["tok/s"] == "500k"  # the median of the last 3 step times: the compile step has dropped out
    assert post["mfu"] == "10.0%"
    assert post["mem"].endswith("G")
    assert metrics.jsonl_path is None


def test_no_rates_without_sizes(tmp_path):
    clock = FakeClock()
    with RunMetrics(tmp_path, tensorboard=False, clock=clock) as metrics:
        clock.now += 0.2
        row = metrics.step(1, loss=1.0)
        assert metrics.postfix()["step"] == "200ms"
    assert not {"tokens_per_s", "mfu", "flops_per_s", "comm_bytes"} & set(row)


def test_flops_without_peak_gives_no_mfu(tmp_path):
    clock = FakeClock()
    metrics = RunMetrics(None, flops_per_step=1e9, clock=clock)
    clock.now += 1.0
    row = metrics.step(1)
    assert row["flops_per_s"] == 1e9 and "mfu" not in row


def test_bad_scalars_raise(tmp_path):
    metrics = RunMetrics(None, tokens_per_step=10)
    with pytest.raises(ValueError, match="clashes"):
        metrics.step(1, tokens_per_s=5.0)
    with pytest.raises(ValueError, match="clashes"):
        metrics.log(1, mfu=0.5)
    with pytest.raises(TypeError, match="scalars only"):
        metrics.step(2, loss=torch.ones(3))
    with pytest.raises(TypeError, match="must be a number"):
        metrics.step(3, note="hello")


def test_from_lowered():
    def train_step(params, batch):
        loss, grads = pf.value_and_grad(lambda p, x: (x @ p["w"]).square().mean())(params, batch)
        return pf.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    lowered = pf.jit(train_step, backend="eager").lower({"w": torch.randn(8, 4)}, torch.randn(16, 8))
    cost = from_lowered(lowered)
    assert cost["flops_per_step"] == lowered.cost_analysis()["flops"] > 2 * 16 * 8 * 4  # forward matmul and more
    assert cost["comm_bytes_per_step"] == {}  # one device: no collectives
    metrics = RunMetrics(None, **cost, peak_flops=1e9, clock=FakeClock())
    assert metrics.step(1, step_time_s=1.0)["mfu"] == pytest.approx(cost["flops_per_step"] / 1e9)


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    other = RunMetrics(tmp_path / "explicit", rank=1, tensorboard=True, prometheus_port=0)
    assert other.step(1, loss=1.0) == {} and other.log(1, val_loss=1.0) == {}
    with other.timed(2) as record:
        record["loss"] = 2.0
    assert other.postfix() == {} and other.prometheus_port is None
    other.close()
    assert not (tmp_path / "explicit").exists()

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 3)
    detected = RunMetrics(tmp_path / "detected", tensorboard=True)
    assert detected.rank == 3 and detected.step(1, loss=1.0) == {}
    detected.close()
    assert not (tmp_path / "detected").exists()

    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    rank0 = RunMetrics(tmp_path / "rank0", tensorboard=False)
    rank0.step(1, loss=1.0)
    rank0.close()
    assert len(read_jsonl(tmp_path / "rank0" / "metrics.jsonl")) == 1


def test_tensorboard_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pt3func\[metrics\]"):
        RunMetrics(tmp_path, tensorboard=True)
    metrics = RunMetrics(tmp_path, tensorboard="auto")
    metrics.step(1, loss=1.0)
    metrics.close()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install 'pt3func[metrics]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    clock = FakeClock()
    metrics = RunMetrics(tmp_path, tokens_per_step=100, tensorboard=True, clock=clock)
    for i in range(1, 4):
        clock.now += 0.5
        metrics.step(i, loss=float(i))
    metrics.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"loss", "tokens_per_s", "step_time_s"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert events.Scalars("tokens_per_s")[0].value == pytest.approx(200.0)


def test_prometheus_gauges(tmp_path):
    pytest.importorskip("prometheus_client", reason="prometheus-client not installed (pip install 'pt3func[metrics]')")
    clock = FakeClock()
    metrics = RunMetrics(
        None, tokens_per_step=100, comm_bytes_per_step={"all_reduce": 64}, prometheus_port=0,
        prometheus_addr="127.0.0.1", clock=clock,
    )
    assert metrics.prometheus_port  # 0 asked for a free port; this is the one bound
    clock.now += 0.5
    metrics.step(7, loss=2.5)
    url = f"http://127.0.0.1:{metrics.prometheus_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["pt3func_step"] == 7
    assert values["pt3func_loss"] == 2.5
    assert values["pt3func_tokens_per_s"] == 200.0
    assert values["pt3func_comm_bytes_all_reduce"] == 64
    clock.now += 0.5
    metrics.step(8, loss=float("nan"))  # a diverged run shows NaN, not its last finite loss
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    assert "pt3func_step 8.0" in text and "pt3func_loss NaN" in text
    with pytest.raises(OSError, match=rf"cannot serve Prometheus metrics on 127.0.0.1:{metrics.prometheus_port}"):
        RunMetrics(None, prometheus_port=metrics.prometheus_port, prometheus_addr="127.0.0.1")
    metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_the_launchers_rank_before_the_world_starts(tmp_path, monkeypatch):
    """RunMetrics made before pf.make_mesh under torchrun: every rank wrote."""
    monkeypatch.setenv("RANK", "1")
    metrics = RunMetrics(tmp_path, tensorboard=False)
    metrics.step(1, loss=1.0)
    metrics.close()
    assert not (tmp_path / "metrics.jsonl").exists() or read_jsonl(tmp_path / "metrics.jsonl") == []


def load_plot_run():
    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "scripts" / "plot_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_run_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'pt3func[metrics]')")
    plot_run = load_plot_run()
    clock = FakeClock()
    metrics = RunMetrics(tmp_path / "run", flops_per_step=1e9, peak_flops=1e11, tokens_per_step=256,
                         tensorboard=False, clock=clock)
    for i in range(1, 41):
        clock.now += 0.05
        metrics.step(i, loss=2.0 * math.exp(-i / 10) + 1.0)
        if i % 10 == 0:
            metrics.log(i, val_loss=1.5)
    metrics.close()
    # A resumed run appends steps it already logged: rows of one step merge, the later values winning.
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 40, "loss": 0.5, "step_time_s": 0.05}) + "\n")
    rows = plot_run.load_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["loss"] == 0.5 and rows[-1]["val_loss"] == 1.5 and "mfu" in rows[-1]

    out = plot_run.main([str(tmp_path / "run" / "metrics.jsonl"), "-o", str(tmp_path / "run.png"), "--smooth", "5"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "40 steps" in capsys.readouterr().out


def test_from_lowered_names_what_it_takes():
    with pytest.raises(TypeError, match=r"from_lowered takes step.lower\(\*args\).*got Jitted"):
        from_lowered(pf.jit(lambda x: x * 2))


def test_plot_names_the_png_it_writes(tmp_path):
    pytest.importorskip("matplotlib")
    plot_run = load_plot_run()
    rows = [{"step": i, "loss": 2.0 / i, "mfu": 0.005} for i in range(1, 6)]
    out = plot_run.plot(rows, tmp_path / "run")  # no suffix: the PNG written is the path returned
    assert out == tmp_path / "run.png" and out.exists()


def test_postfix_shows_non_finite_losses_and_small_comm():
    clock = FakeClock()
    metrics = RunMetrics(None, comm_bytes_per_step={"all_reduce": 44_032}, clock=clock)
    clock.now += 0.1
    metrics.step(1, loss=float("inf"))
    post = metrics.postfix()
    assert post["loss"] == "inf" and post["comm"] == "43.0KiB"
