"""Where Horovod's exact behaviour is easy to miss (issue 10): scaling factors on integer
and float16 tensors, and integer Average rounding toward zero.

References are computed here from every rank's known data with Python integers and
floats (Horovod scales integer tensors in float64 and casts back toward zero, float16 in
float32), not with the adapter's code path.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

#: Signed data in -10..10 (uint8: 0..20); scaled by at most 2.5 and summed over 4 ranks it
#: stays inside every dtype tested.
SCALED_INT_DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64]
FACTORS = [(2.5, 1.0), (1.0, 0.5), (1.5, 1 / 3), (0.7, 2.5)]


def int_data(rank: int, count: int, dtype: torch.dtype, rep: int) -> list[int]:
    """Rank-, index- and repetition-dependent integers."""
    values = [(i * 7 + rank * 13 + rep * 5) % 21 - 10 for i in range(count)]
    return [v + 10 for v in values] if dtype is torch.uint8 else values


def horovod_int_reference(count: int, dtype: torch.dtype, op: int, pre: float, post: float,
                          rep: int) -> list[int]:
    """Prescale each rank's data in float64 (cast back toward zero), sum, then postscale
    (divided by size for Average) in float64, cast back toward zero."""
    n = hvd.size()
    sums = [0] * count
    for r in range(n):
        for i, v in enumerate(int_data(r, count, dtype, rep)):
            sums[i] += math.trunc(v * pre)
    factor = post / n if op == int(hvd.Average) else post
    return [math.trunc(s * factor) for s in sums]


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@pytest.mark.parametrize("pre,post", FACTORS)
@pytest.mark.parametrize("dtype", SCALED_INT_DTYPES)
def test_scaling_factors_on_integer_tensors(dtype, pre, post, op):
    count = 13
    for rep in range(2):
        x = torch.tensor(int_data(hvd.rank(), count, dtype, rep), dtype=dtype)
        expect = horovod_int_reference(count, dtype, int(op), pre, post, rep)
        out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                            name=f"iscale.{dtype}.{pre}.{post}.{int(op)}")
        assert out.dtype == dtype and out.tolist() == expect
        assert x.tolist() == int_data(hvd.rank(), count, dtype, rep)      # input untouched
        y = x.clone()
        hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post)
        assert y.tolist() == expect


def test_scaling_factors_on_fused_integer_tensors():
    # Several requests in one round: reduced through the fusion buffer.
    pre, post, op = 2.5, 1 / 3, hvd.Average
    for rep in range(2):
        counts = [1, 5, 0, 17]
        tensors = [torch.tensor(int_data(hvd.rank(), c, torch.int32, rep + k),
                                dtype=torch.int32) for k, c in enumerate(counts)]
        handles = [hvd.allreduce_async(t, op=op, prescale_factor=pre, postscale_factor=post,
                                       name=f"ifused.{k}") for k, t in enumerate(tensors)]
        for k, (c, h) in enumerate(zip(counts, handles)):
            expect = horovod_int_reference(c, torch.int32, int(op), pre, post, rep + k)
            assert hvd.synchronize(h).tolist() == expect


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_scaling_factors_on_float16_use_float32(op):
    # Horovod scales float16 in float32 (one rounding to float16). Prescaled values and
    # their sums are exact in float16 here; the postscale factor 1/3 rounds.
    n = hvd.size()
    pre, post = 2.5, 1 / 3
    count = 11
    for rep in range(2):
        x = torch.tensor(int_data(hvd.rank(), count, torch.int32, rep), dtype=torch.float16)
        out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
        sums = np.zeros(count, dtype=np.float32)
        for r in range(n):
            sums += np.float32(pre) * np.array(int_data(r, count, torch.int32, rep),
                                               dtype=np.float32)
        factor = np.float32(post / n if op == hvd.Average else post)
        expect = torch.from_numpy((sums * factor).astype(np.float16))
        assert out.dtype == torch.float16 and torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_average_rounds_toward_zero(dtype):
    n, me = hvd.size(), hvd.rank()
    for rep in range(2):
        # on rank 0 only: -75 / n toward zero is -37 at n = 2 (floor: -38); -76 / 3 is -25
        # (floor: -26); +-1 / n is 0 (floor of -1/n: -1)
        ones = [-75, 75, -76, 76, -1, 1]
        single = hvd.allreduce(torch.tensor(ones if me == 0 else [0] * len(ones),
                                            dtype=dtype), name=f"avg75.{dtype}")
        assert single.tolist() == [abs(v) // n * (1 if v >= 0 else -1) for v in ones]
        values = [(i * 5 + me * 4 + rep) % 9 - 6 for i in range(10)]     # mostly negative
        out = hvd.allreduce(torch.tensor(values, dtype=dtype), op=hvd.Average)
        sums = [sum((i * 5 + r * 4 + rep) % 9 - 6 for r in range(n)) for i in range(10)]
        expect = [abs(s) // n * (1 if s >= 0 else -1) for s in sums]
        assert out.dtype == dtype and out.tolist() == expect
