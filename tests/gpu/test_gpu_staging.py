"""The staged pipeline on the host: chunks, packing, overlap order, slot reuse, errors.

Numpy arrays stand in for device arrays (:class:`doubles.device_copies.SimulatedCopies`,
whose streams run queued copies only when forced, so a missing wait gives a wrong
result), and threads stand in for ranks (``gpu_helpers.SimulatedWorld``: the host
collectives meet at a barrier and check that every rank made the same calls).
"""
from __future__ import annotations

import numpy as np
import pytest

from doubles.device_copies import SimulatedCopies
from gpu_helpers import SimulatedWorld, assert_overlap, log_index, rank_data, reference
from mpicoll import IN_PLACE, config
from mpicoll.gpu import staging
from mpicoll.gpu.numpy_copies import NumpyCopies
from mpicoll.gpu.slots import HostSlots
from mpicoll.partition import block_bounds

COLLECTIVES = staging.COLLECTIVES


def _counts(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), n, n + 1, 13, 97})


def _call(collective: str, world: SimulatedWorld, rank: int, inputs: list[np.ndarray],
          variant: str, copies: SimulatedCopies, chunk_bytes: int, pipeline: bool,
          root: int = 0) -> tuple[object, np.ndarray | None]:
    """One staged call of ``rank``; returns (what staged returned, the result array)."""
    size = world.size
    x = inputs[rank].copy()
    kw = dict(comm=world.comm(rank), copies=copies, chunk_bytes=chunk_bytes,
              pipeline=pipeline, staging_limit=1 << 20)
    host = world.host_call(collective, rank)
    if collective == "allreduce":
        if variant == "inplace":
            out = staging.staged(collective, (IN_PLACE, x, "sum"), host, **kw)
            return out, x
        if variant == "new":
            out = staging.staged(collective, (x, None, "sum"), host, **kw)
            return out, out
        y = np.full_like(x, 99)
        return staging.staged(collective, (x, y, "sum"), host, **kw), y
    if collective == "reduce":
        if variant == "inplace" and rank == root:
            return staging.staged(collective, (IN_PLACE, x, "sum", root), host, **kw), x
        if variant == "new" or rank != root:
            out = staging.staged(collective, (x, None, "sum", root), host, **kw)
            return out, out
        y = np.full_like(x, 99)
        return staging.staged(collective, (x, y, "sum", root), host, **kw), y
    if collective == "broadcast":
        buf = x if rank == root else np.full_like(x, 99)
        return staging.staged(collective, (buf, root), host, **kw), buf
    if collective == "reduce_scatter":
        b = block_bounds(x.size, size)
        if variant == "inplace":
            out = staging.staged(collective, (IN_PLACE, x, "sum"), host, **kw)
            return out, x[:b[rank + 1] - b[rank]]
        if variant == "new":
            out = staging.staged(collective, (x, None, "sum"), host, **kw)
            return out, out
        y = np.full(b[rank + 1] - b[rank], 99, x.dtype)
        return staging.staged(collective, (x, y, "sum"), host, **kw), y
    if collective == "allgather":
        c = x.size
        if variant == "inplace":
            y = np.full(c * size, 99, x.dtype)
            y[rank * c:(rank + 1) * c] = x
            return staging.staged(collective, (IN_PLACE, y), host, **kw), y
        if variant == "new":
            out = staging.staged(collective, (x, None), host, **kw)
            return out, out
        y = np.full(c * size, 99, x.dtype)
        return staging.staged(collective, (x, y), host, **kw), y
    raise ValueError(collective)


def _run_world(collective: str, size: int, count: int, variant: str, mode: str,
               chunk_bytes: int, pipeline: bool = True, dtype=np.int32, root: int = 0,
               reps: int = 2, copies: list | None = None) -> list[SimulatedCopies]:
    world = SimulatedWorld(size)
    copies = copies or [SimulatedCopies(mode) for _ in range(size)]
    for rep in range(reps):  # every call twice: nothing stale between calls
        inputs = [rank_data(r, count, dtype, rep) for r in range(size)]

        def body(r: int, inputs: list = inputs) -> tuple:
            return _call(collective, world, r, inputs, variant, copies[r], chunk_bytes,
                         pipeline, root)

        results = world.run(body)
        for r, (returned, got) in enumerate(results):
            want = reference(collective, inputs, r, root)
            if want is None:
                assert returned is None, f"rank {r} is not the root: returns None"
                continue
            np.testing.assert_array_equal(np.asarray(got).reshape(-1), want,
                                          err_msg=f"{collective} rank {r} rep {rep}")
            if variant != "inplace" or collective == "reduce_scatter":
                assert returned is not None
            assert getattr(copies[r], "pending", int)() == 0, \
                "copies still queued after the call returned"
    # matching host calls on every rank (the world checks counts call by call, too)
    assert all(len(c) == len(world.calls[0]) for c in world.calls), world.calls
    return copies


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_every_collective_every_count_small_chunks(collective: str, size: int) -> None:
    for count in _counts(size * 3):
        for variant in ("out", "inplace", "new"):
            _run_world(collective, size, count, variant, "lazy", chunk_bytes=12)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("pipeline", [True, False])
def test_many_chunks_both_stream_modes(collective: str, mode: str, pipeline: bool) -> None:
    copies = _run_world(collective, 3, 1000, "out", mode, chunk_bytes=64, pipeline=pipeline)
    assert sum(1 for op in copies[0].log if op[0] == "wait") > 10  # many chunks ran


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_host_ranks_make_the_same_chunked_calls(collective: str) -> None:
    """Ranks whose buffers are on the host (NumpyCopies: plain copies into host slots, as
    mpicoll.torch's host ranks when another rank stages) next to staging ranks."""
    copies = [SimulatedCopies(), NumpyCopies(HostSlots(lambda n: np.empty(n, np.uint8))),
              SimulatedCopies()]
    for variant in ("out", "inplace"):
        _run_world(collective, 3, 101, variant, "lazy", chunk_bytes=40, copies=copies,
                   root=1)
    assert sum(1 for e in copies[0].log if e[0] == "wait") > 2 * 5


@pytest.mark.parametrize("collective", ["reduce", "broadcast"])
@pytest.mark.parametrize("root", [1, 2])
def test_roots_other_than_zero(collective: str, root: int) -> None:
    _run_world(collective, 3, 101, "out", "lazy", chunk_bytes=40, root=root)
    if collective == "reduce":
        _run_world(collective, 3, 101, "inplace", "lazy", chunk_bytes=40, root=root)


@pytest.mark.parametrize("dtype", [np.float64, np.int8, np.uint16, np.complex64])
def test_dtypes(dtype) -> None:
    for collective in COLLECTIVES:
        _run_world(collective, 2, 77, "out", "lazy", chunk_bytes=24, dtype=dtype, reps=1)


def test_fortran_order_and_shapes() -> None:
    world = SimulatedWorld(2)
    xs = [np.asfortranarray(rank_data(r, 60).reshape(6, 10)) for r in range(2)]

    def body(r: int):
        return staging.staged("allreduce", (xs[r], None, "sum"),
                              world.host_call("allreduce", r), comm=world.comm(r),
                              copies=SimulatedCopies(), chunk_bytes=16)

    outs = world.run(body)
    want = xs[0] + xs[1]
    for out in outs:
        assert out.shape == (6, 10) and out.flags.f_contiguous
        np.testing.assert_array_equal(out, want)

    # a new all-gather result's rows are every rank's block in C order, as on the host
    for shape in [(6, 10), (2, 3, 5)]:
        world3 = SimulatedWorld(3)
        blocks = [np.asfortranarray(rank_data(r, int(np.prod(shape))).reshape(shape))
                  for r in range(3)]

        def gather(r: int, blocks: list = blocks, world3: SimulatedWorld = world3):
            return staging.staged("allgather", (blocks[r], None),
                                  world3.host_call("allgather", r), comm=world3.comm(r),
                                  copies=SimulatedCopies(), chunk_bytes=16)

        for out in world3.run(gather):
            assert out.flags.c_contiguous
            np.testing.assert_array_equal(out, np.concatenate(blocks))


def _logged_run(collective: str, count: int, chunk_bytes: int, pipeline: bool = True):
    copies = SimulatedCopies("lazy")
    x = rank_data(0, count, np.int32)

    def host(args: tuple) -> None:
        copies.log.append(("host", "", len([e for e in copies.log if e[0] == "host"])))

    args = {"allreduce": (x, None, "sum"), "reduce": (x, None, "sum", 0),
            "broadcast": (x, 0), "reduce_scatter": (x, None, "sum"),
            "allgather": (x, None)}[collective]
    staging.staged(collective, args, host, comm=SimulatedWorld(1).comm(0), copies=copies,
                   chunk_bytes=chunk_bytes, pipeline=pipeline, staging_limit=1 << 20)
    return copies.log


@pytest.mark.parametrize("collective", ["allreduce", "reduce", "reduce_scatter",
                                        "allgather"])
def test_order_of_operations_gives_the_overlap(collective: str) -> None:
    log = _logged_run(collective, 100, chunk_bytes=40)  # 10 int32 per slot: 10 chunks
    assert_overlap(log, staging.NSLOTS)


def test_broadcast_order_at_root_and_elsewhere() -> None:
    log = _logged_run("broadcast", 100, chunk_bytes=40)
    assert any(e[0] == "d2h" for e in log) and not any(e[0] == "h2d" for e in log)


def test_unpipelined_runs_chunks_one_after_another() -> None:
    log = _logged_run("allreduce", 100, chunk_bytes=40, pipeline=False)
    chunks = sum(1 for e in log if e[0] == "host")
    for k in range(1, chunks):
        assert log_index(log, "wait", k - 1) < log_index(log, "h2d", k - 1) \
            < log_index(log, "d2h", k)
    assert not any(e[0] == "stream_wait" for e in log)  # one slot, always drained


def test_the_simulation_catches_a_missing_slot_wait(monkeypatch) -> None:
    """Without the d2h stream's wait for the slot's h2d, lazy streams corrupt results."""
    monkeypatch.setattr(SimulatedCopies, "stream_wait", lambda self, stream, event: None)
    with pytest.raises(AssertionError):
        _run_world("allreduce", 2, 1000, "out", "lazy", chunk_bytes=64, reps=1)


def test_the_simulation_catches_a_missing_host_wait(monkeypatch) -> None:
    monkeypatch.setattr(SimulatedCopies, "wait", lambda self, event: None)
    with pytest.raises(AssertionError):
        _run_world("allreduce", 2, 100, "out", "lazy", chunk_bytes=64, reps=1)


def test_chunk_elements() -> None:
    # automatic: about 1/8 of the rows, at least MIN_CHUNK_BYTES, at most limit/3
    assert staging.chunk_elements(1 << 26, 4, 1, None, 64 << 20) == (64 << 20) // 3 // 4
    assert staging.chunk_elements(1 << 22, 4, 1, None, 64 << 20) == (1 << 22) // 8
    assert staging.chunk_elements(1000, 4, 1, None, 64 << 20) == 1000
    assert staging.chunk_elements(0, 4, 1, None, 64 << 20) == 1
    # explicit slot bytes, per width
    assert staging.chunk_elements(1000, 4, 1, 40, 1 << 20) == 10
    assert staging.chunk_elements(1000, 4, 5, 40, 1 << 20) == 2
    assert staging.chunk_elements(1000, 8, 1, 1, 1 << 20) == 1
    # the bound wins over an explicit size
    assert staging.chunk_elements(1 << 20, 1, 1, 1 << 20, 3 * 1000) == 1000


def test_pinned_memory_stays_bounded() -> None:
    copies = SimulatedCopies()
    limit = 3 * 4096
    x = rank_data(0, 100_000, np.int32)
    staging.staged("allreduce", (x, None, "sum"), lambda a: None,
                   comm=SimulatedWorld(1).comm(0), copies=copies, staging_limit=limit)
    assert 0 < copies.host_pool.held_bytes <= limit
    # an explicit chunk above the bound is cut down to it
    staging.staged("allreduce", (x, None, "sum"), lambda a: None,
                   comm=SimulatedWorld(1).comm(0), copies=copies, staging_limit=limit,
                   chunk_bytes=1 << 20)
    assert copies.host_pool.held_bytes <= limit


def test_host_views_are_reused_across_calls() -> None:
    """The same numpy objects reach the host collective on every call (fastpath hits)."""
    copies = SimulatedCopies()
    x = rank_data(0, 1000, np.int32)
    seen: list[list[int]] = [[], []]
    for rep in range(2):
        staging.staged("allreduce", (IN_PLACE, x, "sum"),
                       lambda a, rep=rep: seen[rep].append(id(a[1])),
                       comm=SimulatedWorld(1).comm(0), copies=copies, chunk_bytes=400)
    assert seen[0] == seen[1] and len(seen[0]) == 10


def test_environment_settings(monkeypatch) -> None:
    """Read through mpicoll.config: cached until :func:`mpicoll.config.refresh`."""
    def setenv(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        config.refresh()

    try:
        setenv("MPICOLL_STAGING_BYTES", "3000")
        setenv("MPICOLL_STAGING_CHUNK_BYTES", "400")
        assert staging.staging_bytes() == 3000
        assert staging.chunk_bytes_setting() == 400
        monkeypatch.setenv("MPICOLL_STAGING_CHUNK_BYTES", "auto")
        assert staging.chunk_bytes_setting() == 400          # cached ...
        config.refresh()
        assert staging.chunk_bytes_setting() is None         # ... until refreshed
        setenv("MPICOLL_STAGING_BYTES", "lots")
        with pytest.raises(ValueError, match="MPICOLL_STAGING_BYTES='lots'"):
            staging.staging_bytes()
        setenv("MPICOLL_STAGING_BYTES", "2")
        with pytest.raises(ValueError, match="MPICOLL_STAGING_BYTES=2 must be >= 3"):
            staging.staging_bytes()
    finally:
        monkeypatch.undo()
        config.refresh()


BAD = [
    ("allreduce", lambda x: (x, np.zeros(3, np.int32), "sum"), ValueError,
     "recvbuf has 3 elements but 8 are needed"),
    ("allreduce", lambda x: (x, np.zeros(8, np.float32), "sum"), TypeError,
     "recvbuf has dtype float32 but sendbuf has dtype int32"),
    ("allreduce", lambda x: (IN_PLACE, None, "sum"), ValueError, "recvbuf is required"),
    ("allreduce", lambda x: (x.astype("U1"), None, "sum"), TypeError, "sendbuf has dtype"),
    ("reduce", lambda x: (x, None, "sum", 5), ValueError, "root=5 is out of range"),
    ("reduce", lambda x: (IN_PLACE, x, "sum", 1), ValueError, "only the root may reduce"),
    ("broadcast", lambda x: (x, "0"), TypeError, "root must be an int"),
    ("reduce_scatter", lambda x: (x, np.zeros(9, np.int32), "sum"), ValueError,
     "recvbuf has 9 elements but 4 are needed"),
    ("allgather", lambda x: (x, np.zeros(9, np.int32)), ValueError,
     "recvbuf has 9 elements but 16 are needed"),
    ("allgather", lambda x: (IN_PLACE, np.zeros(9, np.int32)), ValueError,
     "not a multiple of the 2 ranks"),
    ("gather", lambda x: (x, None), ValueError, "unknown collective 'gather'"),
]


@pytest.mark.parametrize("collective,make,exc,message", BAD)
def test_bad_arguments_raise_before_any_copy(collective, make, exc, message) -> None:
    copies = SimulatedCopies()
    reported: list[Exception] = []
    x = rank_data(0, 8, np.int32)
    world = SimulatedWorld(2)
    with pytest.raises(exc, match=message):
        staging.staged(collective, make(x), lambda a: pytest.fail("host call made"),
                       comm=world.comm(0), copies=copies, report_error=reported.append)
    assert [type(e) for e in reported] == [exc]  # checked mode: reported to the others
    assert not any(e[0] in ("d2h", "h2d") for e in copies.log)


def test_an_error_in_a_host_call_drains_the_streams() -> None:
    copies = SimulatedCopies()
    x = rank_data(0, 1000, np.int32)
    calls = []

    def host(args: tuple) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("remote failure")

    with pytest.raises(RuntimeError, match="remote failure"):
        staging.staged("allreduce", (x, None, "sum"), host, comm=SimulatedWorld(1).comm(0),
                       copies=copies, chunk_bytes=400)
    assert copies.log[-1][0] == "drain" and copies.pending() == 0


def test_numpy_copies_take_numpy_arrays_and_allocate_host_arrays() -> None:
    """NumpyCopies (host ranks' side of the staged path) refuses other objects, and
    allocates plain C-ordered numpy arrays."""
    copies = NumpyCopies(HostSlots(lambda n: np.empty(n, np.uint8)))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert copies.as_array(x) is x
    with pytest.raises(TypeError, match="NumpyCopies handles numpy arrays, not list"):
        copies.as_array([1.0])
    like = copies.empty_like(x)
    assert type(like) is np.ndarray and like.shape == (2, 3) and like.dtype == np.float32
    new = copies.empty((4,), np.int16, x)
    assert new.shape == (4,) and new.dtype == np.int16 and new.flags.c_contiguous


def _counting_slots() -> tuple[HostSlots, list[int]]:
    """HostSlots over numpy memory, and the sizes of its allocations in order."""
    sizes: list[int] = []

    def alloc(n: int) -> np.ndarray:
        sizes.append(n)
        return np.zeros(n, np.uint8)
    return HostSlots(alloc), sizes


def test_slots_above_the_limit_are_temporary() -> None:
    """A request above the limit gets fresh buffers each call, none kept or memoised; the
    slots kept before it stay as they were."""
    slots, sizes = _counting_slots()
    kept = slots.get(2, 100, 300)
    assert [s.nbytes for s in kept] == [100, 100] and slots.held_bytes == 200
    first = slots.get(2, 200, 300)
    second = slots.get(2, 200, 300)
    assert [s.nbytes for s in first + second] == [200] * 4 and sizes == [100, 100] + [200] * 4
    assert not any(a is b for a in first for b in second + kept)
    assert slots.held_bytes == 200
    assert all(a is b for a, b in zip(slots.get(2, 100, 300), kept, strict=True))
    view = slots.view(first[0], np.dtype(np.float32), 0, 10)
    assert view.shape == (10,) and slots.view(first[0], np.dtype(np.float32), 0, 10) is not view


def test_slots_grow_to_the_request_when_keeping_the_largest_would_pass_the_limit() -> None:
    """Growing slots keeps the largest size held so far unless that many of them would
    pass the limit; then they are just the size asked for."""
    slots, sizes = _counting_slots()
    slots.get(1, 250, 300)
    three = slots.get(3, 100, 300)            # 3 x 250 > 300: 3 x 100
    assert [s.nbytes for s in three] == [100] * 3 and slots.held_bytes == 300
    assert sizes == [250, 100, 100, 100]
    slots, sizes = _counting_slots()
    slots.get(1, 120, 300)
    two = slots.get(2, 50, 300)               # 2 x 120 <= 300: the largest size kept
    assert [s.nbytes for s in two] == [120, 120] and sizes == [120, 120, 120]


def test_memoised_views_are_bounded() -> None:
    """Views of a kept slot are memoised (the same object each call) up to 513 of them;
    the next new one starts the memo again, so older views are made anew."""
    slots, _ = _counting_slots()
    (slot,) = slots.get(1, 1024, 4096)
    u8 = np.dtype(np.uint8)
    first = slots.view(slot, u8, 0, 1)
    for start in range(1, 513):               # 513 views memoised
        slots.view(slot, u8, start, 1)
    assert slots.view(slot, u8, 0, 1) is first
    last = slots.view(slot, u8, 513, 1)       # the 514th: the memo starts again
    again = slots.view(slot, u8, 0, 1)
    assert again is not first and np.shares_memory(again, first) and again.shape == (1,)
    assert slots.view(slot, u8, 513, 1) is last and slots.view(slot, u8, 0, 1) is again


def test_torch_spans_through_the_chunked_pipeline() -> None:
    """mpicoll.torch's CudaCopies hands the pipeline 1-D :class:`Span` views (no
    ``reshape``): every collective, chunked, on CPU tensors, its stream calls made host
    ones (the layouts and views are CudaCopies' own)."""
    torch = pytest.importorskip("torch")
    from mpicoll.torch.device.cuda_copies import CudaCopies

    class HostStreams(CudaCopies):
        def begin(self, objs) -> None:
            pass

        def d2h(self, dst, src, chunk) -> None:
            torch.from_numpy(dst).copy_(src.tensor)

        def h2d(self, dst, src, chunk) -> None:
            dst.tensor.copy_(torch.from_numpy(src))

        def record(self, stream, chunk) -> None:
            return None

        def wait(self, event) -> None:
            pass

        finish = stream_wait = drain = lambda self, *args: None

    size, count = 3, 101
    inputs = [rank_data(r, count, np.int64) for r in range(size)]
    for collective in COLLECTIVES:
        world = SimulatedWorld(size)

        def body(r: int, collective: str = collective, world: SimulatedWorld = world):
            x = torch.from_numpy(inputs[r].copy())
            copies = HostStreams(None, {}, HostSlots(lambda n: np.empty(n, np.uint8)))
            kw = {"comm": world.comm(r), "copies": copies, "chunk_bytes": 40}
            host = world.host_call(collective, r)
            if collective == "allreduce" or (collective == "reduce" and r == 0):
                args = (IN_PLACE, x, "sum") + ((0,) if collective == "reduce" else ())
                staging.staged(collective, args, host, **kw)
                return x
            if collective == "reduce":
                return staging.staged(collective, (x, None, "sum", 0), host, **kw)
            if collective == "broadcast":
                staging.staged(collective, (x, 0), host, **kw)
                return x
            b = block_bounds(count, size)
            out = torch.zeros(count * size if collective == "allgather"
                              else b[r + 1] - b[r], dtype=x.dtype)
            staging.staged(collective, (x, out) + ((None,) if collective ==
                                                    "reduce_scatter" else ()), host, **kw)
            return out

        for r, got in enumerate(world.run(body)):
            want = reference(collective, inputs, r)
            if want is not None:
                np.testing.assert_array_equal(got.numpy(), want, err_msg=collective)
