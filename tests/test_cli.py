"""The `pt3func` command: `pt3func run` (torchrun underneath) and examples/train_lm_sharded.py through it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pt3func import cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm_sharded.py"
TINY = ("--steps 8 --log-interval 2 --batch 8 --seq 16 --d-model 32 --layers 1 --heads 2 --max-bytes 100000 "
        "--eval-batches 1 --backend eager").split()
ECHO = """\
import os, pathlib, sys, time
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} omp={os.environ.get('OMP_NUM_THREADS')} {sys.argv[1:]}",
      flush=True)
failing = os.environ.get("EXIT_RANK", os.environ["RANK"])  # the rank that exits with EXIT_STATUS (default: all)
here = pathlib.Path(__file__).parent
(here / f"printed.{os.environ['TORCHELASTIC_RUN_ID']}.{os.environ['RANK']}").touch()
if os.environ["RANK"] == failing and os.environ.get("EXIT_STATUS", "0") != "0":
    # torchrun stops the other ranks once one fails: wait until every rank has printed, or a loaded machine
    # loses a slower rank's line.
    deadline = time.monotonic() + 60
    while len(list(here.glob(f"printed.{os.environ['TORCHELASTIC_RUN_ID']}.*"))) < int(os.environ["WORLD_SIZE"]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
sys.exit(int(os.environ.get("EXIT_STATUS", "0")) if os.environ["RANK"] == failing else 0)
"""


def pt3func(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m pt3func ARGS` in a fresh interpreter (what the console script runs)."""
    return subprocess.run([sys.executable, "-m", "pt3func", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def losses(out: str) -> tuple[list[float], float]:
    """The logged losses and the final train loss printed by train_lm_sharded.py."""
    logged = [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)", out, flags=re.M)]
    final = re.search(r"^final train loss (\S+)", out, flags=re.M)
    assert final, out
    return logged, float(final.group(1))


@pytest.fixture
def echo(tmp_path: Path) -> Path:
    path = tmp_path / "echo_args.py"
    path.write_text(ECHO)
    return path


def test_torchrun_argv_local_and_multi_node(echo):
    assert cli.torchrun_argv(["-n", "4", str(echo), "--steps", "3"]) == [
        "--standalone", "--nproc-per-node", "4", "--", str(echo), "--steps", "3"]
    multi = ["-n", "8", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint=h0:29400",
             "--max-restarts", "2", str(echo), "-n", "5"]
    assert cli.torchrun_argv(multi) == [
        "--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint=h0:29400", "--max-restarts", "2", "--", str(echo), "-n", "5"]
    assert cli.torchrun_argv(["-n", "2", "-m", "some.module", "--x"])[-4:] == ["-m", "--", "some.module", "--x"]
    assert cli.torchrun_argv(["-n", "2", "--", str(echo), "--", "a"])[-3:] == [str(echo), "--", "a"]


@pytest.mark.parametrize("argv, message", [
    (["-n", "2", "missing.py"], "no such script: missing.py"),
    (["-n", "2"], "no script given"),
    (["-n", "zero", "x.py"], "-n takes a positive number"),
    (["--bogus", "1", "x.py"], "unknown flag --bogus"),
    (["--m", "1", "x.py"], "ambiguous flag --m"),
])
def test_usage_errors(argv, message):
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        cli.torchrun_argv(argv)


def test_short_flag_with_its_value_glued_on(echo):
    # argparse (and so torchrun) reads `-n2` and `-n=2` as `-n 2`, and `-r3` as torchrun's `--redirects 3`.
    for spelling in (["-n2"], ["-n=2"], ["--nproc=2"]):
        assert cli.torchrun_argv([*spelling, str(echo)]) == ["--standalone", "--nproc-per-node", "2", "--", str(echo)]
    assert cli.torchrun_argv(["-n", "2", "-r3", str(echo)])[3:] == ["-r3", "--", str(echo)]


@pytest.mark.parametrize("flags, message", [
    (["--max-restarts"], "--max-restarts takes an integer, got '{script}' (the script? give --max-restarts its value"),
    (["-n"], "-n takes a positive number of processes (or gpu, cpu, auto), got '{script}' (the script?"),
    (["-n", "2", "--rdzv-endpoint"], "no script given: --rdzv-endpoint took '{script}' as its value"),
])
def test_a_script_taken_for_a_flags_value_names_the_flag(echo, flags, message):
    with pytest.raises(cli.UsageError, match=re.escape(message.format(script=echo))):
        cli.torchrun_argv([*flags, str(echo)])


def test_a_directory_with_main_runs_like_a_script(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    with pytest.raises(cli.UsageError, match="directory without __main__.py"):
        cli.torchrun_argv(["-n", "2", str(app)])
    (app / "__main__.py").write_text(ECHO)
    assert cli.torchrun_argv(["-n", "2", str(app), "--x"])[-3:] == ["--", str(app), "--x"]


def test_help_and_missing_script_from_the_command_line():
    top = pt3func("--help")
    assert top.returncode == 0 and "run" in top.stdout
    run_help = pt3func("run", "--help")
    assert run_help.returncode == 0 and "pt3func run [-n N]" in run_help.stdout and "--rdzv-endpoint" in run_help.stdout
    missing = pt3func("run", "-n", "2", "no_such_script.py")
    assert missing.returncode == 2 and "no such script: no_such_script.py" in missing.stderr
    console = Path(sys.executable).with_name("pt3func")  # the console script pyproject declares
    if console.exists():
        assert subprocess.run([console, "--version"], capture_output=True, text=True).stdout.startswith("pt3func ")


def test_script_args_reach_every_rank_untouched(echo):
    # `--d` and `--m` abbreviate torchrun flags; after the script they are the script's, as is `--`.
    done = pt3func("run", "-n", "2", str(echo), "--d", "64", "--m", "2", "--", "x")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("['--d', '64', '--m', '2', '--', 'x']") == 2
    assert "rank 0/2" in done.stdout and "rank 1/2" in done.stdout


def _run_without_omp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m pt3func run ARGS` with OMP_NUM_THREADS unset unless `env` sets it."""
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run([sys.executable, "-m", "pt3func", "run", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**clean, **(env or {})}, timeout=120)


def test_omp_threads_and_exit_status(echo):
    done = _run_without_omp("-n", "2", str(echo), env={"EXIT_STATUS": "3", "EXIT_RANK": "1"})
    assert done.stdout.count("omp=1") == 2
    assert done.returncode == 3 and "(rank 1) failed (exit status 3)" in done.stderr


def test_omp_threads_left_alone_for_one_process_or_the_users_own(echo):
    # One process shares the cores with nobody: torch keeps all of them, as under plain python or torchrun.
    alone = _run_without_omp(str(echo))
    assert alone.returncode == 0 and "omp=None" in alone.stdout, alone.stderr
    mine = _run_without_omp("-n", "2", str(echo), env={"OMP_NUM_THREADS": "2"})
    assert mine.returncode == 0 and mine.stdout.count("omp=2") == 2, mine.stderr


@pytest.mark.slow
def test_two_processes_data_parallel_fsdp():
    done = pt3func("run", "-n", "2", str(SCRIPT), "--mesh", "2", "--fsdp", *TINY)
    assert done.returncode == 0, done.stdout + done.stderr
    logged, final = losses(done.stdout)
    assert logged[-1] < logged[0] - 0.1 and final == logged[-1]
    assert "collectives per step" in done.stdout and "all_gather_into_tensor" in done.stdout
    assert done.stdout.count("final train loss") == 1  # rank 0 alone reports


@pytest.fixture(scope="module")
def four_processes() -> str:
    done = pt3func("run", "-n", "4", str(SCRIPT), "--mesh", "2x2", *TINY)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_four_processes_dp_x_tp(four_processes):
    logged, _ = losses(four_processes)
    assert logged[-1] < logged[0] - 0.1
    assert "Mesh(dp=2, tp=2" in four_processes
    assert re.search(r"all_reduce\s+x\d+", four_processes) and "over 'tp'" in four_processes
    assert "unigram baseline" in four_processes


@pytest.mark.slow
def test_virtual_mesh_matches_four_processes(four_processes):
    done = subprocess.run([sys.executable, str(SCRIPT), "--mesh", "2x2", "--virtual", *TINY], capture_output=True,
                          text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    virtual_logged, virtual_final = losses(done.stdout)
    real_logged, real_final = losses(four_processes)
    assert virtual_final == pytest.approx(real_final, abs=1e-5)
    assert virtual_logged == pytest.approx(real_logged, abs=1e-5)
