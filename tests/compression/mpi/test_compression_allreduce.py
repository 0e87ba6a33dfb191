"""The compressed all-reduce against a one-process replay of the same arithmetic.

The suite runs at some world sizes with emulated nodes (tests/test_mpi_suites.py): there
``layout="auto"`` is the node layout, elsewhere the flat one; the other layout is
requested explicitly on a subset of codecs, so both run at every world size.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpicoll.compression import ErrorFeedback, RandomKCodec, allreduce, get_codec, last_stats

from compression_cases import (COUNTS, RANK, SIZE, check_feedback_conserves_the_total, gather,
                               make_input, node_sizes, reference, resolved_layout,
                               shared_reference)

pytestmark = pytest.mark.mpi

DENSE = ["none", "fp16", "bf16", "int8", "int8:4", "onebit", "onebit:8:two"]
SPARSE = ["topk:0.1", "randomk:0.25", "topk:1"]

#: What ``layout="auto"`` is here, and the layout tested explicitly besides it.
AUTO = resolved_layout(SIZE)
OTHER = "flat" if AUTO == "node" else "node"


def codec_for(spec: str):
    # randomk: a fresh object per test so its step counter starts at 0 on every rank
    return RandomKCodec(float(spec.split(":")[1])) if spec.startswith("randomk") else spec


def node_of(rank: int) -> int:
    """The (emulated) node of ``rank``."""
    sizes = node_sizes(SIZE)
    return next(k for k in range(len(sizes)) if rank < sum(sizes[:k + 1]))


def expected_intra_node_bytes(stats, itemsize: int) -> int:
    """What this rank sends inside its node. Flat ring: everything when its right
    neighbour is on its node, else nothing. Node layout: the ring reduce-scatter and
    all-gather of the node's shards (every shard but its own, then every shard but the
    next one's), or on uneven nodes the binomial reduce (to the parent) and broadcast (to
    each child) of the whole vector."""
    count = stats.count
    if stats.layout == "flat":
        return stats.bytes_sent if node_of(RANK) == node_of((RANK + 1) % SIZE) else 0
    sizes = node_sizes(SIZE)
    size = sizes[node_of(RANK)]
    local = RANK - sum(sizes[:node_of(RANK)])
    if len(set(sizes)) == 1:
        shard = [len(a) for a in np.array_split(np.empty(count), size)]
        return (2 * count - shard[local] - shard[(local + 1) % size]) * itemsize
    limit = local & -local if local else size  # children: local + 1, 2, 4, ... below it
    children = sum(1 for k in range(size.bit_length()) if 1 << k < limit
                   and local + (1 << k) < size)
    return ((1 if local else 0) + children) * count * itemsize


def agreed(problems: list[str], what: str) -> None:
    """Fail on every rank if any rank found a problem (after the call's last collective,
    so a rank that fails alone cannot leave the others waiting in a gather)."""
    found = {r: p for r, p in enumerate(gather(problems)) if p}
    assert not found, f"{what}: " + "; ".join(f"rank {r}: {', '.join(p)}"
                                              for r, p in found.items())


def check_against_reference(spec: str, dtype, segment: int | None, layout: str) -> None:
    """Every count, twice (the second call with the first call's residuals): the result
    and this rank's residual equal the replay's bit for bit, on every rank (so the ranks
    hold the same bits)."""
    for count in COUNTS:
        fb = ErrorFeedback()
        codec = codec_for(spec)
        ref_res = [None] * SIZE
        for rep in range(2):  # twice: the second call uses the residual of the first
            x = make_input(RANK, count, rep, dtype)
            x_before = x.copy()
            out = allreduce(x, compression=codec, feedback=fb, key="g", segment_bytes=segment,
                            layout=layout)
            stats = last_stats()
            # every rank's input made again here (no message), the replay on rank 0
            inputs = [make_input(r, count, rep, dtype) for r in range(SIZE)]
            expect, ref_res = shared_reference(spec, inputs, ref_res, segment,
                                               randomk_step=rep, layout=layout)
            problems = []
            if not np.array_equal(x, x_before):
                problems.append("the input was modified")
            if out.dtype != dtype or out.shape != (count,):
                problems.append(f"result {out.dtype} {out.shape}")
            elif out.tobytes() != expect.tobytes():
                problems.append(f"result differs, max {np.abs(out - expect).max()}")
            if count and fb.residual("g").tobytes() != ref_res[RANK].tobytes():
                problems.append("residual differs")
            if stats.layout != resolved_layout(SIZE, layout):
                problems.append(f"layout {stats.layout}")
            if stats.bytes_sent != stats.intra_node_bytes + stats.inter_node_bytes:
                problems.append("bytes_sent is not intra + inter")
            if count and stats.intra_node_bytes != expected_intra_node_bytes(
                    stats, np.dtype(dtype).itemsize):
                problems.append(f"intra_node_bytes {stats.intra_node_bytes}")
            if SIZE > 1 and count and not (stats.bytes_sent > 0 and stats.messages > 0):
                problems.append("nothing sent")
            if SIZE > 1 and count > SIZE * 4 and get_codec(spec).dense \
                    and np.array_equal(out, get_codec(spec).roundtrip(x)):
                problems.append("the result is this rank's own round trip")
            agreed(problems, f"{spec} {layout} count={count} rep={rep}")


@pytest.mark.parametrize("dtype,segment", [(np.float32, 64), (np.float32, None),
                                           (np.float64, 256)],
                         ids=["f32-seg64", "f32-segdefault", "f64-seg256"])
@pytest.mark.parametrize("spec", DENSE + SPARSE)
def test_matches_reference_bit_for_bit(spec, dtype, segment):
    if segment == 64 and not get_codec(spec).dense:
        pytest.skip("sparse codecs are not segmented")
    check_against_reference(spec, dtype, segment, "auto")


@pytest.mark.parametrize("dtype,segment", [(np.float32, 64), (np.float64, None)],
                         ids=["f32-seg64", "f64-segdefault"])
@pytest.mark.parametrize("spec", ["none", "bf16", "int8:4", "onebit:8", "topk:0.1",
                                  "randomk:0.25"])
def test_other_layout_matches_reference(spec, dtype, segment):
    """The layout ``auto`` does not pick here (``node`` on one real node: one compressed
    hop, the node's ranks summing exactly), against its own replay."""
    check_against_reference(spec, dtype, segment, OTHER)


@pytest.mark.parametrize("spec", ["fp16", "int8", "onebit", "topk:0.2"])
def test_feedback_conserves_the_total(spec):
    """Sum over ranks of the residuals plus the result = sum of compensated inputs."""
    check_feedback_conserves_the_total(
        lambda x, fb: allreduce(x, compression=spec, feedback=fb, segment_bytes=256), 3)


@pytest.mark.parametrize("spec", ["none", "int8", "topk:0.5"])
def test_average_in_place_and_shapes(spec):
    x = make_input(RANK, 60, 0, np.float64).reshape(6, 10)
    inputs = gather(x.reshape(-1))
    out = allreduce(x, op="average", compression=spec, feedback=False)
    expect, _ = reference(spec, inputs, [None] * SIZE, None)
    assert out.shape == (6, 10)
    assert out.reshape(-1).tobytes() == (expect / SIZE).tobytes()
    buf = x.copy()
    assert allreduce(None, buf, op="average", compression=spec, feedback=False) is buf
    assert buf.tobytes() == out.tobytes()
    if spec == "none":
        np.testing.assert_allclose(out.reshape(-1), np.mean(inputs, axis=0), rtol=1e-12)


def test_lossless_codec_equals_the_exact_sum_on_integers():
    x = (np.arange(1000) % 17 + RANK).astype(np.float32)
    out = allreduce(x, compression="none", segment_bytes=128)
    assert np.array_equal(out, np.sum(gather(x), axis=0))
    if SIZE > 1:
        assert not np.array_equal(out, x)


@pytest.mark.parametrize("layout", ["flat", "node"])
def test_stats_report_fewer_bytes_for_compressed_codecs(layout):
    x = make_input(RANK, 1 << 14, 0, np.float32)
    sent, inter, intra = {}, {}, {}
    problems = []
    for spec in ["none", "fp16", "int8", "onebit", "topk:0.01"]:
        allreduce(x, compression=spec, feedback=False, layout=layout)
        s = last_stats()
        sent[spec], inter[spec], intra[spec] = (s.bytes_sent, s.inter_node_bytes,
                                                s.intra_node_bytes)
        if not (s.codec == get_codec(spec).name and s.size == SIZE and s.layout == layout):
            problems.append(f"{spec}: {s}")
        if s.bytes_sent != s.intra_node_bytes + s.inter_node_bytes:
            problems.append(f"{spec}: bytes_sent is not intra + inter")
        if spec == "none" and s.bytes_sent != s.dense_bytes:
            problems.append("none: bytes_sent != dense_bytes")
    agreed(problems, f"stats {layout}")
    if SIZE == 1:
        return
    wire = sent
    if layout == "node":
        # the phases inside the node are uncompressed: the same bytes for every codec
        assert len(set(intra.values())) == 1
        if len(node_sizes(SIZE)) == 1:
            assert all(v == 0 for v in inter.values())  # one node: nothing crosses
            return
        wire = inter
    if wire["none"]:  # (ranks that are not a node's first one send no compressed bytes)
        assert wire["fp16"] * 2 == wire["none"]
        assert wire["int8"] < wire["fp16"] and wire["onebit"] < wire["int8"]
        if SIZE <= 8:
            assert wire["topk:0.01"] < wire["onebit"] * 4


def test_node_layout_sends_fewer_bytes_across_nodes():
    """Summed over ranks, the node layout sends fewer bytes between nodes than the flat
    ring wherever ``auto`` picks it."""
    if AUTO != "node":
        pytest.skip("one node or one rank per node: auto is flat")
    x = make_input(RANK, 1 << 12, 0, np.float32)
    totals = {}
    for layout in ["flat", "node"]:
        allreduce(x, compression="int8", feedback=False, layout=layout)
        totals[layout] = sum(gather(last_stats().inter_node_bytes))
    assert 0 < totals["node"] < totals["flat"]


def test_randomk_steps_stay_in_line_across_layouts():
    """Ranks that encode nothing in the node layout (not a node's first rank, on uneven
    nodes) still advance random-k's step, so a later call picks the same indices on every
    rank: the flat sum keeps at most k non-zeros."""
    codec = RandomKCodec(0.1)
    x = make_input(RANK, 400, 0, np.float32) + 10  # no zeros
    allreduce(x, compression=codec, feedback=False, layout="node")
    flat = allreduce(x, compression=codec, feedback=False, layout="flat")
    assert gather(codec.step) == [2] * SIZE
    assert np.count_nonzero(flat) <= 40


def test_named_randomk_advances_between_calls():
    x = make_input(RANK, 400, 0, np.float32) + 10  # no zeros
    a = allreduce(x, compression="randomk:0.1", feedback=False)
    b = allreduce(x, compression="randomk:0.1", feedback=False)
    # same indices on every rank: the sum has at most k non-zeros
    assert np.count_nonzero(a) <= 40 and np.count_nonzero(b) <= 40
    assert not np.array_equal(np.flatnonzero(a), np.flatnonzero(b))


def test_public_allreduce_takes_compression():
    """``mpicoll.allreduce(x, compression=...)`` is the compressed all-reduce."""
    import mpicoll  # noqa: PLC0415

    x = make_input(RANK, 1009, 0, np.float32)
    ours = mpicoll.allreduce(x, op="average", compression="int8",
                             feedback=ErrorFeedback(), check=True)
    direct = allreduce(x, None, "average", compression="int8", feedback=ErrorFeedback(),
                       key="x")
    assert np.array_equal(ours, direct)
    exact = mpicoll.allreduce(x, compression="none")
    assert np.array_equal(exact, mpicoll.allreduce(x))
    with pytest.raises(ValueError, match="algorithm"):
        mpicoll.allreduce(x, compression="int8", algorithm="ring")
