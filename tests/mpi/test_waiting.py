"""Sleeping waits (mpicoll.waiting: how the runtime's lanes wait for MPI): every algorithm
of every collective, run on a thread that polls and sleeps instead of blocking in MPI
(MPI's own collectives also on a communicator where they start their non-blocking forms;
some also on a thread that polls on the core for a deadline), gives the reference's bits
while one rank comes late (past the spin and yield phases, so the others sleep), and the
agreement step's errors still reach every rank."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import waiting
from mpicoll.context import get_context

from cases import RANK, SIZE, all_inputs, bits_equal, make_data, reference_reduce

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("segment")]

COUNTS = sorted({0, 1, SIZE + 1, 211})
#: How late the last rank enters each case (seconds): past waiting.YIELD_S.
LATE_S = 3 * waiting.YIELD_S


def on_sleeping_thread(fn, sleeps: bool = True):
    """Run ``fn()`` on a new thread whose waits sleep (or, ``sleeps=False``, poll on the
    core because the thread carries a deadline, as a lane with ``MPICOLL_LANE_WAIT=spin``
    does); return its value or raise its error."""
    out: dict = {}

    def body() -> None:
        if sleeps:
            waiting.set_sleeps(True)
        else:
            waiting.set_deadline(time.perf_counter() + 600)
        assert waiting.polls() and waiting.sleeps() is sleeps
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


def _allreduce(algorithm: str, count: int, rep: int, comm) -> bool:
    data = make_data(RANK, count, rep, np.float64)
    got = late(lambda: mpicoll.allreduce(data, np.empty_like(data), algorithm=algorithm,
                                         comm=comm))
    return bits_equal(got, reference_reduce(all_inputs(count, rep, np.float64), "sum"))


def _reduce_scatter(algorithm: str, count: int, rep: int, comm) -> bool:
    data = make_data(RANK, count, rep, np.float64)
    mine = np.array_split(np.arange(count), SIZE)[RANK]
    got = late(lambda: mpicoll.reduce_scatter(data, np.empty(mine.size), algorithm=algorithm,
                                              comm=comm))
    return bits_equal(got, reference_reduce(all_inputs(count, rep, np.float64), "sum")[mine])


def _allgather(algorithm: str, count: int, rep: int, comm) -> bool:
    data = make_data(RANK, count, rep, np.float64)
    got = late(lambda: mpicoll.allgather(data, np.empty(count * SIZE), algorithm=algorithm,
                                         comm=comm))
    return bits_equal(got, np.concatenate(all_inputs(count, rep, np.float64)))


def _broadcast(algorithm: str, count: int, rep: int, comm) -> bool:
    root = (rep + SIZE // 2) % SIZE
    buf = make_data(RANK, count, rep, np.float64)
    late(lambda: mpicoll.broadcast(buf, root=root, algorithm=algorithm, comm=comm))
    return bits_equal(buf, make_data(root, count, rep, np.float64))


def _reduce(algorithm: str, count: int, rep: int, comm) -> bool:
    root = (rep + SIZE - 1) % SIZE
    data = make_data(RANK, count, rep, np.float64)
    out = np.empty_like(data)
    late(lambda: mpicoll.reduce(data, out, root=root, algorithm=algorithm, comm=comm))
    return RANK != root or bits_equal(
        out, reference_reduce(all_inputs(count, rep, np.float64), "sum"))


CHECKS = {"allreduce": _allreduce, "reduce_scatter": _reduce_scatter,
          "allgather": _allgather, "broadcast": _broadcast, "reduce": _reduce}
CASES = [(c, a, True) for c in CHECKS for a in mpicoll.algorithms(c)]
#: Polling on the core for a deadline: MPI's own collectives and one schedule of
#: mpicoll's (the same waits as every other).
SPINNING = [(c, "native", False) for c in CHECKS] + [("allreduce", "ring", False)]


@pytest.fixture(scope="module")
def nonblocking():
    """A communicator whose context is ``nonblocking``, as a torch.distributed group's:
    MPI's own collectives there start their non-blocking forms."""
    comm = MPI.COMM_WORLD.Dup()
    get_context(comm).nonblocking = True
    yield comm
    comm.Free()


@pytest.mark.parametrize("collective,algorithm,sleeps", CASES + SPINNING)
def test_every_algorithm_gives_the_reference_with_sleeping_waits(collective, algorithm,
                                                                 sleeps, nonblocking):
    """On the world's communicator, and for MPI's own collectives also on one where they
    start their non-blocking forms."""
    check = CHECKS[collective]
    for comm in (MPI.COMM_WORLD, nonblocking)[:1 + (algorithm == "native")]:
        wrong = on_sleeping_thread(lambda c=comm: [
            (count, rep) for count in COUNTS for rep in range(2)
            if not check(algorithm, count, rep, c)], sleeps)
        assert not wrong, (f"{collective} {algorithm} on {comm.Get_name()}: wrong bits at "
                           f"(count, rep) {wrong}")


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
