"""The to-accuracy training benchmarks' pieces that need no MPI launch: bench.diloco's
variants and summary, bench.workloads' Markov language, bench.training_runs.WireBytes."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import diloco, training_runs, workloads  # noqa: E402


def test_variants_parse_and_bad_ones_are_refused() -> None:
    assert diloco.parse_variant("ddp") == {"kind": "ddp"}
    assert diloco.parse_variant("none") == {"kind": "none"}
    assert diloco.parse_variant("L8") == {"kind": "local", "sync_every": 8}
    assert diloco.parse_variant("S100F4T1:int4") == {
        "kind": "diloco", "sync_every": 100, "fragments": 4, "overlap": 1,
        "compression": "int4"}
    for bad in ("ddp:int4", "D", "sync2", "S10F2"):
        with pytest.raises(argparse.ArgumentTypeError):
            diloco.parse_variant(bad)


def _record(variant: str, seed: int, reached, seconds: float, steps: int = 100,
            wire: float | None = 1000.0) -> dict:
    return {"variant": variant, "seed": seed, "reached": reached, "steps": steps,
            "final_accuracy": 0.97, "train_seconds": seconds, "cross_node_bytes": 500.0,
            "wire_bytes": wire, "node_sizes": [2, 2]}


def test_summary_ratios_to_sync_and_to_no_communication() -> None:
    records = [_record("sync", 1, [50, 2.0, 400.0, 800.0], 4.0),
               _record("none", 1, [90, 1.0, 0.0, 10.0], 2.0),
               _record("D10", 1, [60, 1.5, 20.0, 40.0], 2.2)]
    summary = diloco.summarize(records)
    assert summary["D10"]["time_to_target_vs_sync"] == pytest.approx(0.75)
    assert summary["D10"]["wire_bytes_to_target_vs_sync"] == pytest.approx(0.05)
    assert summary["D10"]["bytes_to_target_vs_sync"] == pytest.approx(0.05)
    assert summary["D10"]["seconds_per_step_vs_none"] == pytest.approx(1.1)
    assert summary["sync"]["seconds_per_step_vs_none"] == pytest.approx(2.0)
    unmeasured = diloco.summarize([_record("sync", 1, [50, 2.0, 400.0, None], 4.0,
                                           wire=None)])
    assert unmeasured["sync"]["wire_bytes_to_target_median"] is None
    assert unmeasured["sync"]["wire_bytes_per_step"] is None


def test_markov_language_is_fixed_and_learnable_only_so_far() -> None:
    xtr, ytr, xte, yte, desc = workloads.markov_data()
    assert xtr.shape == (workloads.TRAIN, workloads.CONTEXT) and len(yte) == workloads.TEST
    # each window's target is the symbol after it: the next window starts one later
    assert (xtr[1:, -1] == ytr[:-1]).all()
    assert xte[0].tolist() == xtr[-1, 1:].tolist() + [int(ytr[-1])]
    assert int(xtr.max()) < workloads.SYMBOLS and "scores 0.68" in desc
    again = workloads.markov_data()
    assert (again[0] == xtr).all() and (again[3] == yte).all()
    model = workloads.MarkovLM()
    assert sum(p.numel() for p in model.parameters()) == 103_184
    assert model(xte[:5]).shape == (5, workloads.SYMBOLS)


class _OneRank:
    """What WireBytes asks of ``hvd`` on one rank."""
    Sum = "sum"

    @staticmethod
    def local_rank() -> int:
        return 0

    @staticmethod
    def allreduce(tensor, op, name):
        return tensor


def test_wire_bytes_count_only_while_running() -> None:
    import socket

    wire = training_runs.WireBytes(_OneRank, "lo")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            client.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(peer.recv(65536))
            wire.pause()
            counted = wire.total("t")
            client.sendall(b"y" * 100_000)        # paused: not counted
            got = 0
            while got < 100_000:
                got += len(peer.recv(65536))
            peer.close()
    assert counted >= 100_000 and wire.total("t") == counted
    assert training_runs.WireBytes(_OneRank, None).total("t") is None
    with pytest.raises(SystemExit, match="no such interface"):
        training_runs.WireBytes(_OneRank, "no-such-iface0")
