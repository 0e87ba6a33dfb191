"""The compressed all-reduce in a one-rank world (no mpirun): API, stats, errors."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.compression import ErrorFeedback, allreduce, get_codec, last_stats

SELF = MPI.COMM_SELF


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "onebit", "topk:0.2",
                                  "randomk:0.5"])
def test_one_rank_is_one_roundtrip_with_feedback(spec):
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    fb = ErrorFeedback()
    out = allreduce(x, comm=SELF, compression=spec, feedback=fb, key="x")
    assert out.shape == x.shape and out.dtype == x.dtype
    codec = get_codec(spec)
    if not spec.startswith("randomk"):
        assert np.array_equal(out.reshape(-1), codec.roundtrip(x.reshape(-1)))
    res = fb.residual("x")
    np.testing.assert_allclose(out.reshape(-1) + res, x.reshape(-1), atol=1e-5)
    stats = last_stats()
    assert stats.bytes_sent == 0 and stats.count == 35 and stats.codec == codec.name


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.2"])
def test_one_rank_layouts_agree(spec):
    """One rank: ``auto`` is flat, and the node layout (one node of one rank) makes the
    same single encoding; both report no bytes."""
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    outs = {}
    for layout in ["auto", "flat", "node"]:
        fb = ErrorFeedback()
        outs[layout] = allreduce(x, comm=SELF, compression=spec, feedback=fb, layout=layout)
        stats = last_stats()
        assert stats.layout == ("flat" if layout == "auto" else layout)
        assert stats.bytes_sent == stats.intra_node_bytes == stats.inter_node_bytes == 0
    assert outs["auto"].tobytes() == outs["flat"].tobytes() == outs["node"].tobytes()


def test_in_place_average_and_recvbuf():
    x = np.arange(10, dtype=np.float64)
    y = x.copy()
    assert allreduce(None, y, op="average", comm=SELF, compression="fp16") is y
    assert np.array_equal(y, x)
    z = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert allreduce(z, z, comm=SELF, compression="none") is z  # sendbuf is recvbuf: in place
    assert np.array_equal(z.reshape(-1), np.arange(12))
    out = np.empty(10)
    assert allreduce(x, out, comm=SELF, compression="bf16", feedback=False) is out


def test_default_feedback_is_kept_with_the_array():
    x = np.full(300, 0.3, np.float32)
    x[0] = 1.0
    codec = get_codec("onebit")
    out1 = allreduce(x, comm=SELF, compression="onebit")
    out2 = allreduce(x, comm=SELF, compression="onebit")
    assert np.array_equal(out2, codec.roundtrip(x + (x - out1)))
    assert not np.array_equal(out1, out2)
    other = x.copy()  # another array: its own (empty) residual
    assert np.array_equal(allreduce(other, comm=SELF, compression="onebit"), out1)
    off1 = allreduce(other, comm=SELF, compression="onebit", feedback=False)
    assert np.array_equal(off1, out1)


@pytest.mark.parametrize("call,exc,words", [
    (lambda: allreduce(np.zeros(4, np.int32), comm=SELF), TypeError,
     "sendbuf has dtype int32; compression='int8' needs float32 or float64"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, compression="lz4"), ValueError,
     "unknown compression='lz4'"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, compression="topk:2"), ValueError,
     "ratio must be in (0, 1]"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, op="max"), ValueError,
     "unknown op='max'"),
    (lambda: allreduce(np.zeros(4, np.float32), np.zeros(5, np.float32), comm=SELF),
     ValueError, "recvbuf has 5 elements"),
    (lambda: allreduce(np.zeros(4, np.float32), np.zeros(4), comm=SELF), TypeError,
     "recvbuf has dtype float64"),
    (lambda: allreduce(None, comm=SELF), ValueError, "recvbuf is required"),
    (lambda: allreduce(None, np.zeros(4, np.int8), comm=SELF), TypeError,
     "recvbuf has dtype int8"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, feedback="yes"), TypeError,
     "feedback must be"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, segment_bytes=0), ValueError,
     "segment_bytes must be positive"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, segment_bytes="4096"), TypeError,
     "segment_bytes must be an int, not str"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, op=3), TypeError,
     "op must be 'sum' or 'average', not int"),
    (lambda: allreduce([1.0, 2.0], comm=SELF), TypeError, "sendbuf must be a numpy"),
    (lambda: allreduce(np.zeros(4, np.float32), comm="world"), TypeError, "comm must be"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, layout="hierarchical"), ValueError,
     "unknown layout='hierarchical'; choose 'auto', 'flat' or 'node'"),
    (lambda: allreduce(np.zeros(4, np.float32), comm=SELF, layout=1), TypeError,
     "layout must be 'auto', 'flat' or 'node', not int"),
])
@pytest.mark.parametrize("check", [True, False])
def test_bad_arguments(call, exc, words, check, monkeypatch):
    """Each bad argument raises its error naming it, with the ranks' agreement on the call
    (``check=True``) and without it: the cases call the module's ``allreduce``, which here
    passes ``check``."""
    monkeypatch.setitem(globals(), "allreduce", functools.partial(allreduce, check=check))
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_mpi_sum_is_sum_and_stats_and_reprs_say_what_they_hold():
    """``op=MPI.SUM`` reduces as ``op="sum"``; the stats' ratio is dense over sent bytes
    (1.0 when nothing was sent, as at one rank); codecs and stores show their names."""
    x = np.linspace(-1.0, 1.0, 64, dtype=np.float32)
    by_name = allreduce(x, comm=SELF, compression="fp16", op="sum", feedback=False)
    assert np.array_equal(allreduce(x, comm=SELF, compression="fp16", op=MPI.SUM,
                                    feedback=False), by_name)
    stats = last_stats()
    assert stats.bytes_sent == 0 and stats.ratio == 1.0
    stats.bytes_sent, stats.dense_bytes = 64, 256
    assert stats.ratio == 4.0
    store = ErrorFeedback()
    allreduce(x, comm=SELF, compression="int8", feedback=store, key="w")
    assert repr(store) == "<ErrorFeedback: 1 residuals>"
    assert repr(get_codec("topk:0.5")) == "<codec topk:0.5>"
