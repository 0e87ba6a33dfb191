"""op=hvd.Adasum (issue 10): Horovod's pairwise adaptive summation against a numpy replay
of its tree, and its error cases on every rank.

The reference combines every rank's known data in Horovod's order (level 1, 2, 4, ...:
ranks ``[j, j+l)`` with ``[j+l, j+2l)``), per tensor, with the coefficients written out
here independently of the library, rounding to the tensor's dtype after each level as
Horovod does. The library sums each dot product from per-rank slices (a different
summation order), so float64 agrees to a relative 1e-12, float32 to a few ulps.

Each test runs all its collectives before its first assertion.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

GUARD = np.sqrt(np.finfo(np.float64).tiny)          # Horovod 0.28's zero-norm guard


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b in float64 (coefficient 1 when a
    squared norm is below the guard)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot = float(np.sum(a64 * b64))
    na, nb = float(np.sum(a64 * a64)), float(np.sum(b64 * b64))
    ca = 1.0 - dot / (2.0 * na) if na >= GUARD else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= GUARD else 1.0
    return ca * a64 + cb * b64


def tree(vectors: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Horovod's tree over the ranks' vectors of one tensor."""
    results = [v.astype(dtype) for v in vectors]
    level = 1
    while level < len(results):
        for j in range(0, len(results), 2 * level):
            results[j] = combine(results[j], results[j + level]).astype(dtype)
        level *= 2
    return results[0]


COUNTS = (1, 5, 17, 40)


def data(rank: int, index: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Rank- and tensor-dependent values; tensor 0 is zero on rank 0 and tensor 1 tiny
    (squared norm below the guard) on rank 1, in float64."""
    rng = np.random.default_rng(1000 + 31 * rank + index)
    values = rng.normal(0.0, 1.0 + rank, count)
    if index == 0 and rank == 0:
        values[:] = 0.0
    if index == 1 and rank == 1 and dtype == np.float64:
        values *= 1e-80
    return values.astype(dtype)


def _tensors(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return [torch.from_numpy(data(rank, i, c, np_dtype)) for i, c in enumerate(COUNTS)]


def _expected(n: int, dtype: torch.dtype, scale: float = 1.0) -> list[np.ndarray]:
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return [tree([data(r, i, c, np_dtype) * np_dtype.type(scale) for r in range(n)], np_dtype)
            for i, c in enumerate(COUNTS)]


TOLERANCE = {torch.float64: {"rtol": 1e-12, "atol": 1e-290},
             torch.float32: {"rtol": 1e-6, "atol": 1e-6}}


def test_adasum_matches_numpy_tree():
    """Fused async requests (per-tensor coefficients in one buffer), a grouped all-reduce,
    scaling factors, autograd, identical bits on every rank, and Horovod's documented
    properties (orthogonal vectors add, equal vectors average)."""
    n, me = hvd.size(), hvd.rank()
    if n & (n - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    got = {}
    for dtype in (torch.float64, torch.float32):
        handles = [hvd.allreduce_async(t, op=hvd.Adasum, name=f"ada.{dtype}.{i}")
                   for i, t in enumerate(_tensors(me, dtype))]
        got[dtype, "async"] = [hvd.synchronize(h) for h in handles]
        got[dtype, "grouped"] = hvd.grouped_allreduce(_tensors(me, dtype), op=hvd.Adasum)
    scaled = [hvd.allreduce(t, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
              for t in _tensors(me, torch.float64)]
    x = torch.zeros(COUNTS[-1], dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, op=hvd.Adasum).backward(_tensors(me, torch.float64)[-1])
    inplace = _tensors(me, torch.float64)[2]
    hvd.allreduce_(inplace, op=hvd.Adasum)
    orthogonal = hvd.allreduce(torch.eye(n, dtype=torch.float64)[me] * (me + 1),
                               op=hvd.Adasum)
    equal = hvd.allreduce(torch.arange(6, dtype=torch.float64) - 2.5, op=hvd.Adasum)
    everywhere = hvd.allgather(torch.cat([t.view(1, -1) for t in got[torch.float64, "async"]],
                                         dim=1))

    for dtype in (torch.float64, torch.float32):
        expected = _expected(n, dtype)
        for form in ("async", "grouped"):
            for i, (out, ref) in enumerate(zip(got[dtype, form], expected)):
                assert out.dtype is dtype
                np.testing.assert_allclose(out.numpy(), ref, **TOLERANCE[dtype],
                                           err_msg=f"{dtype} {form} tensor {i}")
    for out, ref in zip(scaled, _expected(n, torch.float64, 0.5)):
        np.testing.assert_allclose(out.numpy(), 3.0 * ref, **TOLERANCE[torch.float64])
    np.testing.assert_allclose(x.grad.numpy(), _expected(n, torch.float64)[-1],
                               **TOLERANCE[torch.float64])
    np.testing.assert_allclose(inplace.numpy(), _expected(n, torch.float64)[2],
                               **TOLERANCE[torch.float64])
    np.testing.assert_allclose(orthogonal.numpy(), np.arange(1, n + 1), rtol=1e-15)
    np.testing.assert_allclose(equal.numpy(), np.arange(6) - 2.5, rtol=1e-15)
    assert all(torch.equal(row, everywhere[0]) for row in everywhere), \
        "ranks hold different bits"


def test_adasum_errors_on_every_rank(caplog):
    """Integer tensors (TypeError, locally); a number of ranks that is not a power of two
    (Horovod's error, both a ValueError and a NotImplementedError, raised by the call as
    Horovod's are, grouped or not: the grouped one failed in the engine, which logged its
    traceback); DistributedOptimizer(op=Adasum) (not implemented). The engine keeps
    working afterwards."""
    n = hvd.size()
    with pytest.raises(TypeError, match="Adasum"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(TypeError, match="Adasum"):
        hvd.grouped_allreduce([torch.ones(2), torch.ones(2, dtype=torch.int64)],
                              op=hvd.Adasum)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), op=hvd.Adasum)
    if n & (n - 1):
        with pytest.raises(ValueError, match="power of 2") as info:
            hvd.allreduce(torch.ones(3), op=hvd.Adasum)
        assert isinstance(info.value, NotImplementedError)
        with caplog.at_level("ERROR", logger="mpicoll"):
            with pytest.raises(NotImplementedError, match="power of 2"):
                hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], op=hvd.Adasum)
            with pytest.raises(NotImplementedError, match="power of 2"):
                hvd.grouped_allreduce_([torch.ones(2), torch.ones(3)], op=hvd.Adasum)
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="adasum.after_errors")
    assert torch.equal(total, torch.full((2,), float(n)))


def test_adasum_in_a_process_set_of_two():
    """At 3 ranks (not a power of two) a process set of 2 runs Adasum; the third rank
    takes no part."""
    me = hvd.rank()
    if hvd.size() != 3:
        pytest.skip("runs at 3 ranks")
    pair = hvd.add_process_set([0, 2])
    out = None
    if me in (0, 2):
        out = hvd.allreduce(_tensors(me, torch.float64)[3], op=hvd.Adasum, process_set=pair,
                            name="adasum.pair")
    hvd.remove_process_set(pair)
    if out is not None:
        np.testing.assert_allclose(out.numpy(), tree([data(0, 3, 40, np.float64),
                                                      data(2, 3, 40, np.float64)],
                                                     np.float64),
                                   **TOLERANCE[torch.float64])
