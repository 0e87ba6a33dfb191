"""Sleeping waits (mpicoll.waiting: how the runtime's lanes wait for MPI): every algorithm
of every collective, run on a thread that polls and sleeps instead of blocking in MPI,
gives the reference's bits while one rank comes late (past the spin and yield phases, so
the others sleep), and the agreement step's errors still reach every rank."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import mpicoll
from mpicoll import waiting

from cases import RANK, SIZE, all_inputs, bits_equal, make_data, reference_reduce

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("segment")]

COUNTS = sorted({0, 1, SIZE + 1, 211})
#: How late the last rank enters each case (seconds): past waiting.YIELD_S.
LATE_S = 3 * waiting.YIELD_S


def on_sleeping_thread(fn):
    """Run ``fn()`` on a new thread whose waits sleep; return its value or raise its error."""
    out: dict = {}

    def body() -> None:
        waiting.set_sleeps(True)
        assert waiting.sleeps()
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (re-raised on the test's thread)
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert not waiting.sleeps()     # the test's own thread still blocks in MPI
    if "error" in out:
        raise out["error"]
    return out.get("value")


def late(call):
    """``call()``, entered :data:`LATE_S` late on the last rank."""
    if RANK == SIZE - 1:
        time.sleep(LATE_S)
    return call()


def _allreduce(algorithm: str, count: int, rep: int) -> bool:
    data = make_data(RANK, count, rep, np.float64)
    got = late(lambda: mpicoll.allreduce(data, np.empty_like(data), algorithm=algorithm))
    return bits_equal(got, reference_reduce(all_inputs(count, rep, np.float64), "sum"))


def _reduce_scatter(algorithm: str, count: int, rep: int) -> bool:
    data = make_data(RANK, count, rep, np.float64)
    mine = np.array_split(np.arange(count), SIZE)[RANK]
    got = late(lambda: mpicoll.reduce_scatter(data, np.empty(mine.size), algorithm=algorithm))
    return bits_equal(got, reference_reduce(all_inputs(count, rep, np.float64), "sum")[mine])


def _allgather(algorithm: str, count: int, rep: int) -> bool:
    data = make_data(RANK, count, rep, np.float64)
    got = late(lambda: mpicoll.allgather(data, np.empty(count * SIZE), algorithm=algorithm))
    return bits_equal(got, np.concatenate(all_inputs(count, rep, np.float64)))


def _broadcast(algorithm: str, count: int, rep: int) -> bool:
    root = (rep + SIZE // 2) % SIZE
    buf = make_data(RANK, count, rep, np.float64)
    late(lambda: mpicoll.broadcast(buf, root=root, algorithm=algorithm))
    return bits_equal(buf, make_data(root, count, rep, np.float64))


def _reduce(algorithm: str, count: int, rep: int) -> bool:
    root = (rep + SIZE - 1) % SIZE
    data = make_data(RANK, count, rep, np.float64)
    out = np.empty_like(data)
    late(lambda: mpicoll.reduce(data, out, root=root, algorithm=algorithm))
    return RANK != root or bits_equal(
        out, reference_reduce(all_inputs(count, rep, np.float64), "sum"))


CHECKS = {"allreduce": _allreduce, "reduce_scatter": _reduce_scatter,
          "allgather": _allgather, "broadcast": _broadcast, "reduce": _reduce}
CASES = [(c, a) for c in CHECKS for a in mpicoll.algorithms(c)]


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_every_algorithm_gives_the_reference_with_sleeping_waits(collective, algorithm):
    check = CHECKS[collective]
    wrong = on_sleeping_thread(lambda: [(count, rep) for count in COUNTS for rep in range(2)
                                        if not check(algorithm, count, rep)])
    assert not wrong, f"{collective} {algorithm}: wrong bits at (count, rep) {wrong}"


def test_the_agreement_step_still_raises_on_every_rank():
    """A dtype that differs on one rank: MismatchError on every rank, the last one late."""
    dtype = np.float32 if RANK == 0 and SIZE > 1 else np.float64
    x = np.ones(5, dtype=dtype)
    if SIZE == 1:
        assert on_sleeping_thread(lambda: late(lambda: mpicoll.allreduce(x, check=True)))[0] \
            == 1.0
        return
    with pytest.raises(mpicoll.MismatchError, match="dtype"):
        on_sleeping_thread(lambda: late(lambda: mpicoll.allreduce(x, check=True)))
