"""Session 19: file I/O inside a step is refused (API.md: I/O raises), and code typed at a prompt is the user's."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

import pt3func as pf


def test_opening_a_file_inside_a_step_is_refused(tmp_path):
    target = tmp_path / "log.txt"

    def write(x):
        with open(target, "w") as f:
            f.write("once, while tracing")
        return x + 1

    def read(x):
        return x + float(target.read_text() or 0)  # pathlib opens it through io.open

    with pytest.raises(pf.ImpureFunctionError, match=r"test_capture_s19.py:\d+ .*opening a file .*log.txt.* "
                                                     r"inside jitted '.*write' is I/O"):
        pf.jit(write, backend="eager")(torch.ones(2))
    assert not target.exists()
    target.write_text("1")
    with pytest.raises(pf.ImpureFunctionError, match="inside jitted '.*read' is I/O"):
        pf.jit(read, backend="eager")(torch.ones(2))
    assert open(target).read() == "1"  # outside a step, open() is Python's own again


def test_a_library_reading_its_own_files_inside_a_step_is_not_refused(tmp_path):
    # An installed library that reads a file of its own while the step runs (networkx its entry points when torch
    # first imports it) is not the user doing I/O.
    package = tmp_path / "site-packages" / "somelib"
    package.mkdir(parents=True)
    (package / "data.txt").write_text("2.0")
    (package / "__init__.py").write_text(
        "import os\n"
        "def scale():\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'data.txt')) as f:\n"
        "        return float(f.read())\n")
    spec = importlib.util.spec_from_file_location("somelib", package / "__init__.py")
    somelib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(somelib)
    out = pf.jit(lambda x: x * somelib.scale(), backend="eager")(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))


def test_code_typed_at_a_prompt_is_named_in_errors():
    script = ("import torch, pt3func as pf\n"
              "def step(x):\n"
              "    if x.sum() > 0:\n"
              "        return x\n"
              "    return x + 1\n"
              "try:\n"
              "    pf.jit(step, backend='eager')(torch.ones(2))\n"
              "except pf.TracingError as e:\n"
              "    print(str(e).splitlines()[0][:40])\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300,
                          cwd=pathlib.Path(__file__).parent)
    assert done.stdout.startswith("<stdin>:3: Python control flow"), (done.stdout, done.stderr[-2000:])


def _grouped(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def test_a_float32_grouped_mm_is_refused_naming_the_line():
    a, b, offs = torch.randn(8, 16), torch.randn(2, 16, 8), torch.tensor([3, 8], dtype=torch.int32)  # 16-byte strides
    try:
        _grouped(a, b, offs)  # runs eagerly on the CPU (torch 2.13); its tracing kernel takes bfloat16 only
    except (AttributeError, RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU float32 grouped_mm")
    with pytest.raises(pf.TracingError, match=r"test_capture_s19.py:\d+ .*_grouped_mm.*bfloat16 only.*batched_mm"):
        pf.jit(_grouped, backend="eager")(a, b, offs)


def _ema(teacher, student):
    torch._foreach_lerp_(list(teacher.values()), list(student.values()), 0.5)  # timm's ModelEmaV3 way
    return {k: v * 2 for k, v in teacher.items()}


def test_foreach_writes_into_inputs_and_captured_tensors_are_refused():
    student = {"w": torch.ones(4)}
    teacher = {"w": torch.zeros(4)}
    with pytest.raises(pf.ImpureFunctionError, match=r"_foreach_lerp_.* writes in place into input teacher\['w'\]"):
        pf.jit(_ema, backend="eager")(teacher, student)
    assert teacher["w"].eq(0).all()  # untouched (one device used to change it, a mesh to drop the write)
    ema = [torch.zeros(4)]
    with pytest.raises(pf.ImpureFunctionError, match="writes in place into a tensor captured from outside the step"):
        pf.jit(lambda s: torch._foreach_lerp_(ema, [s], 0.5) or ema[0] * 1, backend="eager")(torch.ones(4))
    assert ema[0].eq(0).all()


def test_foreach_writes_into_the_step_own_tensors_run():
    def step(xs):
        fresh = [x * 1 for x in xs]
        torch._foreach_mul_(fresh, 3.0)
        torch._foreach_add_(fresh, 1.0)
        return fresh

    xs = [torch.ones(3), torch.arange(2.0)]
    out = pf.jit(step, backend="eager")(xs)
    for got, x in zip(out, xs):
        torch.testing.assert_close(got, x * 3 + 1)


def _per_example(x):
    if x.sum() > 0:  # control flow on a batched value: torch.func.vmap's own refusal
        return x
    return -x


def test_control_flow_under_vmap_is_named_as_data_dependent():
    with pytest.raises(pf.DataDependentControlFlowError, match=r"test_capture_s19.py:\d+ `if x.sum\(\) > 0:"):
        pf.jit(pf.vmap(_per_example), backend="eager")(torch.randn(3, 2))
