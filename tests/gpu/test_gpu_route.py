"""The route a device call takes (one rank): checks, the staged path through the real
public collectives, and checked mode's error reporting."""
from __future__ import annotations

import numpy as np
import pytest

import mpicoll
from gpu_helpers import FakeDevice, fake_copies, rank_data
from mpicoll import IN_PLACE
from mpicoll.gpu import route

NOT_AWARE = (False, "test")
PUBLIC = {"allreduce": mpicoll.allreduce, "reduce_scatter": mpicoll.reduce_scatter,
          "allgather": mpicoll.allgather, "broadcast": mpicoll.broadcast,
          "reduce": mpicoll.reduce}


def _route(collective, args, check=None, **kw):
    return route.device_call(collective, args, None, check, PUBLIC[collective],
                             aware=NOT_AWARE, copies=fake_copies(), chunk_bytes=16, **kw)


@pytest.mark.parametrize("algorithm", ["auto", "native"])
def test_staged_through_the_public_functions(algorithm: str) -> None:
    x = rank_data(0, 50, np.int64)
    for _ in range(2):
        done, out = _route("allreduce", (FakeDevice(x.copy()), None, "sum", algorithm))
        assert done and isinstance(out, FakeDevice)
        np.testing.assert_array_equal(out.array, x)
        y = FakeDevice(np.zeros_like(x))
        done, out = _route("reduce_scatter", (FakeDevice(x.copy()), y, "sum", algorithm))
        assert out is y
        np.testing.assert_array_equal(y.array, x)
        done, out = _route("allgather", (FakeDevice(x.copy()), None, algorithm))
        np.testing.assert_array_equal(out.array, x)
        buf = FakeDevice(x.copy())
        assert _route("broadcast", (buf, 0, algorithm))[1] is buf
        done, out = _route("reduce", (IN_PLACE, buf, "average", 0, algorithm))
        np.testing.assert_array_equal(buf.array, x)


def test_mixed_buffers_raise_before_anything() -> None:
    with pytest.raises(TypeError, match="sendbuf is a device array .* recvbuf is a host"):
        _route("allreduce", (FakeDevice(np.zeros(4)), np.zeros(4), "sum", "auto"))


def test_non_contiguous_raises() -> None:
    base = np.zeros((4, 6))
    with pytest.raises(ValueError, match="recvbuf must be contiguous"):
        _route("allreduce", (IN_PLACE, FakeDevice(base[:, ::2], strides=(48, 16)), "sum",
                             "auto"))


def test_checked_mode_runs_the_agreement_step_on_errors() -> None:
    """With check=True a local error goes through the agreement step (one rank here)."""
    with pytest.raises(TypeError, match="sendbuf is a device array"):
        _route("allreduce", (FakeDevice(np.zeros(4)), np.zeros(4), "sum", "auto"),
               check=True)
    with pytest.raises(ValueError, match="recvbuf has 3 elements"):
        _route("allreduce", (FakeDevice(np.zeros(4)), FakeDevice(np.zeros(3)), "sum",
                             "auto"), check=True)
    # and a good call in checked mode runs the host calls checked
    done, out = _route("allreduce", (FakeDevice(np.arange(40.0)), None, "sum", "auto"),
                       check=True)
    np.testing.assert_array_equal(out.array, np.arange(40.0))


def test_reporter_only_in_checked_mode(monkeypatch) -> None:
    from mpicoll import config

    assert route.reporter("allreduce", None, False) is None
    assert callable(route.reporter("allreduce", None, True))
    monkeypatch.setenv("MPICOLL_CHECK", "1")
    config.refresh()
    try:
        assert callable(route.reporter("allreduce", None, None))
    finally:
        monkeypatch.delenv("MPICOLL_CHECK")
        config.refresh()
