"""Disagreements across ranks raise on every rank, never hang; bad arguments raise locally."""
from __future__ import annotations

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

def test_shape_mismatch_raises_on_every_rank():
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    for rep in range(2):
        with pytest.raises(hvd.MismatchError, match="shape"):
            hvd.allreduce(torch.ones(3 + hvd.rank()), name=f"bad.shape.{rep}")
    hvd.barrier()  # still usable afterwards
    assert torch.equal(hvd.allreduce(torch.ones(2)), torch.ones(2))


def test_dtype_op_and_kind_mismatch():
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    dtype = torch.float32 if hvd.rank() == 0 else torch.float64
    with pytest.raises(hvd.MismatchError, match="dtype"):
        hvd.allreduce(torch.ones(3, dtype=dtype), name="bad.dtype")
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(hvd.MismatchError, match="op: ranks 0 have Sum; ranks 1.* have Max"):
        hvd.allreduce(torch.ones(3), op=op, name="bad.op")   # (the ops by name, not code)
    with pytest.raises(hvd.MismatchError, match="kind"):
        if hvd.rank() == 0:
            hvd.allreduce(torch.ones(3), name="bad.kind")
        else:
            hvd.broadcast(torch.ones(3), 0, name="bad.kind")
    with pytest.raises(hvd.MismatchError, match="root"):
        hvd.broadcast(torch.ones(3), root_rank=hvd.rank(), name="bad.root")
    with pytest.raises(hvd.MismatchError, match="rows"):
        hvd.allgather(torch.ones(2, 1 + hvd.rank()), name="bad.rows")


def test_different_names_fail_on_every_rank_instead_of_hanging():
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    with pytest.raises(hvd.CollectiveError, match="can never complete"):
        hvd.allreduce(torch.ones(3), name=f"only.rank.{hvd.rank()}")
    # One rank does one more operation than the others.
    with pytest.raises(hvd.CollectiveError, match="can never complete"):
        hvd.allreduce(torch.ones(1), name="common")
        if hvd.rank() == 0:
            hvd.allreduce(torch.ones(1), name="extra")
        else:
            hvd.allreduce(torch.ones(1), name="other")
    hvd.barrier()


def test_bad_arguments_raise_locally_before_sending():
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce([1, 2, 3])
    with pytest.raises(TypeError, match="does not apply"):
        hvd.allreduce_async(torch.ones(2, dtype=torch.bool), op=hvd.Sum)
    with pytest.raises(TypeError, match="Adasum"):
        hvd.allreduce_async(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce_async(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="out of range"):
        hvd.broadcast(torch.ones(2), root_rank=hvd.size())
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(torch.tensor(1.0))
    with pytest.raises(ValueError, match="bool"):
        hvd.allreduce_async(torch.ones(2, dtype=torch.bool), op=hvd.Max, prescale_factor=2.0)
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(10 ** 9)


def test_duplicate_name_in_flight():
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks (at n=1 the first request completes at once)")
    if hvd.rank() == 0:
        h = hvd.allreduce_async(torch.ones(2), name="dup")   # pending until the others submit
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(2), name="dup")
        hvd.barrier()
        assert torch.equal(hvd.synchronize(h), torch.ones(2))
    else:
        hvd.barrier()
        assert torch.equal(hvd.allreduce(torch.ones(2), name="dup"), torch.ones(2))


def test_stall_inspector_names_ranks_that_did_not_submit(monkeypatch, caplog):
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    import time

    monkeypatch.setenv("MPICOLL_STALL_CHECK_TIME_SECONDS", "0.2")
    hvd.shutdown()
    hvd.init()
    last = hvd.size() - 1
    try:
        with caplog.at_level("WARNING", logger="mpicoll.torch.stall"):
            if hvd.rank() == last:
                h1 = hvd.allreduce_async(torch.ones(1), name="stall.y")
                time.sleep(0.8)                      # x arrives late from this rank
                h2 = hvd.allreduce_async(torch.ones(1), name="stall.x")
            else:
                h1 = hvd.allreduce_async(torch.ones(1), name="stall.x")
                h2 = hvd.allreduce_async(torch.ones(1), name="stall.y")
            hvd.synchronize(h1)
            hvd.synchronize(h2)
        if hvd.rank() == 0:
            text = caplog.text
            assert "'stall.x' was submitted by ranks" in text, text
            assert f"but not yet by ranks [{last}]" in text, text
    finally:
        monkeypatch.delenv("MPICOLL_STALL_CHECK_TIME_SECONDS")
        hvd.shutdown()
        hvd.init()
