"""Calls by shape at every world size: every collective and ``mpicoll.Comm`` method, given
new arrays of a known shape on each call, is planned once and still reads each call's
input and writes each call's output (compared with a reference computed without
mpicoll); the same arrays twice in a row leave for the identity cache."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import collectives, config, fastpath

from cases import COMM, RANK, SIZE, gather_inputs, make_data, reference_reduce

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(config.check_enabled(), reason="MPICOLL_CHECK=1: every "
                                 "call is agreed on and planned, none cached")]

#: Shapes of the per-rank data: one element (empty blocks for most ranks), n + 1, 2-D.
SHAPES = [(1,), (SIZE + 1,), (2, 7)]
ROOT = SIZE // 2
#: Calls per case: the first plans, the others run by shape (CI time: 2 is enough).
REPS = 2
#: Native MPI (its own prepared call) and one hand-written algorithm (the generic call on
#: flat views) per collective: the two kinds of call by shape.
ALGORITHMS = {"allreduce": ["native", "ring"], "reduce_scatter": ["native", "ring"],
              "allgather": ["native", "ring"], "broadcast": ["native", "binomial"],
              "reduce": ["native", "binomial"]}


@pytest.fixture
def planned(monkeypatch):
    """The collectives planned (the slow path) while the test runs."""
    seen: list[str] = []
    for name, plan in list(collectives._PLANS.items()):
        monkeypatch.setitem(collectives._PLANS, name,
                            lambda ctx, *a, _plan=plan, _name=name: (seen.append(_name),
                                                                    _plan(ctx, *a))[1])
    fastpath.invalidate()  # calls cached by earlier tests would not be counted
    yield seen
    fastpath.invalidate()


def _data(shape: tuple, rep: int, rank: int = RANK) -> np.ndarray:
    count = int(np.prod(shape))
    return make_data(rank, count, rep, np.int64).reshape(shape)  # a new array each call


def _expected(collective: str, shape: tuple, rep: int, op: str) -> np.ndarray | None:
    """This rank's result, from every rank's input gathered with mpi4py and numpy."""
    x = _data(shape, rep)
    if collective == "broadcast":
        return _data(shape, rep, ROOT)
    if collective == "allgather":
        return np.concatenate([a.reshape(-1) for a in gather_inputs(x)])
    full = reference_reduce([a.reshape(-1) for a in gather_inputs(x)], op)
    if collective == "reduce_scatter":
        return np.array_split(full, SIZE)[RANK]
    if collective == "reduce" and RANK != ROOT:
        return None
    return full


def _output(collective: str, shape: tuple) -> np.ndarray | None:
    """A new output array for this rank (``None`` off the root of a reduce)."""
    count = int(np.prod(shape))
    if collective == "reduce_scatter":
        return np.full(np.array_split(np.arange(count), SIZE)[RANK].size, -99)
    if collective == "allgather":
        return np.full(count * SIZE, -99)
    if collective == "reduce" and RANK != ROOT:
        return None
    return np.full(shape, -99, dtype=np.int64)


def _call(collective: str, x: np.ndarray, out: np.ndarray | None, op: str,
          algorithm: str) -> np.ndarray | None:
    if collective == "broadcast":
        return mpicoll.broadcast(x, ROOT, algorithm=algorithm)
    if collective == "allgather":
        return mpicoll.allgather(x, out, algorithm=algorithm)
    if collective == "reduce":
        return mpicoll.reduce(x, out, op=op, root=ROOT, algorithm=algorithm)
    return getattr(mpicoll, collective)(x, out, op=op, algorithm=algorithm)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather",
                                        "broadcast", "reduce"])
def test_new_arrays_each_call_are_planned_once_and_follow_the_data(collective, planned):
    failures = []
    op = "average"  # its final division is part of what a call by shape runs
    for algorithm in ALGORITHMS[collective]:
        for shape in SHAPES:
            # (a broadcast has no output to leave out)
            for new_output in (False,) if collective == "broadcast" else (False, True):
                planned.clear()
                for rep in range(REPS):
                    x = _data(shape, rep) if collective != "broadcast" or RANK == ROOT \
                        else np.full(shape, -99, dtype=np.int64)
                    out = None if new_output else _output(collective, shape)
                    got = _call(collective, x, out, op, algorithm)
                    expected = _expected(collective, shape, rep, op)
                    case = f"{algorithm} shape={shape} new_output={new_output} rep={rep}"
                    if expected is None:
                        ok = got is None
                    else:
                        ok = got is not None and np.array_equal(got.reshape(-1),
                                                                expected.reshape(-1))
                        if collective == "broadcast":
                            ok = ok and got is x
                        elif out is not None:
                            ok = ok and got is out
                        elif collective in ("allreduce", "reduce"):
                            ok = ok and got.shape == shape and got is not x
                    if not ok:
                        failures.append(f"{case}: got {got!r}, expected {expected!r}")
                # off the root a reduce has no output: both forms are one call by shape
                once = [] if (collective == "reduce" and RANK != ROOT and new_output) \
                    else [collective]
                if planned != once:
                    failures.append(f"{algorithm} shape={shape} new_output={new_output}: "
                                    f"planned {planned} in {REPS} calls with new arrays")
    assert not failures, "\n".join(failures[:8])


def test_the_same_arrays_twice_go_to_the_identity_cache(planned):
    x = _data((5,), 0)
    mpicoll.allgather(_data((5,), 1), np.empty(5 * SIZE, dtype=np.int64))  # plans (5,)
    for _ in range(3):
        got = mpicoll.allgather(x, np.empty(5 * SIZE, dtype=np.int64))
        assert np.array_equal(got, _expected("allgather", (5,), 0, "sum"))
    assert planned == ["allgather"]
    z = np.empty(5 * SIZE, dtype=np.int64)
    mpicoll.allgather(x, z)          # by shape
    mpicoll.allgather(x, z)          # the same arrays again: planned, cached by identity
    assert planned == ["allgather"] * 2
    assert fastpath.lookup("allgather", x, z, "auto", None) is not None


def test_comm_methods_run_new_arrays_by_shape(planned):
    comm = mpicoll.Comm(COMM)
    failures = []
    for rep in range(3):
        x = _data((2, 7), rep)
        reduced = _expected("allreduce", (2, 7), rep, "sum")
        calls = {
            "Allreduce": (lambda y: comm.Allreduce(x, y, MPI.SUM), np.empty((2, 7), np.int64),
                          reduced),
            "Reduce_scatter_block": (
                lambda y: comm.Reduce_scatter_block(np.tile(x.reshape(-1), SIZE), y, MPI.SUM),
                np.empty(14, np.int64), reduced.reshape(-1)),
            "Allgather": (lambda y: comm.Allgather(x, y), np.empty((2 * SIZE, 7), np.int64),
                          _expected("allgather", (2, 7), rep, "sum")),
            "Bcast": (lambda y: comm.Bcast(y, ROOT), x.copy() if RANK == ROOT else
                      np.empty((2, 7), np.int64), _data((2, 7), rep, ROOT)),
            "Reduce": (lambda y: comm.Reduce(x, y, MPI.SUM, ROOT),
                       np.empty((2, 7), np.int64) if RANK == ROOT else None,
                       reduced if RANK == ROOT else None),
        }
        for name, (call, y, expected) in calls.items():
            assert call(y) is None
            if expected is not None and not np.array_equal(y.reshape(-1),
                                                           expected.reshape(-1)):
                failures.append(f"{name} rep {rep}: {y.reshape(-1)} != {expected.reshape(-1)}")
    assert not failures, "\n".join(failures)
    assert sorted(planned) == sorted(["allreduce", "reduce_scatter", "allgather",
                                      "broadcast", "reduce"]), planned
