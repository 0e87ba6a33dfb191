"""compression="auto" across ranks: every rank makes the same choice even when its own
measurements differ, the result equals the chosen codec's bit for bit, bad input raises
on every rank. Synthetic measurements (monkeypatched probes) make the choice known; one
test runs the real probes (no timing asserted)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import MismatchError, RemoteError, tuning
from mpicoll.compression import (Auto, ErrorFeedback, allgather, allreduce, last_stats,
                                 probe, reduce_scatter)
from mpicoll.compression.cost_model import Layout, ModelInputs, Speed, choose

from compression_cases import COMM, RANK, SIZE

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(SIZE in (2, 5, 8), reason="CI budget (issue 27: 30 s): "
                                 "compression='auto' runs at n = 1, 3 and 4 (2 + 2 nodes)")]

GB, MB = 1e9, 1e6
CANDS = ("none", "bf16", "int8", "topk:0.01")


def rank_speeds(rank: int, int8_rate: float) -> dict[str, Speed]:
    """Codec speeds as rank ``rank`` 'measured' them: int8's differs from rank to rank."""
    return {"none": Speed(1e-6, 20 * GB), "bf16": Speed(2e-6, (4 + rank) * GB),
            "int8": Speed(3e-6 * (rank + 1), int8_rate / (rank + 1)),
            "topk:0.01": Speed(5e-6, 0.1 * GB)}


@pytest.fixture
def fake_probes(monkeypatch):
    """Rank-dependent synthetic measurements; returns a setter of the link's figures."""
    state = {"int8": 5 * GB, "link": (1e-5, 1 / (10 * GB))}

    def speeds(names, like=None):
        table = rank_speeds(RANK, state["int8"])
        return ({n: table[n] for n in ["none", *names]}, {n: table[n] for n in ["none", *names]},
                Speed(1e-6, 10 * GB))

    def link(comm, repeats=5):
        latency, per_byte = state["link"]
        return latency * (1 + 0.5 * comm.Get_rank()), per_byte * (1 + 0.25 * comm.Get_rank())

    monkeypatch.setattr(probe, "codec_speeds", speeds)
    monkeypatch.setattr(probe, "measure_link", link)
    return state


def expected_inputs(state) -> ModelInputs:
    """The agreed inputs, computed here: the maximum over ranks of every figure."""
    ranks = range(SIZE)
    enc = {}
    for c in CANDS:
        enc[c] = Speed(max(rank_speeds(r, state["int8"])[c].overhead for r in ranks),
                       1 / max(1 / rank_speeds(r, state["int8"])[c].rate for r in ranks))
    latency = max(state["link"][0] * (1 + 0.5 * r) for r in ranks)
    per_byte = max(state["link"][1] * (1 + 0.25 * r) for r in ranks)
    return ModelInputs(latency if SIZE > 1 else 0.0,
                       1 / per_byte if SIZE > 1 else float("inf"), enc, dict(enc),
                       Speed(1e-6, 10 * GB), "measured")


def fresh_comm():
    """A duplicate of COMM_WORLD: a new context, so nothing is cached from other tests."""
    return COMM.Dup()


# slow link -> compression pays (int8 fast); fast link -> none; very slow + int8 slow ->
# top-k or bf16: each case's expected codec is computed from the agreed inputs
LINKS = {"slow": ((1e-5, 1 / (100 * MB)), 5 * GB), "fast": ((1e-6, 1 / (50 * GB)), 5 * GB),
         "int8 slow": ((1e-5, 1 / (300 * MB)), 0.2 * GB),
         "very slow": ((1e-4, 1 / (2 * MB)), 5 * GB)}


@pytest.mark.parametrize("case", sorted(LINKS))
def test_same_choice_on_every_rank_and_equal_to_the_chosen_codec(fake_probes, case):
    fake_probes["link"], fake_probes["int8"] = LINKS[case]
    comm = fresh_comm()
    try:
        count = 10_003 + 17 * SIZE                       # odd, uneven blocks
        x = (np.random.default_rng([RANK, 7]).standard_normal(count) * (RANK + 1)
             ).astype(np.float32)
        fb_auto, fb_ref = ErrorFeedback(), ErrorFeedback()
        for rep in range(2):                             # twice: caches, residuals
            out = allreduce(x, compression="auto", comm=comm, feedback=fb_auto, key="g",
                            layout="flat")
            stats = last_stats()
            choice = stats.choice
            chosen = stats.codec
            everyone = comm.allgather((chosen, choice.predicted, choice.inputs))
            assert all(e == everyone[0] for e in everyone), everyone
            expected = choose(expected_inputs(fake_probes), CANDS, count, np.float32,
                              Layout(SIZE))
            assert chosen == expected.codec, (choice.predicted, expected.predicted)
            assert choice.predicted == pytest.approx(expected.predicted, rel=1e-12)
            ref = allreduce(x, compression=chosen, comm=comm, feedback=fb_ref, key="g",
                            layout="flat")
            assert np.array_equal(out, ref)
            assert np.array_equal(fb_auto.residual("g"), fb_ref.residual("g")) \
                or (chosen == "none" and not fb_auto.residual("g").any())
        if SIZE > 1:                                     # it did communicate
            assert not np.array_equal(out, x)
    finally:
        comm.Free()


def test_the_cases_cover_several_codecs(fake_probes):
    """The synthetic cases choose at least three different codecs (so the test above
    checks more than one)."""
    chosen = set()
    for link, rate in LINKS.values():
        fake_probes["link"], fake_probes["int8"] = link, rate
        chosen.add(choose(expected_inputs(fake_probes), CANDS, 10_003 + 17 * SIZE,
                          np.float32, Layout(SIZE)).codec)
    assert len(chosen) >= (3 if SIZE > 1 else 1), chosen


def test_reduce_scatter_and_allgather(fake_probes):
    fake_probes["link"], fake_probes["int8"] = LINKS["slow"]
    comm = fresh_comm()
    try:
        x = np.arange(5 * SIZE + 3, dtype=np.float64) * (RANK + 1) / 7
        out = reduce_scatter(x, compression="auto", comm=comm, feedback=False)
        chosen = last_stats().codec
        assert last_stats().choice is not None
        assert len(set(comm.allgather(chosen))) == 1
        assert np.array_equal(out, reduce_scatter(x, compression=chosen, comm=comm,
                                                  feedback=False))
        block = np.linspace(0, 1, 11).astype(np.float32) + RANK
        got = allgather(block, compression="auto", comm=comm)
        chosen = last_stats().codec
        assert len(set(comm.allgather(chosen))) == 1
        assert np.array_equal(got, allgather(block, compression=chosen, comm=comm))
    finally:
        comm.Free()


def test_real_probes_agree():
    """The real measurements (no synthetic figures): every rank holds the same inputs
    and choice, in the layout auto resolves to here."""
    comm = fresh_comm()
    try:
        x = np.full(1 << 12, RANK + 0.5, np.float32)
        spec = Auto(("none", "int8"))                    # two codecs: a shorter probe
        out = allreduce(x, compression=spec, comm=comm, feedback=False)
        s = last_stats()
        everyone = comm.allgather((s.codec, s.choice.inputs, s.layout))
        assert all(e == everyone[0] for e in everyone)
        assert s.choice.inputs["link_source"].startswith("measured")
        # the node layout probes the rings between nodes, all at once
        assert s.choice.inputs["per_ring"] == (s.layout == "node")
        assert s.choice.inputs["bandwidth_bytes_per_s"] > 0
        ref = allreduce(x, compression=s.codec, comm=comm, feedback=False)
        assert np.array_equal(out, ref)
    finally:
        comm.Free()


def test_link_from_the_tuning_table(fake_probes, monkeypatch):
    def no_probe(comm, repeats=5):
        raise AssertionError("the link was measured although the table has it")
    monkeypatch.setattr(probe, "measure_link", no_probe)
    table = {"format": tuning.FORMAT, "meta": {"link": {"latency_s": 2e-5,
                                                        "bandwidth_bytes_per_s": 1.25e8}},
             "collectives": {}}
    tuning.use_table(table)
    comm = fresh_comm()
    try:
        allreduce(np.ones(1000, np.float32), compression="auto", comm=comm)
        inputs = last_stats().choice.inputs
        assert inputs["link_source"].startswith("tuning table")
        assert inputs["latency_s"] == 2e-5
        assert inputs["bandwidth_bytes_per_s"] == pytest.approx(1.25e8, rel=1e-12)
    finally:
        comm.Free()
        tuning.use_table(None)


def test_bad_auto_on_one_rank_only():
    comm = fresh_comm()
    try:
        x = np.ones(10, np.float32)
        if RANK == SIZE - 1:
            with pytest.raises(ValueError, match="unknown compression='zstd'"):
                allreduce(x, compression="auto:none,zstd", comm=comm)
        elif SIZE > 1:
            with pytest.raises(RemoteError):
                allreduce(x, compression="auto", comm=comm)
        # ranks disagreeing: auto against a codec, or different auto options
        if SIZE > 1:
            spec = "auto" if RANK == 0 else "int8"
            with pytest.raises(MismatchError):
                allreduce(x, compression=spec, comm=comm)
            spec = Auto(margin=0.1) if RANK == 0 else "auto"
            with pytest.raises(MismatchError):
                allreduce(x, compression=spec, comm=comm)
        out = allreduce(np.full(5, RANK + 1.0, np.float32), compression="none", comm=comm)
        assert np.array_equal(out, np.full(5, SIZE * (SIZE + 1) / 2, np.float32))
    finally:
        comm.Free()
