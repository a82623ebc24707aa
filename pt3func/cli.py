"""The `pt3func` command line: `pt3func run -n 4 script.py [args...]` runs a script on 4 local processes.

`run` is torchrun (`torch.distributed.run`), called in this process with its usual flags: one machine
by default (`--standalone`), several with torchrun's multi-node flags, which pass through unchanged.
Each process finds its rank in torchrun's environment variables; `pf.make_mesh` starts the process group
from them (NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "pt3func"

# Given any of these, the user is describing a rendezvous of their own, which `--standalone` would override.
RENDEZVOUS_FLAGS = frozenset({
    "--nnodes", "--node-rank", "--node_rank", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend",
    "--rdzv_backend", "--rdzv-id", "--rdzv_id", "--master-addr", "--master_addr", "--master-port",
    "--master_port", "--standalone",
})

# torchrun flags that say the "script" is not a file: a module name (-m) or a program on PATH.
NOT_A_FILE_FLAGS = frozenset({"-m", "--module", "--no-python", "--no_python"})

# Our spellings of the processes per machine (torchrun's --nproc-per-node, plus -n).
NPROC_FLAGS = ("-n", "--nproc", "--nproc-per-node", "--nproc_per_node")

RUN_EPILOG = """\
torchrun flags (--nnodes, --node-rank, --rdzv-endpoint, --rdzv-backend, --rdzv-id, --max-restarts,
--master-addr, --log-dir, -m, ...) may be given before the script and pass through to torchrun;
see `torchrun --help`. Everything after the script belongs to the script.

examples:
  pt3func run -n 4 train.py --steps 100
  pt3func run -n 8 --nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint host0:29400 train.py
"""


class UsageError(Exception):
    """A command line that cannot be run; the message says what to change."""


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} run",
        usage=f"{PROG} run [-n N] [torchrun flags...] script.py [script args...]",
        description="Run a script on N local processes (wraps torchrun; gloo on CPU, NCCL on GPUs).",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,  # an abbreviation of ours could swallow one of torchrun's flags
    )
    parser.add_argument(*NPROC_FLAGS, dest="nproc", metavar="N",
                        default="1", help="processes to start on this machine (default 1; torchrun also takes "
                        "'gpu', 'cpu', 'auto')")
    parser.add_argument("-h", "--help", action="help", help="show this help and exit")
    return parser


class _LauncherFlags:
    """The flags `pt3func run` takes before the script: our -n, and torchrun's (its parser is built on first use:
    importing torch.distributed.run takes a while)."""

    def __init__(self) -> None:
        self._torchrun: dict[str, argparse.Action] | None = None

    def _options(self) -> dict[str, argparse.Action]:
        if self._torchrun is None:
            from torch.distributed.run import get_args_parser

            self._torchrun = {flag: action for action in get_args_parser()._actions for flag in action.option_strings}
        return self._torchrun

    def action(self, flag: str) -> argparse.Action | None:
        """torchrun's action for `flag` (or the one flag it abbreviates); None for our -n."""
        if flag in NPROC_FLAGS:
            return None
        options = self._options()
        if flag in options:
            return options[flag]
        matches = {known for known in options if known.startswith(flag) and flag.startswith("--")}
        if len(matches) == 1:
            return options[matches.pop()]
        what = f"ambiguous flag {flag} (could be {', '.join(sorted(matches))})" if matches else f"unknown flag {flag}"
        raise UsageError(f"{what} before the script; `{PROG} run` takes -n and torchrun's flags there "
                         "(see `torchrun --help`), and the script's own flags after it")

    def takes_value(self, flag: str) -> bool:
        """Whether `flag` is known and takes a value (False for a switch such as --standalone, or a stranger)."""
        return flag in NPROC_FLAGS or (flag in self._options() and self._options()[flag].nargs != 0)

    def split(self, word: str) -> tuple[str, str | None]:
        """`word` as (flag, the value written into the same word, or None), as argparse reads it:
        `--flag=value`, `-n=2`, and a short flag with its value glued on, `-n2`."""
        flag, equals, value = word.partition("=")
        if equals:
            return flag, value
        if not word.startswith("--") and len(word) > 2 and self.takes_value(word[:2]):
            return word[:2], word[2:]
        return word, None


def _looks_like_script(word: str) -> bool:
    return word.endswith(".py") or Path(word).exists()


def _check_value(flag: str, value: str, action: argparse.Action | None) -> None:
    """Refuse a value the flag cannot take, naming both (a script swallowed as a flag's value included)."""
    hint = f" (the script? give {flag} its value before the script)" if _looks_like_script(value) else ""
    if action is None:  # ours: -n
        if not (value.isdigit() and int(value) > 0) and value not in ("gpu", "cpu", "auto"):
            raise UsageError(f"{flag} takes a positive number of processes (or gpu, cpu, auto), got {value!r}{hint}")
        return
    if action.type in (int, float):
        try:
            action.type(value)
        except ValueError:
            kind = "an integer" if action.type is int else "a number"
            raise UsageError(f"{flag} takes {kind}, got {value!r}{hint}") from None


def split_run_args(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """`[launcher flags...] script [script args...]` -> (launcher flags, script, script args).

    The script is the first word that is neither a flag nor a flag's value; a lone `--` may stand before it.
    """
    argv = list(argv)
    known = _LauncherFlags()
    swallowed: tuple[str, str] | None = None  # the last flag that took the next word as its value
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            if i + 1 == len(argv):
                raise UsageError("no script after `--`")
            return argv[:i], argv[i + 1], argv[i + 2:]
        if not word.startswith("-") or word == "-":
            return argv[:i], word, argv[i + 1:]
        flag, value = known.split(word)
        action = known.action(flag)
        i += 1
        if action is not None and action.nargs == 0:
            continue
        if value is None:
            if i == len(argv):
                raise UsageError(f"flag {word} needs a value")
            value = argv[i]
            swallowed = (flag, value)
            i += 1
        _check_value(flag, value, action)
    usage = "usage: pt3func run [-n N] [torchrun flags...] script.py [script args...]"
    if swallowed is not None and _looks_like_script(swallowed[1]):
        flag, value = swallowed
        raise UsageError(f"no script given: {flag} took {value!r} as its value; give {flag} its value before the "
                         f"script; {usage}")
    raise UsageError(f"no script given; {usage}")


def _check_script(script: str) -> None:
    """Refuse a script python could not run: it runs a file, or a directory (or zip) holding `__main__.py`."""
    path = Path(script)
    if path.is_file() or (path / "__main__.py").is_file():
        return
    if path.is_dir():
        raise UsageError(f"{script} is a directory without __main__.py: nothing to run")
    raise UsageError(f"no such script: {script}")


def torchrun_argv(argv: Sequence[str]) -> list[str]:
    """The argument list for `torch.distributed.run.main` that `pt3func run ARGV` stands for."""
    try:
        launcher, script, script_args = split_run_args(argv)
    except UsageError:
        if {"-h", "--help"} & set(argv):
            _run_parser().parse_args(["--help"])
        raise
    if {"-h", "--help"} & set(launcher):
        _run_parser().parse_args(["--help"])
    ours, passthrough = _run_parser().parse_known_args(launcher)
    flags = {word.split("=", 1)[0] for word in passthrough if word.startswith("-")}
    if not flags & NOT_A_FILE_FLAGS:
        _check_script(script)
    standalone = [] if flags & RENDEZVOUS_FLAGS else ["--standalone"]
    # `--` keeps torchrun's parser off the script's flags: it matches abbreviations, so a script flag
    # like `--d 64` would otherwise be taken for torchrun's `--duplicate-*-filters`.
    return [*standalone, "--nproc-per-node", str(ours.nproc), *passthrough, "--", script, *script_args]


def local_processes(args: Sequence[str]) -> int | None:
    """How many processes torchrun starts on this machine for `args` (torchrun_argv's output); None if it
    cannot tell (torchrun then reports the bad value itself)."""
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(args[args.index("--nproc-per-node") + 1])
    except ValueError:
        return None


def _limit_omp_threads(processes: int | None) -> None:
    """One OpenMP thread per process when several share this machine's cores: each would otherwise start one
    thread per core and they would fight over them (torchrun's own rule, without its warning banner). A single
    process keeps every core, and a user's own OMP_NUM_THREADS always wins."""
    if processes is not None and processes > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def _failure_line(name: str, rank: int | None, exitcode: int) -> str:
    who = f"{name} (rank {rank})" if rank is not None and rank >= 0 else name
    return f"{PROG} run: {who} failed (exit status {exitcode}); see the output above"


def run(argv: Sequence[str]) -> int:
    """`pt3func run ARGV`: launch with torchrun; the exit status of the first failed process, else 0."""
    args = torchrun_argv(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    _limit_omp_threads(local_processes(args))
    # With the rendezvous store shared into the workers (torchrun's default), a job restarted by --max-restarts
    # reads the dead workers' addresses and its process group cannot connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun_main(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(_failure_line(e.name, rank, failure.exitcode), file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def _main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [-h] [--version] COMMAND ...",
        description="pt3func: JAX-style functional training for PyTorch.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n  run    run a script on N local processes (torchrun)\n\n"
               f"`{PROG} COMMAND --help` describes a command.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=["run"], help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pt3func` console script and of `python -m pt3func`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        try:
            return run(argv[1:])
        except UsageError as e:
            print(f"{PROG} run: error: {e}", file=sys.stderr)
            return 2
    parser = _main_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import version

        print(f"{PROG} {version('pt3func')}")
        return 0
    parser.print_help(sys.stderr)
    return 2
