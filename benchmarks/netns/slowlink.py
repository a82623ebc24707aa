"""A slow network on one machine: ranks in Linux network namespaces behind a rate-limited virtual switch.

    sudo python benchmarks/netns/slowlink.py -n 4 --rate 1gbit             # build, probe, tear down
    sudo python benchmarks/netns/slowlink.py -n 4 -- python my_rank.py    # run one command per rank
    sudo python benchmarks/netns/slowlink.py -n 2 --collectives           # gloo collectives by message size

Each rank K lives in its own namespace `<prefix>-K` with one veth end (`veth0`, address 10.213.0.K+1); the
other ends sit in a bridge inside a "switch" namespace `<prefix>-sw`. A `tbf` qdisc limits both directions
of every link (rank egress in the rank's namespace, rank ingress on the switch port), so each rank has a
full-duplex link of `rate`, as a NIC behind a switch. gloo then sees a real slow network: its sockets go
through the kernel's TCP stack and the token bucket, not through loopback.

Needs root (CAP_NET_ADMIN) and `ip`/`tc` (iproute2). Namespaces are deleted on exit, on an exception and on
SIGINT/SIGTERM (deleting a namespace deletes its veth end, and with it the peer); namespaces with our prefix
left behind by a killed run (SIGKILL cannot be trapped) are removed before a new network is built.

The rank side (`probe_main`, run by `-n N --probe`): times gloo all-reduces of 64 MiB of fp32 and prints the
bus bandwidth, which should sit just under the link rate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

PREFIX = "pfslow"
SUBNET = "10.213.0"
IFNAME = "veth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _run(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *args], check=True, capture_output=True, text=True)


def existing(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with `prefix-` (ours, possibly from a killed run)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix + "-")]


def remove(prefix: str = PREFIX) -> list[str]:
    """Delete our namespaces (and with them their veths); returns the names deleted."""
    names = existing(prefix)
    for name in names:
        _ip("netns", "del", name, check=False)
    return names


class SlowLink(AbstractContextManager):
    """`n` rank namespaces on a virtual switch, every link limited to `rate` (tc units: "1gbit", "100mbit").

    `burst` is the token bucket's depth: it must hold at least rate/HZ (plus a GSO packet of 64 KiB) or the
    rate is not reached; 256 KiB suits 1 Gbit/s. `latency` bounds the queue (tbf drops beyond it). `delay`
    (e.g. "1ms") adds a netem one-way delay on the switch ports, for a WAN-like RTT; off by default.
    """

    def __init__(
        self,
        n: int,
        rate: str = "1gbit",
        burst: str = "256kb",
        latency: str = "100ms",
        delay: str | None = None,
        prefix: str = PREFIX,
    ) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"1 <= n <= 200 ranks, got {n}")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise RuntimeError("slowlink needs iproute2 (`ip`, `tc`)")
        if os.geteuid() != 0:
            raise RuntimeError("slowlink needs root (network namespaces, veth, tc)")
        self.n, self.rate, self.burst, self.latency, self.delay, self.prefix = n, rate, burst, latency, delay, prefix
        self.switch = f"{prefix}-sw"
        self.namespaces = [f"{prefix}-{k}" for k in range(n)]
        self._old_handlers: dict[int, Any] = {}

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> SlowLink:
        stale = remove(self.prefix)
        if stale:
            print(f"slowlink: removed namespaces left by an earlier run: {', '.join(stale)}", file=sys.stderr)
        # A SIGTERM (a timeout, a scheduler) must not skip __exit__: turn it into an exception.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _run(self.switch, "ip", "link", "set", "lo", "up")
        _run(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _run(self.switch, "ip", "link", "set", "br0", "up")
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        for k, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            port = f"{self.prefix}p{k}"  # the switch side; created in the root namespace, then moved
            _ip("link", "add", f"{self.prefix}r{k}", "type", "veth", "peer", "name", port)
            _ip("link", "set", f"{self.prefix}r{k}", "netns", ns)
            _ip("link", "set", port, "netns", self.switch)
            _run(ns, "ip", "link", "set", f"{self.prefix}r{k}", "name", IFNAME)
            _run(ns, "ip", "addr", "add", f"{self.address(k)}/24", "dev", IFNAME)
            _run(ns, "ip", "link", "set", IFNAME, "up")
            _run(ns, "ip", "link", "set", "lo", "up")
            _run(self.switch, "ip", "link", "set", port, "master", "br0")
            _run(self.switch, "ip", "link", "set", port, "up")
            # Rank egress (upload) and rank ingress (download, = the switch port's egress).
            _run(ns, "tc", "qdisc", "add", "dev", IFNAME, "root", *tbf)
            if self.delay:
                _run(self.switch, "tc", "qdisc", "add", "dev", port, "root", "handle", "1:", "netem", "delay",
                     self.delay)
                _run(self.switch, "tc", "qdisc", "add", "dev", port, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _run(self.switch, "tc", "qdisc", "add", "dev", port, "root", *tbf)

    def __exit__(self, *exc: Any) -> None:
        remove(self.prefix)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def describe(self) -> str:
        extra = f", +{self.delay} one-way delay" if self.delay else ""
        return f"{self.n} namespaces on a bridge, tbf {self.rate} each way per link (burst {self.burst}){extra}"

    def launch(
        self, argv: Sequence[str], port: int = 29600, env: dict[str, str] | None = None, **popen: Any
    ) -> list[subprocess.Popen]:
        """Start `argv` once per rank, inside its namespace, with torchrun's variables (rank 0 is the master)."""
        procs = []
        for k, ns in enumerate(self.namespaces):
            rank_env = dict(os.environ if env is None else env)
            rank_env.update(
                MASTER_ADDR=self.address(0),
                MASTER_PORT=str(port),
                RANK=str(k),
                LOCAL_RANK="0",  # one rank per "host"
                WORLD_SIZE=str(self.n),
                LOCAL_WORLD_SIZE="1",
                GLOO_SOCKET_IFNAME=IFNAME,
                OMP_NUM_THREADS=rank_env.get("OMP_NUM_THREADS", "1"),
            )
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=rank_env, **popen))
        return procs


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def wait_all(procs: Sequence[subprocess.Popen], timeout: float | None = None) -> list[int]:
    """Wait for every rank; if one fails (or time runs out) stop the others, so none hangs in a collective."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return codes  # type: ignore[return-value]
            if any(c not in (None, 0) for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def probe_main(mib: int = 64, repeats: int = 3) -> dict[str, float]:
    """On every rank: time gloo all-reduces of `mib` MiB of fp32; rank 0 prints and returns the bandwidth."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.ones(mib * 2**20 // 4)
    dist.all_reduce(x)  # connections and buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    t = min(times)
    nbytes = x.numel() * 4
    # A ring all-reduce moves 2 (n-1)/n of the buffer through each rank's link in each direction.
    bus = 2 * (n - 1) / n * nbytes * 8 / t / 1e9
    result = {"ranks": n, "mib": mib, "seconds": t, "bus_gbit_s": bus, "algo_gbit_s": nbytes * 8 / t / 1e9}
    if rank == 0:
        print(f"slowlink probe: all_reduce {mib} MiB fp32 over {n} gloo ranks: {t * 1e3:.0f} ms, "
              f"bus bandwidth {bus:.3f} Gbit/s (per-link limit; ring moves 2(n-1)/n of the buffer)", flush=True)
    return result



def collectives_main(sizes_mib: Sequence[float] = (0.004, 0.5, 4, 16), repeats: int = 7) -> dict[float, dict]:
    """On every rank: median time of a gloo all-reduce (fp32), all-to-all and all-gather (bytes) per buffer size,
    against the line rate; what the compressed exchange's collectives cost by message size (rank 0 prints)."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()

    def timed(fn: Any, *args: Any) -> float:
        fn(*args)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    out: dict[float, dict] = {}
    for mib in sizes_mib:
        nbytes = int(mib * 2**20) // (4 * n) * 4 * n
        x = torch.ones(nbytes // 4)
        rows = torch.zeros(n, nbytes // n, dtype=torch.uint8)
        got = torch.empty_like(rows)
        mine = torch.zeros(nbytes // n, dtype=torch.uint8)
        gathered = torch.empty(nbytes, dtype=torch.uint8)
        line = (n - 1) / n * nbytes * 8 / 1e9  # seconds each rank's link needs for its share, at 1 Gbit/s
        out[mib] = dict(
            all_reduce_ms=timed(dist.all_reduce, x) * 1e3,
            all_to_all_ms=timed(dist.all_to_all_single, got, rows) * 1e3,
            all_gather_ms=timed(dist.all_gather_into_tensor, gathered, mine) * 1e3,
            line_1gbit_ms=line * 1e3,
        )
        if rank == 0:
            r = out[mib]
            print(f"slowlink collectives, {mib:g} MiB buffer over {n} ranks: all_reduce {r['all_reduce_ms']:.2f} ms, "
                  f"all_to_all {r['all_to_all_ms']:.2f} ms, all_gather {r['all_gather_ms']:.2f} ms; (n-1)/n of the "
                  f"buffer at 1 Gbit/s: {r['line_1gbit_ms']:.2f} ms (a ring all-reduce sends twice that)", flush=True)
    dist.destroy_process_group()
    return out

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4, help="ranks")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--delay", default=None, help="netem one-way delay on switch ports, e.g. 1ms")
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--mib", type=int, default=64, help="probe buffer size")
    p.add_argument("--clean", action="store_true", help="only delete namespaces left by a killed run")
    p.add_argument("--collectives", action="store_true",
                   help="instead of the probe: time all-reduce, all-to-all and all-gather at 4 KiB - 16 MiB")
    p.add_argument("--probe-rank", action="store_true", help=argparse.SUPPRESS)  # the per-rank side of the probe
    p.add_argument("--collectives-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run on every rank (default: probe)")
    a = p.parse_args(argv)
    if a.probe_rank:
        probe_main(a.mib)
        return 0
    if a.collectives_rank:
        collectives_main()
        return 0
    if a.clean:
        print(f"removed: {remove() or 'nothing'}")
        return 0
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        rank_side = ["--collectives-rank"] if a.collectives else ["--probe-rank", "--mib", str(a.mib)]
        command = [sys.executable, os.path.abspath(__file__), *rank_side]
    with SlowLink(a.n, a.rate, a.burst, delay=a.delay) as net:
        print(f"slowlink: {net.describe()}", flush=True)
        codes = wait_all(net.launch(command, port=a.port))
    print(f"slowlink: exit codes {codes}; namespaces left: {existing() or 'none'}")
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
