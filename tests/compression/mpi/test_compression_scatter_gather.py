"""The compressed reduce-scatter and all-gather against one-process replays.

One call per case where a second adds nothing (the suite runs at six world sizes): the
reduce-scatter runs every count once, and a second time at the largest count with the
first call's residuals.
"""
from __future__ import annotations

import numpy as np
import pytest

import mpicoll
from mpicoll.compression import (ErrorFeedback, RandomKCodec, allgather, get_codec,
                                 last_stats, reduce_scatter)

from compression_cases import (RANK, SIZE, allgather_reference, block_segments,
                               check_feedback_conserves_the_total, gather, make_input, on_rank0,
                               reduce_scatter_reference, split_bounds)

pytestmark = pytest.mark.mpi

#: 0, 1, n-1, n+1, a prime, and one crossing several segments (with a small segment_bytes);
#: codecs outside ALL_COUNTS run the prime and the large count only (CI time).
COUNTS = sorted({0, 1, max(SIZE - 1, 0), SIZE + 1, 13, 1009})
ALL_COUNTS = {"int8:4", "onebit:8", "topk:0.2", "randomk:0.25"}


def codec_for(spec: str):
    # randomk: a fresh object per test so its step counter starts at 0 on every rank
    return RandomKCodec(float(spec.split(":")[1])) if spec.startswith("randomk") else spec


def agreed(problems: list[str], what: str) -> None:
    """Fail on every rank if any rank found a problem (after the last collective)."""
    found = {r: p for r, p in enumerate(gather(problems)) if p}
    assert not found, f"{what}: " + "; ".join(f"rank {r}: {', '.join(p)}"
                                              for r, p in found.items())


def rs_wire_bytes(spec: str, count: int, segment: int | None, dtype) -> int:
    """What this rank sends in the reduce-scatter: one encoding of every block but its
    own (segment by segment for dense codecs)."""
    codec = get_codec(spec)
    total = 0
    for b in range(SIZE):
        if b == RANK:
            continue
        if codec.dense:
            sb = block_segments(count, SIZE, b, segment, dtype)
            total += sum(codec.wire_bytes(sb[j + 1] - sb[j], dtype) for j in range(len(sb) - 1))
        else:
            bb = split_bounds(count, SIZE)
            total += codec.wire_bytes(bb[b + 1] - bb[b], dtype)
    return total


@pytest.mark.parametrize("spec,dtype,segment", [
    ("none", np.float64, None), ("fp16", np.float32, 128), ("bf16", np.float32, None),
    ("int8:4", np.float32, 256), ("onebit:8", np.float64, 512), ("topk:0.2", np.float32, None),
    ("randomk:0.25", np.float64, None)])
def test_reduce_scatter_matches_reference(spec, dtype, segment):
    """Rank i holds block i of the replay's sum, bit for bit; residuals too; the bytes are
    one encoding of every other block."""
    for count in COUNTS if spec in ALL_COUNTS else [13, 1009]:
        fb = ErrorFeedback()
        codec = codec_for(spec)
        ref_res = [None] * SIZE
        for call in range(2 if count == COUNTS[-1] else 1):
            x = make_input(RANK, count, call, dtype)
            x_before = x.copy()
            out = reduce_scatter(x, compression=codec, feedback=fb, key="g",
                                 segment_bytes=segment)
            stats = last_stats()
            inputs = gather(x)
            expect, ref_res = on_rank0(reduce_scatter_reference, spec, inputs, ref_res,
                                       segment, call)
            bb = split_bounds(count, SIZE)
            problems = []
            if not np.array_equal(x, x_before):
                problems.append("the input was modified")
            if out.dtype != dtype or out.shape != (bb[RANK + 1] - bb[RANK],):
                problems.append(f"result {out.dtype} {out.shape}")
            elif out.tobytes() != expect[bb[RANK]:bb[RANK + 1]].tobytes():
                problems.append("result differs")
            if count and fb.residual("g").tobytes() != ref_res[RANK].tobytes():
                problems.append("residual differs")
            if stats.collective != "reduce_scatter" or stats.count != count:
                problems.append(f"stats {stats}")
            if count and stats.bytes_sent != rs_wire_bytes(spec, count, segment, dtype):
                problems.append(f"bytes_sent {stats.bytes_sent}")
            if SIZE > 1 and count and stats.messages == 0:
                problems.append("no message sent")
            agreed(problems, f"{spec} count={count} call={call}")


@pytest.mark.parametrize("spec", ["int8", "onebit", "topk:0.2"])
def test_reduce_scatter_feedback_conserves_the_total(spec):
    """Summed over ranks, residuals plus the gathered result = the compensated inputs."""
    check_feedback_conserves_the_total(
        lambda x, fb: np.concatenate(gather(
            reduce_scatter(x, compression=spec, feedback=fb, segment_bytes=256))), 2)


@pytest.mark.parametrize("spec,dtype", [
    ("none", np.float32), ("fp16", np.float32), ("bf16", np.float64), ("int8:4", np.float32),
    ("onebit:8", np.float32), ("topk:0.2", np.float64), ("randomk:0.3", np.float32)])
def test_allgather_matches_reference(spec, dtype):
    """Every rank holds the replay's blocks bit for bit (its own block decoded from its
    payload); feedback off by default; bytes: n - 1 payloads."""
    codec = get_codec(spec)
    for m in sorted({0, 1, SIZE + 1, 13}) if spec in ("int8:4", "topk:0.2") else [13]:
        x = make_input(RANK, m, 0, dtype)
        out = allgather(x, compression=codec_for(spec))
        stats = last_stats()
        expect, _ = on_rank0(allgather_reference, spec, gather(x), [None] * SIZE)
        problems = []
        if out.shape != (SIZE * m,) or out.tobytes() != expect.tobytes():
            problems.append(f"result differs ({out.shape})")
        if stats.collective != "allgather" or (
                m and stats.bytes_sent != (SIZE - 1) * codec.wire_bytes(m, dtype)):
            problems.append(f"stats {stats}")
        agreed(problems, f"{spec} m={m}")


def test_allgather_feedback_shapes_and_in_place():
    """With an ErrorFeedback the residual is the block minus its payload and enters the
    next call; 2-D blocks; IN_PLACE; the default keeps no residual."""
    fb = ErrorFeedback()
    ref_res = [None] * SIZE
    codec = RandomKCodec(0.25)
    problems = []
    for call in range(2):
        x = make_input(RANK, 24, call, np.float32).reshape(4, 6)
        out = allgather(x, compression=codec, feedback=fb, key="p")
        expect, ref_res = on_rank0(allgather_reference, "randomk:0.25",
                                   gather(x.reshape(-1)), ref_res, call)
        if out.shape != (4 * SIZE, 6) or out.reshape(-1).tobytes() != expect.tobytes():
            problems.append(f"call {call}: result differs")
        if fb.residual("p").tobytes() != ref_res[RANK].tobytes():
            problems.append(f"call {call}: residual differs")
    x = make_input(RANK, 24, 0, np.float32)
    buf = np.zeros(24 * SIZE, np.float32)
    buf[RANK * 24:(RANK + 1) * 24] = x
    if allgather(None, buf, compression="int8") is not buf:
        problems.append("in place: not recvbuf")
    if buf.tobytes() != allgather(x, compression="int8").tobytes():
        problems.append("in place differs")
    allgather(x, compression="int8")
    if allgather(x, compression="int8").tobytes() != buf.tobytes():
        problems.append("a residual was kept by default")
    agreed(problems, "allgather")


@pytest.mark.parametrize("spec", ["int8", "topk:0.3"])
def test_reduce_scatter_in_place_average_and_recvbuf(spec):
    count = 7 * SIZE + 3
    x = make_input(RANK, count, 0, np.float32)
    bb = split_bounds(count, SIZE)
    mine = bb[RANK + 1] - bb[RANK]
    expect, _ = on_rank0(reduce_scatter_reference, spec, gather(x), [None] * SIZE, None)
    want = (expect[bb[RANK]:bb[RANK + 1]] / SIZE).tobytes()
    problems = []
    out = reduce_scatter(x, compression=spec, op="average", feedback=False)
    if out.tobytes() != want:
        problems.append("out of place")
    buf = x.copy()  # in place, without feedback: the block lands in buf[:mine]
    got = reduce_scatter(None, buf, op="average", compression=spec, feedback=False)
    if got.tobytes() != want or not np.shares_memory(got, buf) or buf[:mine].tobytes() != want:
        problems.append("in place")
    buf = x.copy()  # in place, with feedback
    got = reduce_scatter(None, buf, op="average", compression=spec, feedback=True)
    if got.tobytes() != want:
        problems.append("in place with feedback")
    recv = np.empty((mine, 1), np.float32)
    if reduce_scatter(x, recv, op="average", compression=spec, feedback=False) is not recv \
            or recv.reshape(-1).tobytes() != want:
        problems.append("recvbuf")
    agreed(problems, spec)


def test_public_collectives_take_compression():
    """``mpicoll.reduce_scatter``/``allgather(..., compression=, feedback=)``."""
    x = make_input(RANK, 101, 0, np.float32)
    problems = []
    got = mpicoll.reduce_scatter(x, op="average", compression="int8",
                                 feedback=ErrorFeedback())
    want = reduce_scatter(x, op="average", compression="int8", feedback=ErrorFeedback())
    if got.tobytes() != want.tobytes():
        problems.append("reduce_scatter")
    if not np.array_equal(mpicoll.reduce_scatter(x, compression="none"),
                          mpicoll.reduce_scatter(x)):
        problems.append("reduce_scatter none")
    got = mpicoll.allgather(x, compression="bf16")
    if got.tobytes() != allgather(x, compression="bf16").tobytes():
        problems.append("allgather")
    if not np.array_equal(mpicoll.allgather(x, compression="none"), mpicoll.allgather(x)):
        problems.append("allgather none")
    agreed(problems, "pass-through")
    with pytest.raises(ValueError, match="algorithm"):
        mpicoll.reduce_scatter(x, compression="int8", algorithm="ring")
    with pytest.raises(ValueError, match="algorithm"):
        mpicoll.allgather(x, compression="fp16", algorithm="ring")
