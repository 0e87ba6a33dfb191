"""Grouped collectives (issue 10): values against references from every rank's known
data, the group failing as a whole on every rank, and autograd against a single-process
replay of all ranks.

Each test runs all its collectives before its first assertion (see
test_torch_scatter_ops.py).
"""
from __future__ import annotations

import math

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

SHAPES = [((5,), torch.float32), ((2, 3), torch.int64), ((1,), torch.bfloat16),
          ((0, 4), torch.float64), ((3, 1, 2), torch.int32)]


def data(rank: int, shape: tuple, dtype: torch.dtype, rep: int, k: int = 0) -> torch.Tensor:
    count = math.prod(shape)
    values = (torch.arange(count) * 5 + rank * 11 + rep * 3 + k * 7) % 19 - 9
    return values.to(dtype).view(shape)


def total(shape: tuple, rep: int, k: int, size: int) -> torch.Tensor:
    return sum(data(r, shape, torch.float64, rep, k) for r in range(size))


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_grouped_allreduce_every_form(op):
    n, me = hvd.size(), hvd.rank()
    got = []
    for rep in range(2):
        xs = [data(me, s, d, rep, k) for k, (s, d) in enumerate(SHAPES)]
        got.append(("new", rep, hvd.grouped_allreduce(xs, op=op, name=f"g.{int(op)}"),
                    xs))
        got.append(("async", rep, hvd.synchronize(hvd.grouped_allreduce_async(xs, op=op)),
                    xs))
        ys = [x.clone() for x in xs]
        base = torch.zeros(5, 2)
        base[:, 1] = data(me, (5,), torch.float32, rep, 0)
        ys[0] = base[:, 1]                                    # a non-contiguous member
        returned = hvd.grouped_allreduce_(ys, op=op)
        got.append(("inplace", rep, returned, ys))
        zs = [x.clone() for x in xs]
        got.append(("async_", rep, hvd.synchronize(hvd.grouped_allreduce_async_(zs, op=op)),
                    zs))
    for form, rep, outs, inputs in got:
        assert len(outs) == len(SHAPES)
        for k, ((shape, dtype), out) in enumerate(zip(SHAPES, outs)):
            expect = total(shape, rep, k, n)
            if op == hvd.Average:
                expect = expect / n if dtype.is_floating_point else torch.trunc(expect / n)
            tol = 2e-2 if dtype is torch.bfloat16 else 1e-6
            assert out.dtype == dtype and out.shape == shape, (form, k)
            assert torch.allclose(out.double(), expect, rtol=tol, atol=tol), (form, k)
            if form in ("inplace", "async_"):
                assert out is inputs[k] or out.data_ptr() == inputs[k].data_ptr()
            else:
                assert torch.equal(inputs[k], data(me, shape, dtype, rep, k))


def test_group_fails_as_a_whole_on_every_rank():
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    outcomes = []
    cases = [("members", [torch.ones(2)] * (2 if me == 0 else 3)),
             ("member 1", [torch.ones(2), torch.ones(3 + me), torch.ones(4)])]
    for words, tensors in cases:
        try:
            hvd.grouped_allreduce(tensors, name=f"whole.{words}")
            outcomes.append((words, None))
        except hvd.MismatchError as exc:
            outcomes.append((words, str(exc)))
    try:
        hvd.grouped_reducescatter([torch.ones(n, 2), torch.ones(n, 2)],
                                  op=hvd.Sum if me else hvd.Average, name="whole.rs")
        outcomes.append(("op", None))
    except hvd.MismatchError as exc:
        outcomes.append(("op", str(exc)))
    after = hvd.grouped_allreduce([torch.ones(2), torch.ones(1)], op=hvd.Sum)
    for words, message in outcomes:
        assert message is not None and words in message, (words, message)
    assert [t.tolist() for t in after] == [[float(n)] * 2, [float(n)]]


def test_grouped_bad_arguments_are_local():
    with pytest.raises(TypeError, match="list or tuple"):
        hvd.grouped_allreduce(torch.ones(2))
    with pytest.raises(ValueError, match="at least one tensor"):
        hvd.grouped_allgather([])
    with pytest.raises(TypeError, match="does not apply"):
        hvd.grouped_allreduce_async([torch.ones(2), torch.ones(2, dtype=torch.bool)],
                                    op=hvd.Sum)
    with pytest.raises(ValueError, match="Average or op=Sum"):
        hvd.grouped_reducescatter([torch.ones(2)], op=hvd.Min)
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.grouped_allgather([torch.ones(2), torch.tensor(1.0)])
    hvd.barrier()                           # nothing was sent: the next op is not blocked


def test_grouped_allgather_and_reducescatter_values():
    n, me = hvd.size(), hvd.rank()
    got = []
    for rep in range(2):
        parts = [data(me, ((me + rep + k) % 3, 2 + k), torch.int64, rep, k) for k in range(3)]
        got.append(("ag", rep, hvd.grouped_allgather(parts)))
        got.append(("ag_async", rep, hvd.synchronize(hvd.grouped_allgather_async(parts))))
        blocks = [data(me, (rows, 2), torch.float64, rep, k)
                  for k, rows in enumerate((1, n + 1, 2 * n + 3))]
        got.append(("rs", rep, hvd.grouped_reducescatter(blocks, op=hvd.Sum)))
        got.append(("rs_async", rep, hvd.synchronize(hvd.grouped_reducescatter_async(
            blocks, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5))))
    for kind, rep, outs in got:
        for k, out in enumerate(outs):
            if kind.startswith("ag"):
                expect = torch.cat([data(r, ((r + rep + k) % 3, 2 + k), torch.int64, rep, k)
                                    for r in range(n)])
                assert torch.equal(out, expect), (kind, k)
            else:
                rows = (1, n + 1, 2 * n + 3)[k]
                full = total((rows, 2), rep, k, n) / (1 if kind == "rs" else n)
                counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
                start = sum(counts[:me])
                assert torch.allclose(out, full[start:start + counts[me]], rtol=1e-12,
                                      atol=0), (kind, k)


def _replay(size: int, me: int, kind: str, op: int) -> list[torch.Tensor]:
    """All ranks' forward and sum of losses in one process; rank ``me``'s input grads."""
    shapes = [(3, 2), (2 * size + 1, 3)]
    xs = [[(data(r, s, torch.float64, 0, k) / 3).requires_grad_() for k, s in
           enumerate(shapes)] for r in range(size)]
    loss = torch.zeros((), dtype=torch.float64)
    for k in range(len(shapes)):
        if kind == "allreduce":
            y = sum(xs[r][k] for r in range(size)) / (size if op == int(hvd.Average) else 1)
            outs = [y] * size
        elif kind == "allgather":
            outs = [torch.cat([xs[r][k] for r in range(size)])] * size
        else:
            y = sum(xs[r][k] for r in range(size)) / (size if op == int(hvd.Average) else 1)
            rows = shapes[k][0]
            counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
            outs = [y[sum(counts[:d]):sum(counts[:d + 1])] for d in range(size)]
        for dst, out in enumerate(outs):
            weights = torch.arange(out.numel(), dtype=torch.float64).view_as(out) + dst + k
            loss = loss + (out * out * weights).sum()
    loss.backward()
    return [x.grad for x in xs[me]]


@pytest.mark.parametrize("kind,op", [("allreduce", hvd.Sum), ("allreduce", hvd.Average),
                                     ("allgather", None), ("reducescatter", hvd.Sum),
                                     ("reducescatter", hvd.Average)])
def test_grouped_gradients_against_single_process_replay(kind, op):
    # Horovod's rules: grouped all-reduce backward is the same grouped all-reduce (the
    # replay's gradient exactly); grouped all-gather averages the incoming gradients
    # (replay / size); grouped reduce-scatter scales by size for Sum and all-gathers
    # (size x replay, for both ops).
    n, me = hvd.size(), hvd.rank()
    shapes = [(3, 2), (2 * n + 1, 3)]
    grads = []
    for _rep in range(2):               # twice: stale plans or caches would show
        xs = [(data(me, s, torch.float64, 0, k) / 3).requires_grad_()
              for k, s in enumerate(shapes)]
        if kind == "allreduce":
            outs = hvd.grouped_allreduce(xs, op=op)
        elif kind == "allgather":
            outs = hvd.grouped_allgather(xs)
        else:
            outs = hvd.grouped_reducescatter(xs, op=op)
        loss = sum(((out * out * (torch.arange(out.numel(), dtype=torch.float64)
                                  .view_as(out) + me + k)).sum()) for k, out in enumerate(outs))
        loss.backward()
        grads.append([x.grad for x in xs])
    scale = {"allreduce": 1.0, "allgather": 1.0 / n, "reducescatter": float(n)}[kind]
    expect = [g * scale for g in _replay(n, me, kind, int(op) if op is not None else -1)]
    for rep_grads in grads:
        for got, want in zip(rep_grads, expect):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
