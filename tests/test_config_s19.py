"""Session 19: pf.config checks the values it is given (a str for a set of pass names matched substrings)."""

from __future__ import annotations

import pytest

import pt3func as pf


@pytest.fixture
def restore():
    saved = {name: getattr(pf.config, name) for name in ("disabled_passes", "loss_chunk_bytes", "strict_donation",
                                                          "fence_backward_ops")}
    yield
    for name, value in saved.items():
        setattr(pf.config, name, value)


def test_settings_refuse_wrong_values(restore):
    with pytest.raises(ValueError, match=r"disabled_passes is a set of names, e.g. \{'sink_waits'\}, got 'sink_waits'"):
        pf.config.disabled_passes = "sink_waits"
    with pytest.raises(ValueError, match="exchange_guard is one of 'auto', 'off', got 'bogus'"):
        pf.config.exchange_guard = "bogus"
    with pytest.raises(ValueError, match="strict_donation is True or False, got 1"):
        pf.config.strict_donation = 1
    with pytest.raises(ValueError, match=r"loss_chunk_bytes is a number of bytes \(an int >= 0\) or None, got -1"):
        pf.config.loss_chunk_bytes = -1
    with pytest.raises(ValueError, match="fence_backward_ops is a set of names"):
        pf.config.fence_backward_ops = 3


def test_settings_take_right_values(restore):
    pf.config.disabled_passes = ["sink_waits", "order_by_readiness"]  # any iterable of names: kept as a frozenset
    assert pf.config.disabled_passes == frozenset({"sink_waits", "order_by_readiness"})
    pf.config.loss_chunk_bytes = None
    pf.config.fence_backward_ops = {"native_layer_norm_backward"}
    assert pf.config.fence_backward_ops == frozenset({"native_layer_norm_backward"})


def test_an_unknown_pass_name_is_warned_about(restore):
    with pytest.warns(UserWarning, match="no pass is named 'sink_wait' .*did you mean 'sink_waits'"):
        pf.config.disabled_passes = {"sink_wait"}


def test_environment_spellings_are_normalised(restore):
    saved = pf.config.bucket_collectives
    try:
        pf.config.bucket_collectives = " On"
        assert pf.config.bucket_collectives == "on"
        pf.config.bucket_collectives = ""  # an empty variable: the default
        assert pf.config.bucket_collectives == "auto"
    finally:
        pf.config.bucket_collectives = saved
