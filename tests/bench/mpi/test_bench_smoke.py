"""Smoke tests of the benchmarks: every benchmark at tiny sizes with validation on.

Run under mpirun (``python tests/mpi_launcher.py -n 1,2,3 tests/bench/mpi``). They check that
each benchmark runs, validates its results and writes its outputs: never how fast anything
is. The benchmarks run in-process (``main(argv)``), at the thread level pytest's MPI
already has, so ``--thread-level`` is not passed.
"""
from __future__ import annotations

import json
import os

import pytest
from mpi4py import MPI

import mpicoll
from bench import collective, common, overhead, p2p, tune
from mpicoll import tuning
from mpicoll.context import get_context
from mpicoll.selection import choose

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()

TINY = ["-i", "2", "-x", "1", "-q", "--iterations-large", "1"]


def _shared_path(tmp_path, name: str) -> str:
    """A path every rank agrees on (rank 0's tmp dir)."""
    return comm.bcast(str(tmp_path / name) if RANK == 0 else None, root=0)


@pytest.mark.parametrize("coll", mpicoll.COLLECTIVES)
def test_collective_benchmark_validates_every_algorithm(coll, tmp_path, capsys):
    out = _shared_path(tmp_path, f"{coll}.json")
    rc = collective.main(["-m", "1:2K", "--step", "8", "-c", "-f", "--memcpy-bytes", "1M",
                          "--format", "json", "--output", out, *TINY], collective=coll)
    assert rc == 0
    if RANK == 0:
        text = capsys.readouterr().out
        assert f"MPI {collective.TITLES[coll]} Latency Test" in text
        assert "# Size" in text and "Avg Latency(us)" in text
        assert "Thread level: MPI_THREAD_" in text and f"World size: {SIZE}" in text
        with open(out, encoding="utf-8") as fh:
            data = json.load(fh)
        rows = data["results"]
        algs = {r["algorithm"] for r in rows}
        assert algs == {"mpi", "auto", *mpicoll.algorithms(coll)}
        # a row's Size is the bytes it measured (whole float32 elements, allgather's whole
        # blocks), one row per size measured
        assert {r["size"] for r in rows} == {collective.measured_bytes(coll, b, 4, SIZE)
                                             for b in (1, 8, 64, 512)}
        assert all(r["size"] == r["bytes"] for r in rows)
        assert len(rows) == len({(r["algorithm"], r["size"]) for r in rows})
        chosen = {r["chosen"] for r in rows if r["algorithm"] == "auto"}
        ctx_rpn = get_context(comm).ranks_per_node
        assert chosen == {choose(coll, SIZE, ctx_rpn, r["bytes"])
                          for r in rows if r["algorithm"] == "auto"}
        assert all(r["validated"] is True for r in rows)
        assert all(r["ratio"] is not None and r["avg_us"] > 0 for r in rows)
        assert data["meta"]["world_size"] == SIZE
        assert data["meta"]["memcpy_GBps"] > 0
        # the exact command that reruns it (the real module name) and its date
        assert data["meta"]["command"].startswith(
            f"mpirun -n {SIZE} python -m bench.{collective.MODULES[coll]} -m 1:2K ")
        assert data["meta"]["date"].endswith("UTC")


def test_collective_benchmark_csv_and_algo_and_dtype(tmp_path, capsys):
    out = _shared_path(tmp_path, "ar.csv")
    rc = collective.main(["-m", "8:8", "-c", "--algo", "ring,native", "--dtype", "int32",
                          "--op", "max", "--memcpy-bytes", "0", "--format", "csv",
                          "--output", out, *TINY], collective="allreduce")
    assert rc == 0
    if RANK == 0:
        with open(out, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        assert lines[0].startswith("test,size,algorithm,avg_us")
        assert [ln.split(",")[2] for ln in lines[1:]] == ["mpi", "ring", "native"]
        assert all(",int32," in ln for ln in lines[1:])


@pytest.mark.parametrize("argv", [["-i", "0"], ["-x", "-1"], ["--iterations-large", "0"],
                                  ["--dtype", "foo"], ["--dtype", "bool"], ["--dtype", "U4"],
                                  ["--root", "-1"], ["--root", str(SIZE)]])
def test_bad_collective_options_end_every_rank_at_once(argv):
    """Refused on every rank before anything runs (a hang, a traceback from every rank, a
    silent single iteration or no warm-up at all before)."""
    coll = "reduce" if "--root" in argv else "allreduce"
    with pytest.raises(SystemExit) as info:
        collective.main(["-m", "8:8", "--memcpy-bytes", "0", *TINY, *argv], collective=coll)
    assert info.value.code not in (0, None)


@pytest.mark.parametrize("main, argv", [(p2p.main, ["-W", "0"]), (p2p.main, ["-x", "-10"]),
                                        (overhead.main, ["--calls", "0"]),
                                        (overhead.main, ["--repeats", "0"]),
                                        (tune.main, ["--exclude", "native,binomial",
                                                     "--collectives", "reduce"]),
                                        (tune.main, ["--prefer", "no_such_algorithm"]),
                                        (tune.main, ["--noise=-1"])])
def test_bad_options_of_the_other_benchmarks_end_every_rank_at_once(main, argv):
    with pytest.raises(SystemExit) as info:
        main(argv) if main is not p2p.main else main(argv, test="bw")
    assert info.value.code not in (0, None)


def test_collective_dispatcher_rejects_unknown_algorithm():
    with pytest.raises(SystemExit):
        collective.main(["--algo", "no_such_algorithm", *TINY], collective="allreduce")


def test_plot_and_markdown(tmp_path):
    pytest.importorskip("matplotlib")
    png = _shared_path(tmp_path, "bw.png")
    md = _shared_path(tmp_path, "bw.md")
    rc = collective.main(["-m", "64:4K", "--step", "8", "--memcpy-bytes", "0", "--plot", png,
                          "--markdown", md, *TINY], collective="allreduce")
    assert rc == 0
    if RANK == 0:
        assert os.path.getsize(png) > 1000
        with open(md, encoding="utf-8") as fh:
            text = fh.read()
        assert text.startswith("| Size | MPI | native")
        assert "| 4 KiB |" in text


@pytest.mark.parametrize("test", ["latency", "bw", "bibw"])
def test_point_to_point_benchmarks(test, tmp_path, capsys):
    out = _shared_path(tmp_path, f"{test}.json")
    rc = p2p.main(["-m", "0:4K" if test == "latency" else "1:4K", "-c", "-W", "4",
                   "--format", "json", "--output", out, *TINY], test=test)
    assert rc == 0
    if RANK == 0:
        text = capsys.readouterr().out
        assert f"MPI {p2p.TESTS[test]}" in text
        if SIZE >= 2:
            with open(out, encoding="utf-8") as fh:
                data = json.load(fh)
            rows = data["results"]
            assert rows and all(r["validated"] is True for r in rows)
            assert data["meta"]["command"].startswith(f"mpirun -n {SIZE} python -m "
                                                      f"bench.osu_{test} ")
            key = "avg_us" if test == "latency" else "bandwidth_MBps"
            assert all(r[key] > 0 for r in rows)
        else:
            assert "needs at least two ranks" in text


def test_node_wait_benchmark(capsys):
    from bench import node_wait

    assert node_wait.main(["--count", "1001", "--skew-ms", "0.5", "--iters", "6"]) == 0
    if RANK == 0:
        assert "results right" in capsys.readouterr().out


def test_overhead_benchmark(tmp_path, capsys):
    out = _shared_path(tmp_path, "overhead.json")
    rc = overhead.main(["--calls", "20", "--repeats", "1", "--memcpy-bytes", "1M",
                        "--profile", "--format", "json", "--output", out])
    assert rc == 0
    if RANK == 0:
        with open(out, encoding="utf-8") as fh:
            res = json.load(fh)
        assert set(res["per_call_us"]) == {"mpi", "auto", *mpicoll.algorithms("allreduce"),
                                           "auto persistent", "mpi new-out", "auto new-out",
                                           "mpi new-in", "auto new-in", "auto planned",
                                           "mpi recorded"}
        assert res["inspector_us"] == res["per_call_us"]["mpi recorded"] - res["per_call_us"]["mpi"]
        assert res["memcpy_GBps"] > 0 and res["add_GBps"] > 0
        assert res["command"].startswith(f"mpirun -n {SIZE} python -m bench.overhead ")
        assert res["date"].endswith("UTC")
        # profile lines name files relative to the repository / installed packages
        assert "mpicoll/collectives.py" in res["profile"]
        assert str(common.REPO_ROOT) not in res["profile"]
        assert "site-packages" not in res["profile"]


def test_tune_writes_a_table_auto_uses(tmp_path):
    out = _shared_path(tmp_path, "table.json")
    rc = tune.main(["-m", "8:4K", "--step", "4", "--output", out, *TINY])
    assert rc == 0
    comm.Barrier()
    table = tuning.load_table(out)
    try:
        if SIZE == 1:
            assert table.collectives() == []
        else:
            assert table.collectives() == sorted(mpicoll.COLLECTIVES)
            for coll in mpicoll.COLLECTIVES:
                assert table.world_sizes(coll) == [SIZE]
                for nbytes in (1, 8, 100, 4096, 1 << 30):
                    assert table.lookup(coll, SIZE, 0, nbytes) in mpicoll.algorithms(coll)
        # auto now follows the table, the same on every rank, and still computes right
        tuning.use_table(table)
        import numpy as np

        from mpicoll.selection import choose

        for nbytes in (4, 64, 4096):
            picks = comm.allgather(choose("allreduce", SIZE, 0, nbytes))
            assert len(set(picks)) == 1
            if SIZE > 1:
                assert picks[0] == table.lookup("allreduce", SIZE, 0, nbytes)
            x = np.arange(nbytes // 4, dtype=np.float32) + RANK
            y = mpicoll.allreduce(x)
            assert np.array_equal(y, np.arange(nbytes // 4, dtype=np.float32) * SIZE
                                  + SIZE * (SIZE - 1) / 2)
    finally:
        tuning.use_table(None)
        tuning.clear_cache()


def test_tune_merge_keeps_other_world_sizes(tmp_path):
    base = {"format": tuning.FORMAT, "meta": {},
            "collectives": {"allreduce": [{"world_size": 99, "rules": [
                {"max_bytes": None, "algorithm": "ring"}]}]}}
    path = _shared_path(tmp_path, "merged.json")
    if RANK == 0:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(base, fh)
    comm.Barrier()
    rc = tune.main(["-m", "8:8", "--collectives", "allreduce", "--merge", path, "--output",
                    path, *TINY])
    assert rc == 0
    comm.Barrier()
    tuning.clear_cache()
    table = tuning.load_table(path)
    expected = [99] if SIZE == 1 else sorted({SIZE, 99})
    assert table.world_sizes("allreduce") == expected
    tuning.clear_cache()
