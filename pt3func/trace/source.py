"""Find the user's own source line in a traceback or an FX node's recorded stack trace."""

from __future__ import annotations

import functools
import linecache
import os
import re
import sysconfig
import traceback
from types import TracebackType

import torch

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _stdlib_dirs() -> tuple[str, ...]:
    """Python's standard library folders (as given and with links resolved)."""
    paths = sysconfig.get_paths()
    dirs = [paths[key] for key in ("stdlib", "platstdlib") if paths.get(key)]
    return tuple(sorted({os.path.join(f(d), "") for d in dirs for f in (os.path.abspath, os.path.realpath)}))


# The interpreter's own machinery: a virtual mesh's rank threads start in threading.py, so a stack recorded there
# ends in the standard library where a process's would end in the user's script.
_STDLIB_DIRS = _stdlib_dirs()
_THIRD_PARTY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


# Code typed into `python -` / an interactive prompt or an IPython terminal: the user's, though not a file.
_INTERACTIVE = ("<stdin>", "<ipython-input-")


def is_stdlib_file(filename: str) -> bool:
    """True for a file of Python's standard library (`pprint.py`, `logging/__init__.py`, `threading.py`)."""
    path = os.path.abspath(filename)
    return path.startswith(_STDLIB_DIRS) and not any(part in path for part in _THIRD_PARTY)


def is_third_party_file(filename: str) -> bool:
    """True for an installed library's file (site-packages, dist-packages): networkx, transformers, ..."""
    path = os.path.abspath(filename)
    return any(part in path for part in _THIRD_PARTY)


def is_user_file(filename: str) -> bool:
    """True unless `filename` belongs to torch, pt3func or the interpreter's own machinery (its standard library)."""
    # Asked for ~30 frames of every traced op (~8% of a trace's time): absolute names are answered once.
    return _is_user_path(filename) if os.path.isabs(filename) else _is_user_file(filename)


@functools.lru_cache(maxsize=8192)
def _is_user_path(filename: str) -> bool:
    return _is_user_file(filename)


def _is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if filename.startswith(_INTERACTIVE):
        return True
    if path.startswith(_LIBRARY_DIRS) or filename.startswith("<"):  # <string>, <frozen ...>, fx's <eval_with_key>
        return False
    # A library installed under the standard library's folder (lib/python3.x/site-packages) is not the stdlib.
    if is_stdlib_file(path):
        return False
    return not any(part in path for part in (os.sep + "optree" + os.sep, os.sep + "contextlib.py"))


# Where torch's model code lives (a frame there is where a module did something); the rest of torch is the
# tracing machinery that noticed it.
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_MODULE_CALL = os.path.join("nn", "modules", "module.py")  # nn.Module.__call__: every module's forward passes it
_TORCH_MODEL_CODE = tuple(_TORCH_DIR + part for part in ("nn" + os.sep, "functional.py", "distributions" + os.sep))


def library_frame_in_traceback(tb: TracebackType | None) -> tuple[str, int] | None:
    """The innermost frame of `tb` in a library's model code (torch.nn, transformers, ...), neither the user's file
    nor torch's tracing machinery nor pt3func: where a module did what the trace refused."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if path.startswith(_TORCH_DIR):
            if path.startswith(_TORCH_MODEL_CODE) and not path.endswith(_MODULE_CALL):
                found = (path, lineno)
        elif path.startswith(_LIBRARY_DIRS[-1]) or os.sep + "optree" + os.sep in path or filename.startswith("<"):
            continue
        elif "site-packages" in path:
            found = (path, lineno)
        elif is_user_file(path):
            found = None  # the user's code ran below the library's: the user's line is the one to name
    return found


def describe(filename: str, lineno: int) -> str:
    """`file:line` followed by the source code of that line, when it can be read."""
    code = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}" + (f" `{code}`" if code else "")


def user_frame_in_traceback(tb: TracebackType | None) -> tuple[str, int] | None:
    """The innermost frame of `tb` that is user code, as `(filename, lineno)`."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        if is_user_file(frame.f_code.co_filename):
            found = (frame.f_code.co_filename, lineno)
    return found


def user_frame_in_stack_trace(stack_trace: str | None) -> tuple[str, int] | None:
    """The innermost user frame named in an FX node's `meta['stack_trace']`."""
    found = None
    for match in _FRAME_RE.finditer(stack_trace or ""):
        if is_user_file(match["file"]):
            found = (match["file"], int(match["line"]))
    return found


def node_location(node: torch.fx.Node) -> str:
    """`file:line` of the user code that produced `node`, or '' when unknown.

    A collective bucketing made of several (`passes/bucketing.py`, no stack of its own) gets its first member's: the
    first gradient it packs, found through its first inputs (the flattening `cat` and `view`)."""
    frame = user_frame_in_stack_trace(node.meta.get("stack_trace"))
    if frame is None and (node.meta.get("custom") or {}).get("pt3func_bucket"):
        source = node
        for _ in range(4):  # bucket <- cat <- view (<- clone) <- first gradient
            inputs = source.all_input_nodes
            if not inputs:
                break
            source = inputs[0]
            frame = user_frame_in_stack_trace(source.meta.get("stack_trace"))
            if frame is not None:
                break
    return f"{os.path.basename(frame[0])}:{frame[1]}" if frame else ""
