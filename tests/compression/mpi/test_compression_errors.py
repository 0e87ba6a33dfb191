"""Bad input to the compressed all-reduce: clear errors on every rank, never a hang."""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll import MismatchError, RemoteError
from mpicoll.compression import ErrorFeedback, allreduce

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
