"""Serial: importing mpicoll.torch registers the "mpicoll" torch.distributed backend."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_backend_registered_on_import():
    import torch.distributed as dist

    import mpicoll.torch  # noqa: F401
    from mpicoll.torch import distributed

    assert "mpicoll" in dist.Backend.backend_list
    assert dist.Backend.MPICOLL == "mpicoll"
    assert dist.Backend._plugins["MPICOLL"].creator_fn is distributed._create
    distributed.register()          # idempotent
    assert dist.Backend.backend_list.count("mpicoll") == 1


def test_reduce_op_names():
    import torch.distributed as dist

    from mpicoll.torch.distributed import _op_name

    assert _op_name(dist.ReduceOp.AVG) == "average"
    assert _op_name(dist.ReduceOp.BXOR) == "bxor"
    with pytest.raises(ValueError, match="does not support"):
        _op_name(dist.ReduceOp.PREMUL_SUM)


def test_premul_sum_and_options():
    import torch.distributed as dist

    from mpicoll.torch.distributed import Options
    from mpicoll.torch.distributed.tensors import op_label, op_name, premul_factor

    op = dist._make_nccl_premul_sum(2.5)
    assert op_label(op) == "premul_sum" and premul_factor(dist.ReduceOp.SUM) is None
    if premul_factor(op) is None:        # torch 2.11 does not expose the factor
        with pytest.raises(ValueError, match="without its factor"):
            op_name(op)
    else:
        assert op_name(op) == "sum" and premul_factor(op) == 2.5
    assert Options().check == "every"
    with pytest.raises(ValueError, match="check="):
        Options(check="sometimes")


def test_work_completes_with_result_or_error():
    """torch's Work over the runtime's: result, error, future; a closed lane refuses."""
    from mpicoll.runtime import Lane
    from mpicoll.torch.distributed.work import MPIWork, completed

    lane = Lane("test-lane", inline=False)
    ok = MPIWork(lane.submit("ok", lambda: [1]))
    bad = MPIWork(lane.submit("bad", lambda: 1 / 0))
    assert ok.wait() and ok.result() == [1] and ok.get_future().wait() == [1]
    with pytest.raises(ZeroDivisionError):
        bad.wait()
    with pytest.raises(ZeroDivisionError):
        bad.get_future().wait()
    assert bad.is_completed() and not bad.is_success()
    assert isinstance(bad.exception(), ZeroDivisionError)
    assert completed("done", [2]).result() == [2]
    assert lane.close(5.0)
    with pytest.raises(RuntimeError, match="shut down"):
        lane.submit("late", lambda: None)


def test_wait_timeout_raises_at_once_and_breaks_the_lane():
    """An expired wait(timeout) raises CollectiveTimeoutError (a RuntimeError) naming the
    operation within the timeout; the work queued behind fails with the same error."""
    import threading
    import time
    from datetime import timedelta

    from mpicoll.errors import CollectiveTimeoutError
    from mpicoll.runtime import Lane
    from mpicoll.torch.distributed.work import MPIWork

    release = threading.Event()
    lane = Lane("test-timeout", inline=False)
    stuck = MPIWork(lane.submit("allreduce", lambda: release.wait(30)))
    queued = MPIWork(lane.submit("broadcast", lambda: None))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="allreduce.*timed out") as info:
        stuck.wait(timedelta(seconds=0.3))
    assert time.monotonic() - start < 1.5 and isinstance(info.value, RuntimeError)
    with pytest.raises(CollectiveTimeoutError):
        queued.wait()
    with pytest.raises(CollectiveTimeoutError):
        stuck.get_future().wait()
    release.set()          # the operation ends: closing the broken lane then is fine
    for _ in range(500):
        if lane.completed:
            break
        time.sleep(0.01)
    assert lane.close(5.0)
