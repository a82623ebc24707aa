"""Settings for the whole test suite."""

import os

import pytest

# Tests of the grad_exchange formats check their numbers step by step, so no exchange guard there: it would run
# reference-exchange steps among the compressed ones (pt3func/compress/guard.py). Set before pt3func is imported,
# so the gloo worlds' processes inherit it; tests/test_exchange_guard.py turns the guard back on.
os.environ["PT3FUNC_EXCHANGE_GUARD"] = "off"


@pytest.fixture
def explain_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pf.config.explain_cache_misses` on for one test (the cache-miss log its assertions read)."""
    import pt3func as pf

    monkeypatch.setattr(pf.config, "explain_cache_misses", True)


@pytest.fixture
def world_of_one_mesh(monkeypatch: pytest.MonkeyPatch):
    """A real torch.distributed world of this process alone and its 1-rank mesh, ended after the test."""
    import torch.distributed as dist

    import pt3func as pf

    assert not dist.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield pf.make_mesh((1,), ("dp",))
    dist.destroy_process_group()
