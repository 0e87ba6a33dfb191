"""Device choice (MPICOLL_DEVICE), without a GPU."""
from __future__ import annotations

import pytest

from mpicoll import config
from mpicoll.gpu import device


@pytest.mark.parametrize("local,count,setting,want", [
    (0, 1, None, 0), (3, 1, None, 0), (3, 2, "auto", 1), (5, 4, "", 1),
    (2, 4, "3", 3), (0, 4, "1,3", 1), (1, 4, "1,3", 3), (2, 4, "1,3", 1),
    (7, 1, "none", None), (0, 0, "none", None)])
def test_choice(local, count, setting, want) -> None:
    assert device.choose_device(local, count, setting) == want


def test_several_ranks_share_one_gpu() -> None:
    assert {device.choose_device(r, 1, None) for r in range(4)} == {0}


@pytest.mark.parametrize("setting,message", [
    ("gpu0", "MPICOLL_DEVICE='gpu0' is not valid"), ("-1", "ordinals are >= 0"),
    ("1,x", "is not valid")])
def test_bad_settings(setting, message) -> None:
    with pytest.raises(ValueError, match=message):
        device.choose_device(0, 2, setting)


def test_ordinal_not_visible_and_no_gpu() -> None:
    with pytest.raises(ValueError, match="device 2, but only 2 device"):
        device.choose_device(0, 2, "2")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        device.choose_device(0, 0, None)


def test_select_device_without_activation(monkeypatch) -> None:
    """MPICOLL_DEVICE is read through mpicoll.config (re-read after refresh())."""
    try:
        monkeypatch.setenv("MPICOLL_DEVICE", "1")
        config.refresh()
        assert device.select_device(0, device_count=2, activate=False) == 1
        monkeypatch.delenv("MPICOLL_DEVICE")
        config.refresh()
        assert device.select_device(3, device_count=2, activate=False) == 1
    finally:
        monkeypatch.undo()
        config.refresh()


def test_local_rank_alone_is_zero() -> None:
    assert device.local_rank() == 0
