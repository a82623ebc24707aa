"""The compression benchmark's plumbing: the slow-link network (namespaces built, rate-limited, always removed)
and a smoke run of `benchmarks/compression.py` whose wire bytes come from the lowered programs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "netns"))

import slowlink  # noqa: E402

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces and tc need root and iproute2",
)


@needs_netns
def test_slowlink_builds_rate_limited_links_and_always_cleans_up():
    prefix = "pftest"
    with pytest.raises(RuntimeError, match="boom"), slowlink.SlowLink(2, rate="100mbit", prefix=prefix) as net:
        assert sorted(slowlink.existing(prefix)) == [f"{prefix}-0", f"{prefix}-1", f"{prefix}-sw"]
        qdisc = subprocess.run(["ip", "netns", "exec", f"{prefix}-1", "tc", "qdisc", "show", "dev", slowlink.IFNAME],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        port = subprocess.run(["ip", "netns", "exec", f"{prefix}-sw", "tc", "qdisc", "show", "dev", f"{prefix}p1"],
                              capture_output=True, text=True, check=True).stdout
        assert "tbf" in port  # the download direction is limited too
        # Rank 1 reaches rank 0 through the switch (a TCP connect across the bridge).
        probe = (f"import socket; s = socket.socket(); s.bind(('{net.address(0)}', 0)); s.listen(1); "
                 "print(s.getsockname()[1], flush=True)")
        server = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-0", sys.executable, "-c",
                                   probe + "; c, _ = s.accept(); c.sendall(b'ok')"], stdout=subprocess.PIPE, text=True)
        port_no = int(server.stdout.readline())
        got = subprocess.run(["ip", "netns", "exec", f"{prefix}-1", sys.executable, "-c",
                              f"import socket; print(socket.create_connection(('{net.address(0)}', {port_no}))"
                              ".recv(2).decode())"], capture_output=True, text=True, timeout=30, check=True).stdout
        server.wait(timeout=30)
        assert got.strip() == "ok"
        raise RuntimeError("boom")
    assert slowlink.existing(prefix) == []


@pytest.mark.slow
def test_compression_smoke_wire_bytes(tmp_path):
    out = tmp_path / "compression.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compression.py"), "--smoke", "--parts", "wire",
                    # fp32 last: the other rows' bytes must not depend on fp32 having been lowered first.
                    "--formats", "bf16,int8+EF,powersgd r4+warmup,fp32", "--out", str(out)], check=True, cwd=ROOT,
                   timeout=600)
    result = json.loads(out.read_text())
    by_name = {r["format"]: r for r in result["records"]}
    assert [r["format"] for r in result["records"]][:3] == ["seed FP32", "seed FP16", "seed INT4"]
    assert by_name["fp32"]["exchange_wire_vs_fp32"] == 1.0
    # bf16 sends exactly half of fp32's bytes (an all-to-all and an all-gather of 2-byte values move what a
    # ring all-reduce of 4-byte values moves, halved), up to the 8-byte step counter.
    assert by_name["bf16"]["exchange_wire_vs_fp32"] == pytest.approx(0.5, abs=1e-3)
    # int8: a quarter plus fp32 scales per 256-element block and padding of each rank's chunk to a block.
    assert 0.25 < by_name["int8+EF"]["exchange_wire_vs_fp32"] < 0.35
    assert by_name["int8+EF"]["step_wire_vs_fp32"] < 1.0
    # A dense warm-up is a program of its own: fp32 bytes up to step 30, PowerSGD's after; the smoke run's 4
    # steps are all dense.
    ps = by_name["powersgd r4+warmup"]
    assert [p["start"] for p in ps["phases"]] == [0, 30]
    assert ps["phases"][0]["wire_bytes"] == by_name["fp32"]["wire_bytes"] > ps["phases"][1]["wire_bytes"]
    assert ps["exchange_wire_run_vs_fp32"] == 1.0 > ps["exchange_wire_vs_fp32"]
