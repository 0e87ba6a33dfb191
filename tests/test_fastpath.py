"""The cache of validated calls never lets a changed argument through (serial, 1 rank)."""
from __future__ import annotations


import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import config, fastpath


@pytest.fixture(autouse=True)
def clean_cache():
    fastpath.invalidate()
    yield
    fastpath.invalidate()


def test_repeated_call_hits_and_stays_correct():
    x = np.arange(5, dtype=np.int64)
    y = np.empty_like(x)
    for k in range(3):
        x[:] = k
        assert mpicoll.allreduce(x, y) is y
        assert y.tolist() == [k] * 5
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is not None


def test_new_array_with_a_dead_arrays_id_is_validated_again():
    for _ in range(50):
        x = np.ones(4, dtype=np.float32)
        y = np.empty(4, dtype=np.float32)
        mpicoll.allreduce(x, y)
        del y                  # freed at once (no cycle), its id free for reuse
        bad = np.empty(3, dtype=np.float32)  # may reuse the dead array's id
        with pytest.raises(ValueError, match="recvbuf has 3 elements"):
            mpicoll.allreduce(x, bad)


def test_output_made_read_only_after_caching_is_rejected():
    x = np.ones(4)
    y = np.empty(4)
    mpicoll.allreduce(x, y)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mpicoll.allreduce(x, y)


def test_settings_change_invalidates(monkeypatch):
    x = np.ones(4)
    y = np.empty(4)
    mpicoll.allreduce(x, y)
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is not None
    monkeypatch.setenv("MPICOLL_ALGORITHM", "ring")
    config.refresh()
    try:
        assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is None
        mpicoll.allreduce(x, y)
        assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is not None
    finally:
        monkeypatch.delenv("MPICOLL_ALGORITHM")
        config.refresh()


def test_checked_calls_are_not_cached():
    x = np.ones(4)
    y = np.empty(4)
    mpicoll.allreduce(x, y, check=True)
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is None
    assert not fastpath._calls


def test_allocating_allreduce_is_cached_and_returns_a_new_array_each_time():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    first = mpicoll.allreduce(x, op="average")
    assert fastpath.lookup("allreduce", x, None, "average", "auto", None) is not None
    results = [first]
    for k in range(3):
        x[...] = k
        got = mpicoll.allreduce(x, op="average")
        assert got.shape == x.shape and got.dtype == x.dtype
        assert got.tolist() == [[k] * 3] * 2
        assert all(got is not r for r in results)
        results.append(got)
    f = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    for _ in range(2):
        assert mpicoll.allreduce(f).tolist() == f.tolist()


def test_every_collective_is_cached_and_returns_its_result():
    x = np.arange(6, dtype=np.float64)
    y = np.empty_like(x)
    calls = [
        (("allreduce", x, y, "sum", "auto", None), lambda: mpicoll.allreduce(x, y)),
        (("reduce_scatter", x, y, "sum", "auto", None), lambda: mpicoll.reduce_scatter(x, y)),
        (("allgather", x, y, "auto", None), lambda: mpicoll.allgather(x, y)),
        # (a broadcast has one buffer: its key holds None in place of the second)
        (("broadcast", y, None, 0, "auto", None), lambda: mpicoll.broadcast(y, 0)),
        (("reduce", x, y, "sum", 0, "auto", None), lambda: mpicoll.reduce(x, y)),
    ]
    for key, call in calls:
        fill = x if key[0] == "broadcast" else -1  # one rank: broadcast leaves y alone
        y[:] = fill
        first = call()
        assert fastpath.lookup(*key) is not None, key[0]
        y[:] = fill
        assert call() is first is y, key[0]
        assert y.tolist() == x.tolist(), key[0]


def test_comm_methods_cache_arrays_but_never_mutable_specs():
    comm = mpicoll.Comm(MPI.COMM_SELF)
    x = np.arange(4, dtype=np.int32)
    y = np.empty_like(x)
    comm.Allreduce(x, y, MPI.SUM)
    assert fastpath.lookup("Comm.Allreduce", x, y, MPI.SUM, comm) is not None
    spec = [y, MPI.INT]
    comm.Allreduce(x, spec, MPI.SUM)
    other = np.zeros_like(x)
    spec[0] = other  # the same list object now names another buffer
    comm.Allreduce(x, spec, MPI.SUM)
    assert other.tolist() == x.tolist()


def test_large_buffers_are_not_cached_and_held_bytes_are_bounded():
    big = np.ones(fastpath.MAX_BYTES // 8 + 1, dtype=np.uint8)
    mpicoll.allreduce(big, np.empty_like(big))
    assert not fastpath._calls
    keep = []
    for i in range(fastpath.MAX_ENTRIES + 8):  # shapes differ: no call by shape applies
        x = np.ones(fastpath.MAX_BYTES // 16 + i, dtype=np.uint8)
        y = np.empty_like(x)
        keep.append((x, y))
        mpicoll.allreduce(x, y)
        assert fastpath._held_bytes <= fastpath.MAX_BYTES
        assert len(fastpath._calls) <= fastpath.MAX_ENTRIES
        assert len(fastpath._shaped) <= fastpath.MAX_ENTRIES
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is not None


def test_freeing_a_communicator_forgets_its_calls():
    comm = MPI.COMM_SELF.Dup()
    x = np.ones(3)
    y = np.empty(3)
    mpicoll.allreduce(x, y, comm=comm)
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", comm) is not None
    comm.Free()
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", comm) is None


def test_unchecked_call_never_lets_a_default_checked_call_skip_its_check(monkeypatch):
    from mpicoll import collectives  # noqa: PLC0415

    agreed = []
    real = collectives.agree
    monkeypatch.setattr(collectives, "agree",
                        lambda *a, **k: agreed.append(1) or real(*a, **k))
    monkeypatch.setenv("MPICOLL_CHECK", "1")
    config.refresh()
    try:
        x = np.ones(4)
        y = np.empty(4)
        mpicoll.allreduce(x, y, check=False)    # explicitly unchecked
        assert not agreed
        mpicoll.allreduce(x, y)                 # default: checked
        assert agreed
    finally:
        monkeypatch.delenv("MPICOLL_CHECK")
        config.refresh()


def test_the_public_path_runs_cached_calls_without_planning(monkeypatch):
    """What every public function and Comm method runs on a repeat: no plan, no validation."""
    from mpicoll import collectives  # noqa: PLC0415

    planned = []
    for name, plan in list(collectives._PLANS.items()):
        monkeypatch.setitem(collectives._PLANS, name,
                            lambda ctx, *a, _plan=plan, _name=name: (planned.append(_name),
                                                                    _plan(ctx, *a))[1])
    x = np.arange(6, dtype=np.int32)
    y = np.empty_like(x)
    comm = mpicoll.Comm(MPI.COMM_SELF)
    calls = {
        "allreduce": lambda: mpicoll.allreduce(x, y),
        "reduce_scatter": lambda: mpicoll.reduce_scatter(x, y),
        "allgather": lambda: mpicoll.allgather(x, y),
        "broadcast": lambda: mpicoll.broadcast(y, 0),
        "reduce": lambda: mpicoll.reduce(x, y),
        "Comm.Allreduce": lambda: comm.Allreduce(x, y, MPI.SUM),
        "Comm.Reduce_scatter_block": lambda: comm.Reduce_scatter_block(x, y, MPI.SUM),
        "Comm.Allgather": lambda: comm.Allgather(x, y),
        "Comm.Bcast": lambda: comm.Bcast(y, 0),
        "Comm.Reduce": lambda: comm.Reduce(x, y, MPI.SUM, 0),
    }
    for label, call in calls.items():
        planned.clear()
        for k in range(3):
            x[:] = np.arange(6) * (k + 2)
            y[:] = -1 if label not in ("broadcast", "Comm.Bcast") else x
            call()
            assert y.tolist() == x.tolist(), (label, k)
        assert len(planned) == 1, f"{label} planned {len(planned)} times in 3 calls"


def _count_plans(monkeypatch) -> list:
    from mpicoll import collectives  # noqa: PLC0415

    planned: list = []
    plan = collectives._PLANS["allreduce"]
    monkeypatch.setitem(collectives._PLANS, "allreduce",
                        lambda ctx, *a: (planned.append(1), plan(ctx, *a))[1])
    return planned


@pytest.mark.parametrize("form", ["new output", "given output", "Comm.Allreduce"])
def test_new_arrays_of_a_known_shape_run_without_planning(monkeypatch, form):
    """A loop passing new arrays each time (no identity hit) is planned once by shape,
    and every call still reads its own input and writes its own output."""
    planned = _count_plans(monkeypatch)
    comm = mpicoll.Comm(MPI.COMM_SELF)
    for k in range(4):
        x = np.arange(7, dtype=np.int32).reshape(7, 1) * (k + 3)
        if form == "new output":
            y = mpicoll.allreduce(x, op="average")
        else:
            y = np.full((7, 1), -1, dtype=np.int32)
            got = (comm.Allreduce(x, y, MPI.SUM) if form == "Comm.Allreduce"
                   else mpicoll.allreduce(x, y))
            assert got is (None if form == "Comm.Allreduce" else y)
        assert y.shape == (7, 1) and y is not x and not np.may_share_memory(x, y)
        assert y.ravel().tolist() == [i * (k + 3) for i in range(7)]
    assert len(planned) == 1


def test_calls_by_shape_send_other_layouts_and_bad_outputs_to_validation(monkeypatch):
    planned = _count_plans(monkeypatch)
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    mpicoll.allreduce(x, np.empty((3, 4)))
    assert len(planned) == 1
    fortran = np.asfortranarray(x * 2)  # not C-contiguous: planned, still right
    assert mpicoll.allreduce(fortran).tolist() == (x * 2).tolist()
    out = np.empty((3, 4))
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mpicoll.allreduce(x.copy(), out)
    with pytest.raises(TypeError, match="dtype"):
        mpicoll.allreduce(x.copy(), np.empty((3, 4), dtype=np.float32))
    same = x.copy()  # sendbuf and recvbuf the same memory: in place, planned
    assert mpicoll.allreduce(same, same[...]).tolist() == x.tolist()
    wide = np.zeros(24)  # overlapping without being the same buffer
    with pytest.raises(ValueError, match="overlap"):
        mpicoll.allreduce(wide[:12].reshape(3, 4), wide[6:18].reshape(3, 4))
    assert len(planned) == 6


def test_calls_by_shape_are_forgotten_with_the_cache(monkeypatch):
    planned = _count_plans(monkeypatch)
    mpicoll.allreduce(np.ones(5))
    fastpath.invalidate()
    mpicoll.allreduce(np.ones(5))
    assert len(planned) == 2


def test_the_same_arrays_again_go_to_the_identity_cache():
    """A loop over the same arrays ends on the cheaper identity cache even when a call by
    shape took them first (a first call of their shape with other arrays, an eviction)."""
    mpicoll.allreduce(np.ones(5), np.empty(5))  # plans shape (5,)
    x, y = np.arange(5.0), np.empty(5)
    mpicoll.allreduce(x, y)  # by shape
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is None
    mpicoll.allreduce(x, y)  # the same arrays again: planned, cached by identity
    assert fastpath.lookup("allreduce", x, y, "sum", "auto", None) is not None
    assert mpicoll.allreduce(x, y).tolist() == [0, 1, 2, 3, 4]


def _by_shape(mode=fastpath.OUTPUT, writable=True, dtype=np.dtype(np.float64)):
    ran = []
    call = fastpath.by_shape(fastpath.Shaped(lambda a, out: ran.append((a, out)), dtype,
                                             (2, 3), mode, writable))
    return call, ran


def test_a_call_by_shape_refuses_what_validation_would_question():
    """Everything a new array can get wrong leaves the call by shape before it runs."""
    call, ran = _by_shape()
    x = np.ones((2, 3))
    ro = np.empty((2, 3))
    ro.flags.writeable = False
    wide = np.zeros(12)
    refused = {
        "not C-contiguous input": (np.asfortranarray(x), np.empty((2, 3))),
        "not C-contiguous output": (x, np.empty((3, 2)).T),
        "read-only output": (x, ro),
        "other output dtype": (x, np.empty((2, 3), np.float32)),
        "overlapping output": (wide[:6].reshape(2, 3), wide[3:9].reshape(2, 3)),
        "output is the input": (x, x),
    }
    for what, (a, b) in refused.items():
        assert call(a, b) is fastpath.MISS, what
    assert not ran
    y = np.empty((2, 3))
    assert call(x, y) is y and ran[-1] == (x, y)
    assert call(x, y) is fastpath.MISS   # the same arrays again: the identity cache's
    made = call(x.copy(), None)          # no output given: a new one of the planned shape
    assert made.shape == (2, 3) and made.dtype == np.float64 and made is not y


def test_calls_by_shape_without_an_output_and_in_place():
    call, ran = _by_shape(fastpath.INPUT_ONLY)   # a reduce off its root
    x = np.ones(4)
    assert call(x, None) is None and ran == [(x, None)]
    call, ran = _by_shape(fastpath.INOUT, writable=True)  # a broadcast off its root
    ro = np.ones(4)
    ro.flags.writeable = False
    assert call(ro, None) is fastpath.MISS and not ran
    assert call(x, None) is x
    call, ran = _by_shape(fastpath.INOUT, writable=False)  # the broadcast's root
    assert call(ro, None) is ro and ran == [(ro, None)]


def test_every_collective_runs_new_arrays_by_shape(monkeypatch):
    """New arrays of a known shape on each call: planned once, for every collective and
    Comm method, with or without an output; each call reads its own input."""
    planned = _count_all_plans(monkeypatch)
    comm = mpicoll.Comm(MPI.COMM_SELF)
    forms = {
        "allreduce": lambda x, y: mpicoll.allreduce(x, y, op="average"),
        "reduce_scatter": lambda x, y: mpicoll.reduce_scatter(x, y),
        "allgather": lambda x, y: mpicoll.allgather(x, y),
        "reduce": lambda x, y: mpicoll.reduce(x, y, op="max"),
        "Comm.Allreduce": lambda x, y: comm.Allreduce(x, y, MPI.SUM) or y,
        "Comm.Reduce_scatter_block": lambda x, y: comm.Reduce_scatter_block(x, y) or y,
        "Comm.Allgather": lambda x, y: comm.Allgather(x, y) or y,
        "Comm.Reduce": lambda x, y: comm.Reduce(x, y, MPI.SUM, 0) or y,
    }
    for label, call in forms.items():
        for new_output in (False, True):
            if new_output and label.startswith("Comm."):
                continue
            planned.clear()
            for k in range(3):
                x = np.arange(10, dtype=np.int32).reshape(2, 5) * (k + 2)
                y = None if new_output else np.full((2, 5), -1, dtype=np.int32)
                got = call(x, y)
                assert got is not x and (new_output or got is y), label
                assert got.reshape(-1).tolist() == x.reshape(-1).tolist(), (label, k)
            assert len(planned) == 1, f"{label} planned {len(planned)} times in 3 calls"
    planned.clear()
    for k in range(3):
        buf = np.full((2, 5), k)
        assert mpicoll.broadcast(buf) is buf and comm.Bcast(buf.copy()) is None
    assert planned == ["broadcast"] * 2


def _count_all_plans(monkeypatch) -> list:
    from mpicoll import collectives  # noqa: PLC0415

    planned: list = []
    for name, plan in list(collectives._PLANS.items()):
        monkeypatch.setitem(collectives._PLANS, name,
                            lambda ctx, *a, _plan=plan, _name=name: (planned.append(_name),
                                                                    _plan(ctx, *a))[1])
    return planned


def test_the_record_counts_each_call_once(monkeypatch):
    """With the stall inspector's record on, every call (identity cache, by shape, new
    output, planned, and a call by shape refused for the slow path) is numbered once."""
    from mpicoll import tracking  # noqa: PLC0415
    from mpicoll.context import get_context  # noqa: PLC0415

    monkeypatch.setattr(tracking, "INSPECTED", True)
    fastpath.invalidate()
    comm = MPI.COMM_SELF.Dup()
    try:
        tracker = get_context(comm).tracker
        x, x2, y = np.ones(4), np.ones(4), np.empty(4)
        calls = [lambda: mpicoll.allreduce(x, y, comm=comm),         # planned
                 lambda: mpicoll.allreduce(x, y, comm=comm),         # identity
                 lambda: mpicoll.allreduce(x2, y, comm=comm),        # by shape
                 lambda: mpicoll.allreduce(x2, y, comm=comm),        # refused: planned
                 lambda: mpicoll.allreduce(x2, y, comm=comm),        # identity
                 lambda: mpicoll.allreduce(x, comm=comm),            # new output
                 lambda: mpicoll.broadcast(y, comm=comm),
                 lambda: mpicoll.broadcast(y.copy(), comm=comm)]
        for k, call in enumerate(calls, 1):
            call()
            assert (tracker.entered, tracker.done) == (k, k), k
            assert tracker.info(k).collective == ("allreduce" if k < 7 else "broadcast")
    finally:
        comm.Free()
