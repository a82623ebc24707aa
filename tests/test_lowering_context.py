"""The lowering context is seen from the autograd engine's device threads (CUDA backward runs there)."""

from __future__ import annotations

import threading

from pt3func.spmd import lower
from pt3func.trace import capture


def test_lowering_context_is_visible_from_another_thread():
    seen = []
    with capture.TRACE_LOCK, lower.lowering() as ctx:
        worker = threading.Thread(target=lambda: seen.append(lower.current()))
        worker.start()
        worker.join()
    assert seen == [ctx]
    assert lower.current() is None


def test_nested_lowering_restores_the_outer_context():
    with capture.TRACE_LOCK, lower.lowering() as outer:
        with lower.lowering() as inner:
            assert lower.current() is inner
        assert lower.current() is outer
