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
    from mpicoll.torch.distributed.work import GroupWorker

    worker = GroupWorker("test-worker", None)
    ok = worker.submit("ok", lambda: [1])
    bad = worker.submit("bad", lambda: 1 / 0)
    assert ok.wait() and ok.result() == [1] and ok.get_future().wait() == [1]
    with pytest.raises(ZeroDivisionError):
        bad.wait()
    with pytest.raises(ZeroDivisionError):
        bad.get_future().wait()
    assert bad.is_completed() and not bad.is_success()
    assert worker.close(5.0)
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit("late", lambda: None)
