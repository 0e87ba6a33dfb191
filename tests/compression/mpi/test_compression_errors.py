"""Bad input to the compressed all-reduce: clear errors on every rank, never a hang."""
from __future__ import annotations

import re

import numpy as np
import pytest

from mpicoll import MismatchError, RemoteError
from mpicoll.compression import ErrorFeedback, allgather, allreduce, reduce_scatter

from compression_cases import RANK, SIZE, gather

pytestmark = pytest.mark.mpi

X = np.arange(8, dtype=np.float32)

BAD = [
    (lambda c: allreduce(X, compression="zstd", check=c), ValueError, "unknown compression='zstd'"),
    (lambda c: allreduce(X, compression="topk:1.5", check=c), ValueError, "ratio must be in (0, 1]"),
    (lambda c: allreduce(X, compression="randomk:0", check=c), ValueError,
     "ratio must be in (0, 1]"),
    (lambda c: allreduce(np.arange(8), compression="int8", check=c), TypeError,
     "sendbuf has dtype int64; compression='int8' needs float32 or float64"),
    (lambda c: allreduce(X.astype(np.float16), compression="fp16", check=c), TypeError,
     "sendbuf has dtype float16"),
    (lambda c: allreduce(X, op="prod", check=c), ValueError, "unknown op='prod'"),
    (lambda c: allreduce(X, np.empty(9, np.float32), check=c), ValueError, "recvbuf has 9"),
    (lambda c: allreduce(X, layout="ring", check=c), ValueError,
     "unknown layout='ring'; choose 'auto', 'flat' or 'node'"),
    (lambda c: allreduce(X, layout=None, check=c), TypeError,
     "layout must be 'auto', 'flat' or 'node', not NoneType"),
]


def still_works():
    x = np.full(5, RANK + 1.0, np.float32)
    out = allreduce(x, compression="none")
    assert np.array_equal(out, np.full(5, SIZE * (SIZE + 1) / 2, np.float32))


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("call,exc,words", BAD)
def test_same_bad_argument_on_every_rank(call, exc, words, check):
    with pytest.raises(exc) as info:
        call(check)
    assert words in str(info.value), str(info.value)
    still_works()


@pytest.mark.parametrize("call,exc,words", BAD)
def test_bad_argument_on_one_rank_only(call, exc, words):
    bad_rank = SIZE - 1
    if RANK == bad_rank:
        with pytest.raises(exc) as info:
            call(True)
        assert words in str(info.value)
    else:
        with pytest.raises(RemoteError) as info:
            allreduce(X, compression="int8", check=True)
        assert f"rank {bad_rank}" in str(info.value) and words in str(info.value)
    still_works()


def test_ranks_disagreeing_on_the_codec_all_raise():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    spec = "int8" if RANK == 0 else "onebit"
    with pytest.raises(MismatchError) as info:
        allreduce(X, compression=spec)
    assert "algorithm" in str(info.value) and "int8" in str(info.value)
    still_works()


def test_ranks_disagreeing_on_the_layout_all_raise():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    layout = "flat" if RANK == 0 else "node"
    with pytest.raises(MismatchError) as info:
        allreduce(X, compression="int8", layout=layout)
    assert "layout=flat" in str(info.value) and "layout=node" in str(info.value)
    still_works()


def test_ranks_disagreeing_on_count_all_raise():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    x = np.zeros(8 + (RANK == 0), np.float32)
    with pytest.raises(MismatchError, match="count"):
        allreduce(x, compression="fp16")
    verdict = gather("ok")
    assert verdict == ["ok"] * SIZE


def test_stale_residual_on_one_rank_is_caught_before_sending():
    fb = ErrorFeedback()
    fb.store("w", np.zeros(8 if RANK else 5, np.float32))  # rank 0 holds a stale residual
    if RANK == 0:
        with pytest.raises(ValueError, match="residual stored for key='w' has 5"):
            allreduce(X, compression="int8", feedback=fb, key="w")
    else:
        with pytest.raises(RemoteError, match="rank 0"):
            allreduce(X, compression="int8", feedback=fb, key="w")
    still_works()


def test_layout_passes_through_mpicoll_allreduce():
    import mpicoll  # noqa: PLC0415

    x = np.arange(1, 41, dtype=np.float32) * (RANK + 1) / 7
    for layout in ("flat", "node"):
        got = mpicoll.allreduce(x, compression="int8", layout=layout,
                                feedback=ErrorFeedback())
        want = allreduce(x, compression="int8", layout=layout, feedback=ErrorFeedback())
        assert np.array_equal(got, want), layout
    with pytest.raises(ValueError, match="layout='node' applies only with compression="):
        mpicoll.allreduce(x, layout="node")
    still_works()


# the compressed reduce-scatter and all-gather: (bad call, error, words, a good call of the
# same collective for the other ranks)
def _rs(c, **kw):
    return reduce_scatter(kw.pop("x", X), compression=kw.pop("compression", "int8"), check=c,
                          **kw)


def _ag(c, **kw):
    return allgather(kw.pop("x", X), compression=kw.pop("compression", "fp16"), check=c, **kw)


BAD_SCATTER_GATHER = [
    (lambda c: _rs(c, compression="zstd"), ValueError, "unknown compression='zstd'", _rs),
    (lambda c: _rs(c, x=np.arange(8)), TypeError,
     "sendbuf has dtype int64; compression='int8' needs float32 or float64", _rs),
    (lambda c: _rs(c, recvbuf=np.empty(9, np.float32)), ValueError, "recvbuf has 9 elements",
     _rs),
    (lambda c: _rs(c, op="max"), ValueError, "unknown op='max'", _rs),
    (lambda c: _ag(c, compression="topk:0"), ValueError, "ratio must be in (0, 1]", _ag),
    (lambda c: _ag(c, x=np.arange(8, dtype=np.int32)), TypeError,
     "sendbuf has dtype int32; compression='fp16' needs float32 or float64", _ag),
    (lambda c: _ag(c, recvbuf=np.empty(8 * SIZE + 1, np.float32)), ValueError,
     f"recvbuf has {8 * SIZE + 1} elements", _ag),
]


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("call,exc,words,good", BAD_SCATTER_GATHER)
def test_scatter_gather_bad_argument_on_every_rank(call, exc, words, good, check):
    with pytest.raises(exc) as info:
        call(check)
    assert words in str(info.value), str(info.value)
    still_works()


@pytest.mark.parametrize("call,exc,words,good", BAD_SCATTER_GATHER)
def test_scatter_gather_bad_argument_on_one_rank_only(call, exc, words, good):
    bad_rank = SIZE - 1
    if RANK == bad_rank:
        with pytest.raises(exc, match=re.escape(words)):
            call(True)
    else:
        with pytest.raises(RemoteError) as info:
            good(True)
        assert f"rank {bad_rank}" in str(info.value) and words in str(info.value)
    still_works()


def test_scatter_gather_ranks_disagreeing_on_the_codec_all_raise():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(MismatchError, match="algorithm"):
        reduce_scatter(X, compression="int8" if RANK == 0 else "bf16")
    with pytest.raises(MismatchError, match="count"):
        allgather(X[:7 + (RANK == 0)], compression="fp16")
    still_works()


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_pass_through_algorithm_on_one_rank_and_codecs_none_against_int8(collective):
    """``mpicoll.<collective>(..., compression=...)``: an ``algorithm=`` on one rank raised
    there only, before the agreement the others waited in; ``"none"`` on one rank and a
    codec on another ran an unchecked collective beside an agreement: both hung."""
    import mpicoll

    if SIZE == 1:
        pytest.skip("needs two ranks")
    fn = getattr(mpicoll, collective)
    x = np.arange(SIZE * 3, dtype=np.float32) + RANK
    if RANK == SIZE - 1:
        with pytest.raises(ValueError, match="algorithm='ring' does not apply"):
            fn(x, compression="int8", algorithm="ring")
    else:
        with pytest.raises(RemoteError, match=f"rank {SIZE - 1}.*algorithm='ring'"):
            fn(x, compression="int8")
    with pytest.raises(MismatchError, match="ranks disagree"):
        fn(x, compression="none" if RANK == 0 else "int8")
    still_works()
