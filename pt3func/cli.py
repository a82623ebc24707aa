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
    parser.add_argument("-n", "--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", metavar="N",
                        default="1", help="processes to start on this machine (default 1; torchrun also takes "
                        "'gpu', 'cpu', 'auto')")
    parser.add_argument("-h", "--help", action="help", help="show this help and exit")
    return parser


def _torchrun_arity() -> dict[str, int]:
    """How many values each of torchrun's options takes (0 for a switch such as --standalone)."""
    from torch.distributed.run import get_args_parser

    arity = {}
    for action in get_args_parser()._actions:
        for flag in action.option_strings:
            arity[flag] = 0 if action.nargs == 0 else 1
    return arity


def _torchrun_flag(flag: str, arity: dict[str, int]) -> str:
    """`flag` as torchrun's parser reads it: itself, or the one flag it abbreviates."""
    if flag in arity:
        return flag
    matches = {known for known in arity if known.startswith(flag) and flag.startswith("--")}
    if len(matches) == 1:
        return matches.pop()
    what = f"ambiguous flag {flag} (could be {', '.join(sorted(matches))})" if matches else f"unknown flag {flag}"
    raise UsageError(f"{what} before the script; `{PROG} run` takes -n and torchrun's flags there "
                     "(see `torchrun --help`), and the script's own flags after it")


def split_run_args(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """`[launcher flags...] script [script args...]` -> (launcher flags, script, script args).

    The script is the first word that is neither a flag nor a flag's value; a lone `--` may stand before it.
    """
    argv = list(argv)
    arity: dict[str, int] | None = None
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            if i + 1 == len(argv):
                raise UsageError("no script after `--`")
            return argv[:i], argv[i + 1], argv[i + 2:]
        if not word.startswith("-") or word == "-":
            return argv[:i], word, argv[i + 1:]
        flag = word.split("=", 1)[0]
        if flag in ("-n", "--nproc", "--nproc-per-node", "--nproc_per_node"):
            takes = 1
        else:
            arity = arity if arity is not None else _torchrun_arity()
            takes = arity[_torchrun_flag(flag, arity)]
        if "=" in word or takes == 0:
            i += 1
        elif i + 1 < len(argv):
            i += 2
        else:
            raise UsageError(f"flag {word} needs a value")
    raise UsageError("no script given; usage: pt3func run [-n N] [torchrun flags...] script.py [script args...]")


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
    nproc = str(ours.nproc)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("gpu", "cpu", "auto"):
        raise UsageError(f"-n takes a positive number of processes (or gpu, cpu, auto), got {nproc!r}")
    if not flags & NOT_A_FILE_FLAGS and not Path(script).is_file():
        raise UsageError(f"no such script: {script}")
    standalone = [] if flags & RENDEZVOUS_FLAGS else ["--standalone"]
    # `--` keeps torchrun's parser off the script's flags: it matches abbreviations, so a script flag
    # like `--d 64` would otherwise be taken for torchrun's `--duplicate-*-filters`.
    return [*standalone, "--nproc-per-node", nproc, *passthrough, "--", script, *script_args]


def run(argv: Sequence[str]) -> int:
    """`pt3func run ARGV`: launch with torchrun; the exit status of the first failed process, else 0."""
    args = torchrun_argv(argv)
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # Processes sharing the CPU would each start one OpenMP thread per core and fight over them.
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = "1"
    # With the rendezvous store shared into the workers (torchrun's default), a job restarted by --max-restarts
    # reads the dead workers' addresses and its process group cannot connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun_main(args)
    except ChildFailedError as e:
        _rank, failure = e.get_first_failure()
        print(f"{PROG} run: {e.name} failed (exit status {failure.exitcode}); see the output above",
              file=sys.stderr)
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
