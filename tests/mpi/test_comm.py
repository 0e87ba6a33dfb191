"""mpicoll.Comm as a drop-in for mpi4py: existing code, every buffer-spec form."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import fastpath
from mpicoll.runtime import comms
from mpicoll.algorithms import registry

from cases import RANK, SIZE

pytestmark = pytest.mark.mpi


@pytest.fixture
def calls(monkeypatch):
    """Count runs of mpicoll's registered algorithms (to tell ours from delegation)."""
    counter = {"n": 0}
    real_bind = registry.bind

    def counting_bind(*args):
        run = real_bind(*args)

        def wrapped():
            counter["n"] += 1
            return run()

        return wrapped

    monkeypatch.setattr("mpicoll.collectives.bind", counting_bind)
    fastpath.invalidate()  # calls cached by earlier tests would bypass the counter
    yield counter
    fastpath.invalidate()  # nor may later tests run the counting wrappers


def mpi4py_style_program(comm):
    """Code written for mpi4py, unchanged: returns everything it computed."""
    out = {}
    x = np.arange(10, dtype="d") + comm.rank
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=MPI.SUM)
    out["plain"] = y.copy()
    comm.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE], op=MPI.MAX)
    out["typed"] = y.copy()
    comm.Allreduce([x, 4, MPI.DOUBLE], [y, 4, MPI.DOUBLE])
    out["count"] = y[:4].copy()
    comm.Allreduce([x, (3, 2), MPI.DOUBLE], [y, (3, 2), MPI.DOUBLE])
    out["displ"] = y[2:5].copy()
    z = x.copy()
    comm.Allreduce(MPI.IN_PLACE, z)
    out["inplace"] = z.copy()
    z = x.copy()
    comm.Allreduce(None, [z, MPI.DOUBLE], op=MPI.MIN)
    out["none_inplace"] = z.copy()
    comm.Allreduce([None, MPI.INT], [None, MPI.INT])
    ints = np.full(3, comm.rank + 1, dtype="i")
    res = np.empty(3, dtype="i")
    comm.Allreduce([ints, MPI.INT], [res, MPI.INT], op=MPI.PROD)
    out["prod"] = res.copy()
    raw = bytearray(np.full(4, comm.rank, dtype="i").tobytes())
    rres = bytearray(16)
    comm.Allreduce([raw, MPI.INT], [rres, MPI.INT])
    out["bytearray"] = np.frombuffer(bytes(rres), dtype="i").copy()
    rs = np.empty(2, dtype="d")
    comm.Reduce_scatter_block(np.arange(2 * comm.size, dtype="d") * (comm.rank + 1), rs)
    out["rsb"] = rs.copy()
    counts = [len(b) for b in np.array_split(np.arange(7), comm.size)]
    rsv = np.empty(counts[comm.rank], dtype="d")
    comm.Reduce_scatter(np.arange(7, dtype="d"), rsv, counts, MPI.SUM)
    out["rs"] = rsv.copy()
    ag = np.empty(3 * comm.size, dtype="l")
    comm.Allgather(np.full(3, comm.rank, dtype="l"), ag)
    out["allgather"] = ag.copy()
    ag2 = np.zeros(2 * comm.size, dtype="f")
    ag2[2 * comm.rank:2 * comm.rank + 2] = comm.rank
    comm.Allgather(MPI.IN_PLACE, [ag2, MPI.FLOAT])
    out["allgather_inplace"] = ag2.copy()
    # an explicit count in a spec holding every rank's block is one block's count (mpi4py);
    # the buffers hold one element more, which neither may touch
    ag3 = np.full(3 * comm.size + 1, -1, dtype="l")
    comm.Allgather(np.arange(3, dtype="l") + 10 * comm.rank, [ag3, 3, MPI.LONG])
    out["allgather_count"] = ag3.copy()
    ag4 = np.full(3 * comm.size + 1, -1, dtype="i")
    ag4[3 * comm.rank:3 * comm.rank + 3] = np.arange(3) + 10 * comm.rank
    comm.Allgather(MPI.IN_PLACE, [ag4, 3, MPI.INT])
    out["allgather_inplace_count"] = ag4.copy()
    rs2 = np.full(3, -1.0)
    comm.Reduce_scatter_block([np.arange(2 * comm.size + 1, dtype="d") + comm.rank, 2, MPI.DOUBLE],
                              [rs2, 2, MPI.DOUBLE])
    out["rsb_count"] = rs2.copy()
    rs3 = np.arange(2 * comm.size + 1, dtype="i") * (comm.rank + 2)
    comm.Reduce_scatter_block(MPI.IN_PLACE, [rs3, 2, MPI.INT])
    out["rsb_inplace_count"] = rs3[:2].copy()
    b = np.arange(5, dtype="i") if comm.rank == comm.size - 1 else np.zeros(5, dtype="i")
    comm.Bcast([b, MPI.INT], root=comm.size - 1)
    out["bcast"] = b.copy()
    r = np.empty(4, dtype="d") if comm.rank == 0 else None
    comm.Reduce(np.full(4, comm.rank, dtype="d"), r, op=MPI.SUM, root=0)
    out["reduce"] = None if r is None else r.copy()
    out["lower"] = comm.allreduce(comm.rank)
    return out


def test_existing_mpi4py_code_runs_unchanged(calls):
    ours = mpi4py_style_program(mpicoll.Comm(MPI.COMM_WORLD))
    ran_ours = calls["n"]
    native = mpi4py_style_program(MPI.COMM_WORLD)
    assert ours.keys() == native.keys()
    for key in ours:
        if ours[key] is None:
            assert native[key] is None, key
        else:
            np.testing.assert_array_equal(ours[key], native[key], err_msg=key)
    if SIZE > 1:
        assert ran_ours >= 10, f"only {ran_ours} collectives went through mpicoll"


@pytest.mark.parametrize("case", ["short send", "long send", "long recv", "in place"])
def test_reduce_scatter_counts_that_do_not_fit_raise_as_in_mpi4py(case):
    """mpi4py checks the counts against the buffers before any MPI call: so must Comm
    (it used the first elements of a longer buffer); the same error on every rank."""
    counts = [2] * SIZE
    send = np.arange(2 * SIZE + (case == "long send") - (case == "short send"), dtype="d")
    recv = np.empty(2 * SIZE + 1 if case == "in place" else 2 + (case == "long recv"))
    errors = []
    for comm in (MPI.COMM_WORLD, mpicoll.Comm(MPI.COMM_WORLD)):
        with pytest.raises(ValueError, match="mismatch") as info:
            comm.Reduce_scatter(MPI.IN_PLACE if case == "in place" else send, recv, counts)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_a_derived_datatype_of_one_type_without_gaps_pairs_with_that_type(calls):
    """MPI matches type signatures: a rank may describe its data with a contiguous
    derived type while another uses the predefined one. mpicoll takes both (the root's
    derived type went to MPI and the others to mpicoll: a hang)."""
    pair = MPI.INT.Create_contiguous(2).Commit()
    blocks = MPI.INT.Create_vector(2, 3, 3).Commit()    # a vector without stride gaps
    try:
        comm = mpicoll.Comm(MPI.COMM_WORLD)
        n = 1 << 14
        buf = np.arange(n, dtype="i") if RANK == 0 else np.zeros(n, dtype="i")
        comm.Bcast([buf, n // 2, pair] if RANK == 0 else [buf, n, MPI.INT], root=0)
        np.testing.assert_array_equal(buf, np.arange(n))
        got = np.full(6 * SIZE, -1, dtype="i")
        mine = np.arange(6, dtype="i") + 10 * RANK
        comm.Allgather(mine, [got, 1, blocks] if RANK == SIZE - 1 else [got, 6, MPI.INT])
        np.testing.assert_array_equal(got, np.concatenate([np.arange(6) + 10 * r
                                                           for r in range(SIZE)]))
        x = np.arange(8, dtype="i") * (RANK + 1)
        ours, theirs = np.empty_like(x), np.empty_like(x)
        comm.Allreduce([x, 4, pair], [ours, 4, pair], op=MPI.MAX)
        MPI.COMM_WORLD.Allreduce([x, 8, MPI.INT], [theirs, 8, MPI.INT], op=MPI.MAX)  # (MPICH
        # refuses MAX on a derived type: mpicoll reduces its elements)
        np.testing.assert_array_equal(ours, theirs)
    finally:
        pair.Free()
        blocks.Free()
    if SIZE > 1:
        assert calls["n"] == 3, "the derived types must go through mpicoll"


def test_unsupported_specs_delegate(calls):
    comm = mpicoll.Comm(MPI.COMM_WORLD)
    # MAXLOC on a pair type
    pair = np.array([(float(RANK), RANK)], dtype=np.dtype([("v", "d"), ("i", "i")], align=True))
    res = np.empty_like(pair)
    comm.Allreduce([pair, MPI.DOUBLE_INT], [res, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    assert res["v"][0] == SIZE - 1 and res["i"][0] == SIZE - 1
    # a user-defined op
    op = MPI.Op.Create(lambda a, b, t: np.copyto(np.frombuffer(b, "d"),
                                                  np.frombuffer(a, "d") + np.frombuffer(b, "d")),
                       commute=True)
    try:
        x = np.full(3, 1.0)
        y = np.empty(3)
        comm.Allreduce(x, y, op=op)
        np.testing.assert_array_equal(y, SIZE)
    finally:
        op.Free()
    # a derived datatype
    vec = MPI.DOUBLE.Create_vector(2, 1, 2).Commit()
    try:
        buf = np.arange(4, dtype="d") if RANK == 0 else np.zeros(4)
        comm.Bcast([buf, 1, vec], root=0)
        np.testing.assert_array_equal(buf[[0, 2]], [0.0, 2.0])
    finally:
        vec.Free()
    assert calls["n"] == 0, "unsupported specs must go to MPI itself"


def test_dup_is_mpicoll_comm_and_collective_algorithm():
    comm = mpicoll.Comm(MPI.COMM_WORLD, algorithm="ring")
    dup = comm.Dup()
    try:
        assert isinstance(dup, mpicoll.Comm) and isinstance(dup, MPI.Intracomm)
        assert dup.Get_size() == SIZE and dup.rank == RANK
        x = np.arange(6, dtype="d")
        y = np.empty_like(x)
        dup.Allreduce(x, y)
        np.testing.assert_array_equal(y, x * SIZE)
        # 'ring' is no broadcast algorithm: auto is used there
        dup.Bcast(y, root=0)
    finally:
        dup.Free()
    # every duplication keeps the settings (mpi4py made Clone, Dup_with_info and Idup's
    # results with Comm's defaults: algorithm auto, check off)
    checked = mpicoll.Comm(MPI.COMM_WORLD, algorithm="ring", check=True)
    idup, request = checked.Idup()
    request.Wait()
    for made in (checked.Clone(), checked.Dup_with_info(MPI.INFO_NULL), idup):
        assert isinstance(made, mpicoll.Comm)
        assert (made._mpicoll_algorithm, made._mpicoll_check) == ("ring", True)
        made.Free()


def test_a_duplicate_the_user_frees_leaves_the_runtime():
    """A ``Dup`` the user frees, through the Comm or through another object of its handle
    (as mpi4py's own test_subclass does): the runtime forgets it. It kept the record and
    its exit handler freed the handle again, which MPI reuses: a double free at exit
    (status 6 under MPICH), or another communicator freed behind the user's back."""
    comm = mpicoll.Comm(MPI.COMM_WORLD)
    for how in ("the comm", "another object"):
        dup = comm.Dup()
        handle = dup.handle
        assert comms.record_of(dup) is not None
        if how == "the comm":
            dup.Free()
        else:
            MPI.Comm.Free(MPI.Intracomm(dup))
        assert all(r.comm.handle != handle for r in comms.alive()), how


@pytest.mark.parametrize("check", [False, True])
def test_ops_mpicoll_lacks_go_to_mpi_also_when_checked(check):
    """A user-defined op and MPI's logical ops go to MPI (the module's rule), with
    ``check=True`` too: the checked path raised ``ValueError`` on every rank instead."""
    comm = mpicoll.Comm(MPI.COMM_WORLD, check=check)
    op = MPI.Op.Create(lambda a, b, t: np.copyto(np.frombuffer(b, "d"),
                                                  np.frombuffer(a, "d") + np.frombuffer(b, "d")),
                       commute=True)
    try:
        y = np.empty(3)
        comm.Allreduce(np.full(3, RANK + 1.0), y, op=op)
        np.testing.assert_array_equal(y, SIZE * (SIZE + 1) / 2)
    finally:
        op.Free()
    flags = np.array([RANK > 0, True], dtype=np.int32)
    both, either = np.empty(2, np.int32), np.empty(2, np.int32)
    comm.Allreduce(flags, both, op=MPI.LAND)
    comm.Reduce(flags, either, op=MPI.LOR, root=0)
    np.testing.assert_array_equal(both, [SIZE == 1 and RANK > 0, 1])
    if RANK == 0:
        np.testing.assert_array_equal(either, [SIZE > 1, 1])


def test_native_through_mpicoll_comm_does_not_recurse():
    """A context first created from an mpicoll.Comm must still reach MPI's own methods."""
    comm = mpicoll.Comm(MPI.COMM_WORLD.Dup(), algorithm="native")
    try:
        x = np.arange(5, dtype="d")
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        np.testing.assert_array_equal(y, x * SIZE)
        comm.Bcast(y, root=0)
        g = np.empty(5 * SIZE)
        comm.Allgather(x, g)
        np.testing.assert_array_equal(g, np.tile(x, SIZE))
    finally:
        comm.Free()


@pytest.mark.parametrize("root", [0, SIZE - 1])
def test_checked_comm_as_first_call_on_a_communicator(root):
    """A checked mpicoll.Comm making the first mpicoll call on its communicator: the
    context's private duplicate must be a plain communicator (it was an mpicoll.Comm with
    check=True, whose agreement step recursed forever; found by bench.soak, seed 15)."""
    comm = mpicoll.Comm(MPI.COMM_WORLD.Dup(), check=True)
    try:
        x = np.arange(7, dtype="d") + RANK
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        np.testing.assert_array_equal(y, np.arange(7) * SIZE + SIZE * (SIZE - 1) / 2)
        comm.Reduce(mpicoll.IN_PLACE if RANK == root else x, x if RANK == root else None,
                    root=root)
    finally:
        comm.Free()


@pytest.mark.parametrize("order", ["reversed", "subset"])
def test_runtime_create_group_ranks_follow_the_group(order):
    """``runtime.comms.create_group``: a group of every rank (made by ``MPI_Comm_split``)
    and a subset (``MPI_Comm_create_group``) give each member its rank in the group, and a
    collective over the result sums exactly the members' values."""
    from mpicoll.runtime import comms

    members = (list(range(SIZE))[::-1] if order == "reversed"
               else [r for r in range(SIZE) if r != SIZE - 1] or [0])
    world_group = MPI.COMM_WORLD.Get_group()
    group = world_group.Incl(members)
    world_group.Free()
    try:
        comm = (comms.create_group(MPI.COMM_WORLD, group, 7, "test") if RANK in members
                else MPI.COMM_NULL)
    finally:
        group.Free()
    if RANK not in members:
        return
    try:
        assert comm.Get_size() == len(members)
        assert comm.Get_rank() == members.index(RANK)
        got = comm.allreduce(RANK + 1)
        assert got == sum(m + 1 for m in members)
        assert comm.allgather(RANK) == members
    finally:
        comms.free(comm)
