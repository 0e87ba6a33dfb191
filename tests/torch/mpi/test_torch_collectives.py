"""Tensor collectives against references computed from every rank's known data."""
from __future__ import annotations

import pickle

import pytest
import torch

import mpicoll
import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def rank_data(rank: int, count: int, dtype: torch.dtype, rep: int = 0) -> torch.Tensor:
    """Small integers depending on rank, index and repetition (exact in every dtype)."""
    idx = torch.arange(count, dtype=torch.int64)
    values = (idx * 3 + rank * 5 + rep * 7) % 11 + 1
    return values.to(dtype)


def reference(count: int, dtype: torch.dtype, op: str, rep: int = 0) -> torch.Tensor:
    stack = torch.stack([rank_data(r, count, torch.float64, rep) for r in range(hvd.size())])
    if op == "sum":
        out = stack.sum(0)
    elif op == "min":
        out = stack.min(0).values
    elif op == "max":
        out = stack.max(0).values
    elif op == "prod":
        out = stack.prod(0)
    else:
        out = stack.sum(0) / hvd.size()
    return out


@pytest.mark.parametrize("dtype", INT_DTYPES + FLOAT_DTYPES)
@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_allreduce_sum_every_dtype(dtype, count):
    for rep in range(2):
        x = rank_data(hvd.rank(), count, dtype, rep)
        out = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}.{count}")
        expect = reference(count, dtype, "sum", rep)
        if dtype in (torch.uint8, torch.int8):   # wraps like the dtype does
            expect = expect.to(torch.int64).to(dtype)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out.to(torch.float64), expect.to(dtype).to(torch.float64))
        assert torch.equal(x, rank_data(hvd.rank(), count, dtype, rep))  # input untouched


@pytest.mark.parametrize("op,name", [(hvd.Min, "min"), (hvd.Max, "max"), (hvd.Average, "avg")])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.float64, torch.bfloat16])
def test_allreduce_ops(op, name, dtype):
    x = rank_data(hvd.rank(), 33, dtype)
    out = hvd.allreduce(x, op=op)
    expect = reference(33, dtype, name)
    if name == "avg" and not dtype.is_floating_point:
        expect = torch.trunc(expect)
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(dtype, 1e-12)
    assert torch.allclose(out.to(torch.float64), expect, rtol=tol, atol=tol)


def test_bool_min_max_are_logical_and_or():
    for rep in range(2):
        x = torch.tensor([True, hvd.rank() % 2 == 0, False, hvd.rank() == 0])
        assert torch.equal(hvd.allreduce(x, op=hvd.Max),
                           torch.tensor([True, True, False, True]))
        assert torch.equal(hvd.allreduce(x, op=hvd.Min),
                           torch.tensor([True, hvd.size() == 1, False, hvd.size() == 1]))


def test_allreduce_product_and_deprecated_average():
    x = torch.full((5,), 2.0) if hvd.rank() % 2 else torch.full((5,), 3.0)
    prod = hvd.allreduce(x, op=hvd.Product)
    assert torch.equal(prod, reference(5, torch.float64, "prod").new_full(
        (5,), float(torch.tensor([2.0 if r % 2 else 3.0 for r in range(hvd.size())]).prod())
    ).float())
    summed = hvd.allreduce(torch.ones(3), average=False)
    assert torch.equal(summed, torch.full((3,), float(hvd.size())))
    averaged = hvd.allreduce(torch.ones(3), average=True)
    assert torch.equal(averaged, torch.ones(3))


def test_allreduce_in_place_async_poll_and_scaling():
    for rep in range(2):
        x = rank_data(hvd.rank(), 50, torch.float32, rep)
        handle = hvd.allreduce_async_(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        out = hvd.synchronize(handle)
        assert out is x
        assert torch.equal(x.double(), reference(50, torch.float32, "sum", rep))
        h = hvd.allreduce_async(torch.ones(4), name="async.poll")
        while not hvd.poll(h):
            pass
        assert torch.equal(hvd.synchronize(h), torch.ones(4))
        assert hvd.synchronize(h) is None   # released: None, as Horovod's
        with pytest.raises(ValueError):
            hvd.poll(h)


def test_allreduce_non_contiguous_in_place():
    base = torch.zeros(6, 4)
    view = base[:, 1]                     # non-contiguous
    view.copy_(rank_data(hvd.rank(), 6, torch.float32))
    hvd.allreduce_(view, op=hvd.Sum)
    assert torch.equal(base[:, 1].double(), reference(6, torch.float32, "sum"))
    assert torch.equal(base[:, 0], torch.zeros(6))


def test_names_submitted_in_different_orders_fuse_and_agree():
    names = [f"order.{i}" for i in range(12)]
    order = names if hvd.rank() % 2 == 0 else names[::-1]
    tensors = {n: rank_data(hvd.rank(), 3 + i, torch.float32) * (i + 1)
               for i, n in enumerate(names)}
    handles = {n: hvd.allreduce_async(tensors[n], name=n, op=hvd.Sum) for n in order}
    for i, n in enumerate(names):
        out = hvd.synchronize(handles[n])
        assert torch.equal(out.double(), reference(3 + i, torch.float32, "sum") * (i + 1))


def test_fusion_threshold_and_algorithm_from_environment(monkeypatch):
    monkeypatch.setenv("MPICOLL_FUSION_THRESHOLD", "64")
    monkeypatch.setenv("MPICOLL_ALLREDUCE_ALGORITHM", "ring")
    hvd.shutdown()
    hvd.init()
    try:
        from mpicoll.torch.state import engine

        assert engine().settings.fusion_threshold == 64
        assert engine().settings.algorithm == "ring"
        hs = [hvd.allreduce_async(rank_data(hvd.rank(), 10 + i, torch.float64), op=hvd.Sum)
              for i in range(8)]
        for i, h in enumerate(hs):
            assert torch.equal(hvd.synchronize(h), reference(10 + i, torch.float64, "sum"))
    finally:
        monkeypatch.delenv("MPICOLL_FUSION_THRESHOLD")
        monkeypatch.delenv("MPICOLL_ALLREDUCE_ALGORITHM")
        hvd.shutdown()
        hvd.init()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.float16, torch.bfloat16,
                                   torch.float32, torch.bool])
def test_allgather_variable_first_dimension(dtype):
    for rep in range(2):
        rows = (hvd.rank() + rep) % 3            # 0, 1 or 2 rows; some ranks send none
        x = rank_data(hvd.rank(), rows * 4, torch.int64, rep).view(rows, 2, 2).to(dtype)
        out = hvd.allgather(x)
        parts = [rank_data(r, ((r + rep) % 3) * 4, torch.int64, rep).view(-1, 2, 2).to(dtype)
                 for r in range(hvd.size())]
        assert torch.equal(out, torch.cat(parts))


def test_allgather_equal_sizes_async():
    x = torch.full((2, 3), float(hvd.rank()))
    out = hvd.synchronize(hvd.allgather_async(x))
    assert torch.equal(out, torch.cat([torch.full((2, 3), float(r)) for r in range(hvd.size())]))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.bool])
def test_broadcast_from_every_root(dtype):
    for root in range(hvd.size()):
        x = rank_data(hvd.rank(), 9, torch.int64).to(dtype)
        out = hvd.broadcast(x, root_rank=root)
        assert torch.equal(out, rank_data(root, 9, torch.int64).to(dtype))
        assert torch.equal(x, rank_data(hvd.rank(), 9, torch.int64).to(dtype))
        hvd.broadcast_(x, root_rank=root)
        assert torch.equal(x, rank_data(root, 9, torch.int64).to(dtype))


def test_broadcast_into_a_non_contiguous_view():
    """``broadcast_`` of a strided view writes the root's values into the view (through a
    contiguous copy) and leaves the rest of its base alone."""
    root = hvd.size() - 1
    base = torch.zeros(5, 3)
    view = base[:, 2]
    view.copy_(rank_data(hvd.rank(), 5, torch.float32))
    hvd.broadcast_(view, root_rank=root)
    assert torch.equal(base[:, 2], rank_data(root, 5, torch.float32))
    assert torch.equal(base[:, :2], torch.zeros(5, 2))


def test_objects_and_barrier():
    gathered = hvd.allgather_object({"rank": hvd.rank(), "pad": "x" * hvd.rank()})
    assert gathered == [{"rank": r, "pad": "x" * r} for r in range(hvd.size())]
    root = hvd.size() - 1
    assert hvd.broadcast_object(("hello", hvd.rank()), root_rank=root) == ("hello", root)
    hvd.barrier()
    hvd.barrier()


def test_an_object_one_rank_cannot_pickle_fails_every_rank_in_step():
    """broadcast_object / allgather_object of an object the root (one rank) cannot pickle:
    its pickling error there, RemoteError naming it elsewhere, and the ranks stay in step
    (the failing rank skipped the first broadcast, and every later named operation then
    failed as 'can never complete')."""
    last = hvd.size() - 1
    bad = (lambda: 1) if hvd.rank() == last else hvd.rank()   # (a lambda: unpicklable)
    for call in (lambda: hvd.broadcast_object(bad, root_rank=last, name="unpicklable.b"),
                 lambda: hvd.allgather_object(bad, name="unpicklable.g")):
        with pytest.raises((AttributeError, pickle.PicklingError) if hvd.rank() == last
                           else mpicoll.RemoteError, match="pickle"):
            call()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.unpicklable").tolist() \
        == [hvd.size()] * 2


def test_layout_queries():
    assert 0 <= hvd.rank() < hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert hvd.cross_size() * hvd.local_size() >= hvd.size() or hvd.cross_size() >= 1
    assert hvd.is_initialized() and hvd.mpi_threads_supported()
    hvd.init()  # repeatable


def test_many_requests_in_one_round_overflow_the_negotiation_record():
    # ~200 requests with long names: more than the 4 KiB carried inline per round.
    names = [f"many.requests.with.a.rather.long.name.{i:04d}" for i in range(200)]
    order = names if hvd.rank() % 2 == 0 else names[::-1]
    handles = {n: hvd.allreduce_async(torch.full((2,), float(i)), name=n, op=hvd.Sum)
               for i, n in ((names.index(n), n) for n in order)}
    for i, n in enumerate(names):
        assert torch.equal(hvd.synchronize(handles[n]), torch.full((2,), float(i * hvd.size())))
