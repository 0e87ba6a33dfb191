"""The node's shared window (mpicoll.node_window) on the real node layout: the barrier that
sleeps in the kernel under skewed arrivals on polling threads, the agreement through the
mailboxes, the MPI fallback agreed by every rank, counters that wrap, and groups freed in a
different order on each rank."""
from __future__ import annotations

import os
import platform
import sys
import threading
import time

import numpy as np
import pytest
from cases import (
    COMM,
    RANK,
    SIZE,
    all_inputs,
    make_data,
    reference_reduce,
    same_on_all_ranks,
)

import mpicoll
from mpicoll import config, node_window, waiting
from mpicoll.context import get_context
from mpicoll.runtime import failures

pytestmark = pytest.mark.mpi

#: Where the barrier must sleep in the kernel: a silent fallback to MPI fails the tests
#: (the suite run with ``MPICOLL_NODE_WAIT=mpi`` checks the MPI barrier instead).
KERNEL_HERE = (sys.platform.startswith("linux") and platform.machine() == "x86_64"
               and not failures.ENABLED and os.environ.get("MPICOLL_NODE_WAIT") != "mpi")


@pytest.fixture
def real_node(monkeypatch):
    """A fresh communicator on the real node layout, with windows of 1 KiB slots (many
    chunks); freed afterwards."""
    monkeypatch.delenv("MPICOLL_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("MPICOLL_SHM_CHUNK_BYTES", "1024")
    config.refresh()
    comm = COMM.Dup()
    yield comm
    comm.Free()
    monkeypatch.undo()
    config.refresh()


def on_polling_thread(fn):
    """Run ``fn`` on a thread that waits as a runtime lane does; re-raise its error."""
    box = {}

    def run():
        waiting.set_sleeps(True)
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def test_kernel_waits_where_the_platform_has_them(real_node):
    mpicoll.allreduce(np.ones(3), comm=real_node, algorithm="shm")
    window = node_window.node_window(get_context(real_node))
    assert window.kernel is KERNEL_HERE
    table = node_window.node_table(get_context(real_node))
    assert (table is not None) is (KERNEL_HERE and SIZE > 1)


@pytest.mark.parametrize("count", [1, 13, 1000, 4099])
def test_late_ranks_on_polling_threads(real_node, count):
    """Each repetition another rank arrives 3 ms late (in turn), on threads that sleep
    between polls; shm in many chunks gives every rank the reference, bit for bit."""
    def run():
        for rep in range(2 * SIZE):
            data = make_data(RANK, count, rep, np.int64)
            expected = reference_reduce(all_inputs(count, rep, np.int64), "sum")
            if rep % SIZE == RANK:
                time.sleep(0.003)
            got = mpicoll.allreduce(data, op="sum", comm=real_node, algorithm="shm")
            assert np.array_equal(got, expected), (count, rep)
            assert same_on_all_ranks(got)
    on_polling_thread(run)


def test_agreement_through_the_window(real_node):
    """Checked calls on one node agree through the mailboxes: a mismatch and a bad argument
    on one rank raise on every rank, and a good call after them goes through."""
    last = SIZE - 1
    x = np.arange(5 + (RANK == last and SIZE > 1), dtype=np.float64)
    if SIZE > 1:
        with pytest.raises(mpicoll.MismatchError, match="count"):
            on_polling_thread(lambda: mpicoll.allreduce(x, comm=real_node, check=True))
        bad = "nosuchop" if RANK == last else "sum"
        expected = ValueError if RANK == last else mpicoll.RemoteError
        with pytest.raises(expected):
            on_polling_thread(lambda: mpicoll.allreduce(np.ones(5), op=bad, comm=real_node,
                                                        check=True))
    for rep in range(3):
        got = on_polling_thread(lambda rep=rep: mpicoll.allreduce(np.full(5, RANK + rep),
                                                                  comm=real_node, check=True))
        assert np.array_equal(got, np.full(5, sum(range(SIZE)) + SIZE * rep))


def test_mpi_on_one_rank_is_mpi_on_all(real_node, monkeypatch):
    """MPICOLL_NODE_WAIT=mpi on the last rank only: every rank's window waits in MPI and
    agrees by MPI_Allgather, and the results stay right."""
    if RANK == SIZE - 1:
        monkeypatch.setenv("MPICOLL_NODE_WAIT", "mpi")
        config.refresh()
    data = make_data(RANK, 211, 0, np.int64)
    got = mpicoll.allreduce(data, op="sum", comm=real_node, algorithm="shm", check=True)
    assert np.array_equal(got, reference_reduce(all_inputs(211, 0, np.int64), "sum"))
    assert node_window.node_window(get_context(real_node)).kernel is False
    assert node_window.node_table(get_context(real_node)) is None


def test_a_barrier_that_waits_past_its_deadline_raises(real_node):
    """A rank whose thread carries a deadline (a runtime lane's timeout) stops waiting in
    the kernel barrier for a peer that comes too late, with ``waiting.Expired``; the peer,
    arriving later, finds its part done, and the window goes on working."""
    if SIZE == 1 or not KERNEL_HERE:
        pytest.skip("needs peers and the kernel's waits")
    window = node_window.node_window(get_context(real_node))
    real_node.Barrier()
    if RANK == 0:
        before = waiting.set_deadline(time.perf_counter() + 0.2)
        start = time.monotonic()
        try:
            with pytest.raises(waiting.Expired):
                window.barrier()
        finally:
            waiting.set_deadline(before)
        assert 0.15 < time.monotonic() - start < 2.0
        real_node.Barrier()      # the others come to the window's barrier after this
    else:
        real_node.Barrier()
        window.barrier()         # rank 0 has arrived already: passes at once
    data = make_data(RANK, 4099, 2, np.int64)
    got = on_polling_thread(lambda: mpicoll.allreduce(data, op="sum", comm=real_node,
                                                      algorithm="shm"))
    assert np.array_equal(got, reference_reduce(all_inputs(4099, 2, np.int64), "sum"))


def test_counters_wrap(real_node):
    """Barriers go on across the counters' 2**32 wrap (every rank's counter set just below
    it between two MPI barriers)."""
    window = node_window.node_window(get_context(real_node))
    real_node.Barrier()
    window.bells[window.rank][0] = 2**32 - 2
    real_node.Barrier()
    data = make_data(RANK, 4099, 1, np.int64)
    for _ in range(3):      # 5 chunks of 2 barriers each: through the wrap
        got = on_polling_thread(lambda: mpicoll.allreduce(data, op="sum", comm=real_node,
                                                          algorithm="shm"))
        assert np.array_equal(got, reference_reduce(all_inputs(4099, 1, np.int64), "sum"))
    if SIZE > 1:        # one rank copies without the window
        assert int(window.bells[window.rank][0]) < 2**31


def test_windows_freed_in_any_order(real_node):
    """Two communicators with windows, freed in the opposite order on odd ranks: a window's
    free is local (an MPI window's free is collective, and torch destroys a rank's groups in
    its own order)."""
    comms = [real_node.Dup(), real_node.Dup()]
    for comm in comms:
        mpicoll.allreduce(np.ones(7), comm=comm, algorithm="shm", check=True)
    for comm in comms if RANK % 2 == 0 else comms[::-1]:
        comm.Free()
    real_node.Barrier()


@pytest.mark.parametrize("differs", ["count", "dtype", "none"])
def test_shm_allreduce_whose_ranks_disagree_raises_on_every_rank(real_node, differs):
    """Unchecked, ranks of a node whose counts (or dtypes of one item size) differ raise
    MismatchError alike, naming each rank's; they returned other ranks' data, silently."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    last = RANK == SIZE - 1
    count = 3000 + (differs == "count" and last)      # several 1 KiB chunks
    dtype = np.int32 if differs == "dtype" and last else np.float32
    x = np.ones(count, dtype)
    for _ in range(2):                                # and the window goes on after it
        if differs == "none":
            y = mpicoll.allreduce(x, comm=real_node, algorithm="shm", check=False)
            assert (y == SIZE).all()
            continue
        with pytest.raises(mpicoll.MismatchError, match="different counts or dtypes") as info:
            mpicoll.allreduce(x, comm=real_node, algorithm="shm", check=False)
        assert len(info.value.details) == SIZE
        assert ("int32" if differs == "dtype" else "3001") in str(info.value)
    y = mpicoll.allreduce(np.ones(5000), comm=real_node, algorithm="shm")
    assert (y == SIZE).all()


def test_a_window_freed_while_a_rank_waits_in_its_barrier_raises(real_node):
    """Another thread frees the window (a client's shutdown after a peer left) while this
    rank waits in its barrier for a peer that never comes: CollectiveError (an IndexError
    before, or with the fix's references alone, a wait forever)."""
    if SIZE == 1 or not KERNEL_HERE:
        pytest.skip("needs two ranks and the kernel's waits")
    win = node_window.NodeWindow(real_node, 0)
    if RANK == 0:
        timer = threading.Timer(0.5, win.free)
        timer.start()
        with pytest.raises(mpicoll.CollectiveError, match="freed while this rank waited"):
            win.barrier()
        timer.join()
    else:
        win.free()
    real_node.Barrier()


def test_the_shared_file_goes_when_a_peer_fails_while_it_is_set_up(monkeypatch):
    """_map_shared: the node's rank 0 removes its file even when a collective of the
    set-up raises (a peer died there): it was left in /dev/shm."""
    made = []
    real = node_window.tempfile.mkstemp

    def mkstemp(**kwargs):
        fd, path = real(**kwargs)
        made.append(path)
        return fd, path

    class Dying:
        def Get_rank(self):
            return 0

        def bcast(self, value, root):
            return value

        def allgather(self, value):
            raise RuntimeError("a peer failed")

    monkeypatch.setattr(node_window.tempfile, "mkstemp", mkstemp)
    with pytest.raises(RuntimeError, match="a peer failed"):
        node_window._map_shared(Dying(), 4096)
    assert len(made) == 1 and not os.path.exists(made[0])
