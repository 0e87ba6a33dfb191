"""The cache of validated calls never lets a changed argument through (serial, 1 rank)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import mpicoll
from mpicoll import config, fastpath


@pytest.fixture(autouse=True)
def clean_cache():
    fastpath.invalidate()
    yield
    fastpath.invalidate()


def test_repeated_call_hits_and_stays_correct():
    x = np.arange(5, dtype=np.int64)
    y = np.empty_like(x)
    for k in range(3):
        x[:] = k
        assert mpicoll.allreduce(x, y) is y
        assert y.tolist() == [k] * 5
    assert fastpath.lookup("allreduce", (x, y, "sum", "auto", None), y) is not None


def test_new_array_with_a_dead_arrays_id_is_validated_again():
    for _ in range(50):
        x = np.ones(4, dtype=np.float32)
        y = np.empty(4, dtype=np.float32)
        mpicoll.allreduce(x, y)
        del y
        gc.collect()
        bad = np.empty(3, dtype=np.float32)  # may reuse the dead array's id
        with pytest.raises(ValueError, match="recvbuf has 3 elements"):
            mpicoll.allreduce(x, bad)


def test_output_made_read_only_after_caching_is_rejected():
    x = np.ones(4)
    y = np.empty(4)
    mpicoll.allreduce(x, y)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mpicoll.allreduce(x, y)


def test_settings_change_invalidates(monkeypatch):
    x = np.ones(4)
    y = np.empty(4)
    mpicoll.allreduce(x, y)
    assert fastpath.lookup("allreduce", (x, y, "sum", "auto", None), y) is not None
    monkeypatch.setenv("MPICOLL_ALGORITHM", "ring")
    config.refresh()
    try:
        assert fastpath.lookup("allreduce", (x, y, "sum", "auto", None), y) is None
        mpicoll.allreduce(x, y)
        payload = fastpath.lookup("allreduce", (x, y, "sum", "auto", None), y)
        assert payload is not None and payload[1] == "ring"
    finally:
        monkeypatch.delenv("MPICOLL_ALGORITHM")
        config.refresh()


def test_checked_and_allocating_calls_are_not_cached():
    x = np.ones(4)
    y = np.empty(4)
    mpicoll.allreduce(x, y, check=True)
    assert fastpath.lookup("allreduce", (x, y, "sum", "auto", None), y) is None
    mpicoll.allreduce(x)
    assert not fastpath._calls
