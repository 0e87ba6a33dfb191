"""The staged path: device buffers through pinned host buffers, chunked and pipelined.

For MPI libraries that are not CUDA-aware (the MPICH and Open MPI wheels), a collective on
device arrays runs as a sequence of host collectives on chunks of the data, each chunk
copied device-to-host (d2h) into a pinned host *slot*, reduced or moved by the host
collective (the public ``mpicoll`` function, through ``host_call``), and copied
host-to-device (h2d) into the result. With three slots the copies overlap the host work::

    host thread:  issue d2h(0) | issue d2h(1), wait d2h(0), host(0), issue h2d(0)
                               | issue d2h(2), wait d2h(1), host(1), issue h2d(1) | ...
    d2h stream:   d2h(0) d2h(1)        d2h(2)            d2h(3) ...
    h2d stream:                 h2d(0)          h2d(1) ...

so while the host collective runs on chunk k, the d2h copy of chunk k+1 and the h2d copy of
chunk k-1 run on their own CUDA streams. Events order what must be ordered: the host
waits for d2h(k) before its host call; the d2h stream waits for the h2d that last read a
slot before refilling it (slot reuse); both copy streams first wait for the streams that
produce the arrays; the call returns once the last h2d has completed.

Chunking is decided only from values every rank has (count, dtype size, world size, the
chunk and staging sizes), so every rank makes the same number of host calls with matching
counts:

- ``allreduce``, ``reduce``, ``broadcast``: elementwise chunks ``[k*e, (k+1)*e)``.
- ``reduce_scatter``: chunk k holds chunk k of every rank's block (blocks as
  ``numpy.array_split``), packed one after another; because blocks differ by at most one
  element and the longer ones come first, the packed chunk splits into exactly those
  pieces again, and the host reduce-scatter gives this rank chunk k of its block.
- ``allgather``: chunk k of this rank's block goes to its place in a packed host buffer,
  the host all-gather (in place) fills the other ranks' chunk k, which are unpacked to
  their blocks of the result.

The device work goes through a *copies* object (:class:`Copies`): the one of the arrays'
device backend (:mod:`mpicoll.gpu.backends`; for CUDA the CuPy one,
:mod:`mpicoll.gpu.cupy_copies`), or one passed in (the CPU tests pass a host stand-in with
deferred streams).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .. import buffers, config, validation
from ..ops import resolve_op
from ..partition import block_bounds
from ..runtime import world as runtime_world
from .slots import HostSlots

__all__ = ["COLLECTIVES", "NSLOTS", "DEFAULT_STAGING_BYTES", "MIN_CHUNK_BYTES",
           "TARGET_CHUNKS", "Copies", "HostSlots", "staging_bytes", "chunk_bytes_setting",
           "chunk_elements", "chunks", "staged"]

#: The collectives the staged path runs.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")

#: Pinned host slots in flight: d2h of k+1, host call on k, h2d of k-1.
NSLOTS = 3

#: Default bound of the pinned host memory of the staged path, per process (bytes).
DEFAULT_STAGING_BYTES = 64 << 20

#: Smallest automatic chunk (bytes of one slot): below it a chunk costs more in per-call
#: overhead than the overlap saves.
MIN_CHUNK_BYTES = 256 << 10

#: Automatic chunking aims at this many chunks per call (within the bounds above).
TARGET_CHUNKS = 8

_STAGING_VAR = "MPICOLL_STAGING_BYTES"
_CHUNK_VAR = "MPICOLL_STAGING_CHUNK_BYTES"


def _env_bytes(name: str, default: int | None, minimum: int) -> int | None:
    """``name`` through :mod:`mpicoll.config` (cached: :func:`mpicoll.config.refresh`
    re-reads it); ``auto`` is ``default``."""
    raw = config.env_str(name)
    if raw is None or raw.strip().lower() == "auto":
        return default
    return config.env_int(name, default, minimum)


def staging_bytes() -> int:
    """Bound of the staged path's pinned host memory per process (``MPICOLL_STAGING_BYTES``).

    Raises:
        ValueError: the variable is not an integer >= 3 (one byte per slot).
    """
    return _env_bytes(_STAGING_VAR, DEFAULT_STAGING_BYTES, NSLOTS)


def chunk_bytes_setting() -> int | None:
    """``MPICOLL_STAGING_CHUNK_BYTES`` (bytes of one slot), ``None`` for automatic.

    Raises:
        ValueError: the variable is not an integer >= 1 (or ``auto``).
    """
    return _env_bytes(_CHUNK_VAR, None, 1)


class Copies(Protocol):
    """What the pipeline needs from a device (CuPy, or a host stand-in).

    Device arrays below are the implementation's own arrays (``as_array``), flat slices
    of them are passed to ``d2h``/``h2d``; host arrays are numpy views of pinned slots.
    """

    def as_array(self, obj: Any) -> Any:
        """A zero-copy array view (CuPy, or numpy for a host stand-in) of a user's object."""

    def empty_like(self, obj: Any) -> Any:
        """A new user-facing object like ``obj`` (same family, device, shape, layout)."""

    def empty(self, shape: tuple, dtype: Any, like: Any) -> Any:
        """A new C-ordered user-facing object of ``shape`` on ``like``'s device."""

    #: The reusable host slots (pinned memory for CuPy) this device's calls share.
    host_pool: "HostSlots"

    def begin(self, objs: Sequence[Any]) -> None:
        """Make both copy streams wait for the streams producing these user objects."""

    def d2h(self, dst: np.ndarray, src: Any, chunk: int) -> None:
        """Queue a copy of device ``src`` into host ``dst`` on the d2h stream."""

    def h2d(self, dst: Any, src: np.ndarray, chunk: int) -> None:
        """Queue a copy of host ``src`` into device ``dst`` on the h2d stream."""

    def record(self, stream: str, chunk: int) -> Any:
        """Record an event on stream ``"d2h"`` or ``"h2d"``; return it."""

    def wait(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed."""

    def stream_wait(self, stream: str, event: Any) -> None:
        """Make ``stream`` wait (on the device) for ``event``."""

    def finish(self, event: Any) -> None:
        """End of a call: block until ``event`` (the last h2d) has completed."""

    def drain(self) -> None:
        """After an error: block until both copy streams are idle."""


def chunk_elements(rows: int, itemsize: int, width: int, chunk_bytes: int | None,
                   limit: int) -> int:
    """Elements per chunk (per block for reduce_scatter/allgather).

    Args:
        rows: elements to split (the longest block for reduce_scatter/allgather).
        itemsize: bytes per element.
        width: slot elements per chunk element (1 elementwise; ``size + 1`` for
            reduce_scatter, ``size`` for allgather).
        chunk_bytes: bytes of one slot asked for (``None``: automatic: about
            ``rows / TARGET_CHUNKS``, at least :data:`MIN_CHUNK_BYTES`).
        limit: the pinned memory bound: ``NSLOTS`` slots never exceed it.
    Returns:
        At least 1.
    """
    per = itemsize * width
    most = max(1, (limit // NSLOTS) // per)
    if chunk_bytes is None:
        least = max(1, MIN_CHUNK_BYTES // per)
        want = max(least, math.ceil(rows / TARGET_CHUNKS))
    else:
        want = max(1, int(chunk_bytes) // per)
    return max(1, min(want, most, max(rows, 1)))


def chunks(collective: str, count: int, itemsize: int, size: int, chunk_bytes: int | None,
           limit: int) -> tuple[int, int]:
    """How the staged path splits one call: (elements per chunk, number of host calls).

    Depends only on values every rank has, so every rank can tell how many host calls
    a staged call makes (also a rank whose own buffers are on the host).

    Args:
        collective: one of :data:`COLLECTIVES`.
        count: elements of the buffer (``reduce_scatter``: the whole send buffer;
            ``allgather``: one rank's block).
        itemsize: bytes per element. size: ranks of the communicator.
        chunk_bytes, limit: as :func:`chunk_elements`.
    """
    if collective == "reduce_scatter":
        rows, width = -(-count // size), size + 1   # the longest block (array_split)
    elif collective == "allgather":
        rows, width = count, size
    else:
        rows, width = count, 1
    e = chunk_elements(rows, itemsize, width, chunk_bytes, limit)
    return e, max(1, math.ceil(rows / e))


def _memory_flat(a: Any) -> Any:
    """Flat view of contiguous array or tensor ``a`` in memory order (no copy; a 1-D
    one, such as torch's :class:`~mpicoll.torch.device.cuda_copies.Span`, as it is)."""
    ndim = getattr(a, "ndim", 1)
    if ndim == 1:
        return a
    if ndim == 0 or _c_order(a):
        return a.reshape(-1)
    return a.T.reshape(-1)  # Fortran order: the transpose is C-contiguous


def _rows(gathered: Any) -> Any:
    """Every rank's Fortran-ordered block, gathered in memory order as ``(size, *its
    shape reversed)``, as the C-ordered rows of a new result (a copy on the device)."""
    axes = (0, *range(gathered.ndim - 1, 0, -1))
    t = gathered.permute(*axes) if buffers.package_of(gathered) == "torch" \
        else gathered.transpose(axes)
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _user_prefix(obj: Any, count: int, view: Any) -> Any:
    """The first ``count`` elements of the user's object, flat, in its own family."""
    if hasattr(obj, "reshape") and buffers.package_of(obj) in ("torch", "cupy", "numpy"):
        return _memory_flat(obj)[:count]
    return view[:count]


def _c_order(obj: Any) -> bool:
    flags = getattr(obj, "flags", None)
    if flags is not None:
        return bool(flags.c_contiguous)
    fn = getattr(obj, "is_contiguous", None)
    return bool(fn()) if callable(fn) else True


class _Layout:
    """Chunk k's copies and host-call arguments for one collective (see module doc):
    ``n_chunks`` host calls of ``e`` elements a row, ``width`` slot elements a row."""

    inputs: list[Any]
    result: Any
    rows: Any = None  # a Fortran-ordered block's gathered copy (:func:`_rows`)

    def __init__(self, slots: HostSlots, src: Any, dst: Any, dtype: np.dtype, e: int,
                 n_chunks: int, width: int) -> None:
        self.slots, self.src, self.dst, self.dtype, self.e = slots, src, dst, dtype, e
        self.n_chunks = n_chunks
        self.slot_bytes = e * width * dtype.itemsize

    def d2h(self, k: int, slot: np.ndarray) -> list[tuple[np.ndarray, Any]]:
        raise NotImplementedError

    def host_args(self, k: int, slot: np.ndarray) -> tuple:
        raise NotImplementedError

    def h2d(self, k: int, slot: np.ndarray) -> list[tuple[Any, np.ndarray]]:
        raise NotImplementedError


class _Elementwise(_Layout):
    """allreduce, reduce, broadcast: chunk k is elements ``[k*e, (k+1)*e)``."""

    def __init__(self, slots: HostSlots, src: Any, dst: Any, count: int, dtype: np.dtype,
                 e: int, n_chunks: int, make_args: Callable[[np.ndarray], tuple]) -> None:
        super().__init__(slots, src, dst, dtype, e, n_chunks, 1)
        self.count, self.make_args = count, make_args

    def _span(self, k: int) -> tuple[int, int]:
        lo = k * self.e
        return lo, min(self.count, lo + self.e)

    def _host(self, k: int, slot: np.ndarray) -> np.ndarray:
        lo, hi = self._span(k)
        return self.slots.view(slot, self.dtype, 0, hi - lo)

    def d2h(self, k: int, slot: np.ndarray) -> list:
        lo, hi = self._span(k)
        return [(self._host(k, slot), self.src[lo:hi])] if self.src is not None and hi > lo \
            else []

    def host_args(self, k: int, slot: np.ndarray) -> tuple:
        return self.make_args(self._host(k, slot))

    def h2d(self, k: int, slot: np.ndarray) -> list:
        lo, hi = self._span(k)
        return [(self.dst[lo:hi], self._host(k, slot))] if self.dst is not None and hi > lo \
            else []


class _ReduceScatter(_Layout):
    """Chunk k of every rank's block, packed; host reduce-scatter into a second region."""

    def __init__(self, slots: HostSlots, src: Any, dst: Any, count: int, dtype: np.dtype,
                 rank: int, size: int, e: int, n_chunks: int, op: Any) -> None:
        super().__init__(slots, src, dst, dtype, e, n_chunks, size + 1)
        self.rank, self.size, self.op = rank, size, op
        self.bounds = block_bounds(count, size)
        self.lens = [self.bounds[i + 1] - self.bounds[i] for i in range(size)]
        self.nothing = np.empty(0, dtype)

    def _pieces(self, k: int) -> list[int]:
        return [max(0, min(self.e, n - k * self.e)) for n in self.lens]

    def d2h(self, k: int, slot: np.ndarray) -> list:
        out, at = [], 0
        for i, m in enumerate(self._pieces(k)):
            if m:
                lo = self.bounds[i] + k * self.e
                out.append((self.slots.view(slot, self.dtype, at, m), self.src[lo:lo + m]))
            at += m
        return out

    def host_args(self, k: int, slot: np.ndarray) -> tuple:
        pieces = self._pieces(k)
        total = sum(pieces)
        packed = self.slots.view(slot, self.dtype, 0, total)
        if pieces[self.rank]:
            mine = self.slots.view(slot, self.dtype, self.size * self.e, pieces[self.rank])
        else:  # an empty view of the slot may carry the slot's own address, which MPI
            # then rejects as aliasing the send buffer: a separate empty array instead
            mine = self.nothing
        return (packed, mine, self.op)

    def h2d(self, k: int, slot: np.ndarray) -> list:
        m = self._pieces(k)[self.rank]
        if not m:
            return []
        lo = k * self.e
        return [(self.dst[lo:lo + m], self.slots.view(slot, self.dtype, self.size * self.e,
                                                      m))]


class _Allgather(_Layout):
    """Chunk k of this rank's block into its place; host all-gather in place; unpack."""

    def __init__(self, slots: HostSlots, src: Any, dst: Any, block: int, dtype: np.dtype,
                 rank: int, size: int, e: int, n_chunks: int, in_place: bool) -> None:
        super().__init__(slots, src, dst, dtype, e, n_chunks, size)
        self.block, self.rank, self.size, self.in_place = block, rank, size, in_place

    def _m(self, k: int) -> int:
        return max(0, min(self.e, self.block - k * self.e))

    def d2h(self, k: int, slot: np.ndarray) -> list:
        m = self._m(k)
        if not m:
            return []
        lo = k * self.e
        return [(self.slots.view(slot, self.dtype, self.rank * m, m), self.src[lo:lo + m])]

    def host_args(self, k: int, slot: np.ndarray) -> tuple:
        return (buffers.IN_PLACE, self.slots.view(slot, self.dtype, 0, self.size * self._m(k)))

    def h2d(self, k: int, slot: np.ndarray) -> list:
        m = self._m(k)
        out = []
        for i in range(self.size):
            if m and not (self.in_place and i == self.rank):
                lo = i * self.block + k * self.e
                out.append((self.dst[lo:lo + m], self.slots.view(slot, self.dtype, i * m, m)))
        return out


def _plan(collective: str, args: tuple, copies: Copies, slots: HostSlots, rank: int,
          size: int, chunk_bytes: int | None, limit: int) -> _Layout:
    """Validate this rank's device arguments (:mod:`mpicoll.validation`, as the host
    collectives do, and the op against the dtype); the layout of the staged call."""
    def view(obj: Any, argname: str, writable: bool) -> Any:
        """The staged path's view of a buffer (:data:`mpicoll.validation.View`): its
        device array, flat in memory order, of a dtype mpicoll moves."""
        flat = _memory_flat(copies.as_array(obj))
        buffers.check_dtype(np.dtype(flat.dtype), argname)
        return flat

    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; the staged path runs "
                         f"{', '.join(COLLECTIVES)}")
    r = op = rows = None
    if collective == "broadcast":
        buf, root = args
        r, flat = validation.broadcast(buf, root, rank, size, view)
        src, dst = (flat, None) if rank == r else (None, flat)
        in_place, inputs, result = False, [buf], buf
    else:
        sendbuf, recvbuf, *rest = args
        op = rest[0] if rest else None
        in_place = buffers.is_in_place(sendbuf)
        inputs = [recvbuf] if in_place else [sendbuf]
        if collective == "allreduce":
            src, dst, _ = validation.elementwise(sendbuf, recvbuf, view)
        elif collective == "reduce":
            r, (src, dst, _) = validation.reduce(sendbuf, recvbuf, rest[1], rank, size, view)
        elif collective == "reduce_scatter":
            src, dst, _ = validation.reduce_scatter(sendbuf, recvbuf, rank, size, view)
        else:
            src, dst, _ = validation.allgather(sendbuf, recvbuf, rank, size, view)
        if op is not None:  # an op that applies to the dtype, as on the host (None:
            resolve_op(op).check_dtype(np.dtype(src.dtype))  # host_call brings its own)
        result = recvbuf
        if in_place:
            if collective == "reduce_scatter":
                result = _user_prefix(recvbuf, dst.size, dst)
        elif recvbuf is not None and dst is not None:
            inputs.append(recvbuf)
        elif collective == "reduce_scatter":
            result = copies.empty((validation.own_block(src.size, rank, size),),
                                  src.dtype, sendbuf)
        elif collective == "allgather":
            block = copies.as_array(sendbuf)
            if getattr(block, "ndim", 1) > 1 and not _c_order(block):
                rows = copies.empty((size, *block.shape[::-1]), src.dtype, sendbuf)
                dst = _memory_flat(copies.as_array(rows))  # C rows at staged's end
            else:
                result = copies.empty(validation.gathered_shape(block.shape, size),
                                      src.dtype, sendbuf)
        elif r is None or rank == r:
            result = copies.empty_like(sendbuf)
        else:  # a reduce off its root
            result = None
        if dst is None and result is not None:
            dst = _memory_flat(copies.as_array(result))
    flat = src if src is not None else dst
    dtype = np.dtype(flat.dtype)
    e, n_chunks = chunks(collective, flat.size, dtype.itemsize, size, chunk_bytes, limit)
    if collective == "reduce_scatter":
        layout: _Layout = _ReduceScatter(slots, src, dst, src.size, dtype, rank, size, e,
                                         n_chunks, op)
    elif collective == "allgather":
        layout = _Allgather(slots, src, dst, src.size, dtype, rank, size, e, n_chunks,
                            in_place)
    else:
        def make_args(h: np.ndarray) -> tuple:
            if collective == "broadcast":
                return (h, r)
            if r is None:
                return (buffers.IN_PLACE, h, op)
            return (buffers.IN_PLACE, h, op, r) if rank == r else (h, None, op, r)

        layout = _Elementwise(slots, src, dst, flat.size, dtype, e, n_chunks, make_args)
    layout.inputs, layout.result, layout.rows = inputs, result, rows
    return layout


def _run(layout: _Layout, copies: Copies, host_call: Callable[[tuple], Any],
         slots: list[np.ndarray], pipeline: bool) -> None:
    """Issue the copies and host calls of every chunk (see the module doc)."""
    nslots = len(slots)
    count = layout.n_chunks
    d2h_done: list[Any] = [None] * count
    h2d_done: list[Any] = [None] * count

    def issue_d2h(k: int) -> None:
        if pipeline and k >= nslots:  # slot reuse: the h2d that last read it must be done
            # (unpipelined, the host already waited for it)
            copies.stream_wait("d2h", h2d_done[k - nslots])
        for dst, src in layout.d2h(k, slots[k % nslots]):
            copies.d2h(dst, src, k)
        d2h_done[k] = copies.record("d2h", k)

    # the arrays' producers (a new result too: its memory may come back from work still
    # queued on the allocating stream) finish before either copy stream touches them
    copies.begin(layout.inputs + ([layout.result] if layout.result is not None
                                  and all(layout.result is not a for a in layout.inputs)
                                  else []))
    issue_d2h(0)
    for k in range(count):
        if pipeline and k + 1 < count:
            issue_d2h(k + 1)  # runs while the host works on chunk k
        copies.wait(d2h_done[k])
        host_call(layout.host_args(k, slots[k % nslots]))
        for dst, src in layout.h2d(k, slots[k % nslots]):
            copies.h2d(dst, src, k)  # runs while the host works on chunk k+1
        h2d_done[k] = copies.record("h2d", k)
        if not pipeline:
            copies.wait(h2d_done[k])
            if k + 1 < count:
                issue_d2h(k + 1)
    copies.finish(h2d_done[count - 1])


def staged(collective: str, args: tuple, host_call: Callable[[tuple], Any], *,
           comm: Any = None, copies: Copies | None = None, chunk_bytes: int | None = None,
           staging_limit: int | None = None, pipeline: bool = True,
           report_error: Callable[[Exception], Any] | None = None) -> Any:
    """Run one collective on device arrays through pinned host buffers.

    Args:
        collective: ``"allreduce"``, ``"reduce_scatter"``, ``"allgather"``,
            ``"broadcast"`` or ``"reduce"``.
        args: the public function's arguments as the user passed them, in its signature's
            order without ``comm``/``algorithm``/``check``: ``(sendbuf, recvbuf, op)``,
            ``(sendbuf, recvbuf, op)``, ``(sendbuf, recvbuf)``, ``(buf, root)``,
            ``(sendbuf, recvbuf, op, root)``. Buffers are device arrays (or
            ``IN_PLACE``/``None`` where the function allows it).
        host_call: ``host_call(host_args)`` runs the host collective on numpy arrays given
            in the same order (the core passes ``lambda a: mpicoll.<collective>(*a,
            comm=..., algorithm=..., check=...)``). Called the same number of times, with
            the same counts, on every rank.
        comm: the communicator (its rank and size decide the blocks; ``None``: the
            runtime's world, ``MPI.COMM_WORLD`` unless :mod:`mpicoll.elastic` shrank it, as
            for the host collectives). Any object with ``Get_rank``/``Get_size``.
        copies: the device interface (default: that of the arrays' device backend,
            :mod:`mpicoll.gpu.backends`; for CUDA CuPy's, on the arrays' device).
        chunk_bytes: bytes of one pinned slot per chunk (default
            ``MPICOLL_STAGING_CHUNK_BYTES``, else automatic). Must be equal on every rank.
        staging_limit: bound of pinned host memory (default ``MPICOLL_STAGING_BYTES``,
            64 MiB); chunks shrink to fit three slots in it.
        pipeline: ``False`` runs each chunk's d2h, host call and h2d one after another
            (one slot; for comparison).
        report_error: called with a validation error before it is raised (checked mode:
            the core passes the agreement step, so the other ranks raise too).
    Returns:
        What the public function returns: the result on the device (``recvbuf`` when
        given, a new device array like ``sendbuf`` otherwise; ``None`` off the root of a
        reduce).
    Raises:
        TypeError, ValueError: bad arguments on this rank (before any message).
        mpicoll.CollectiveError: from the host collectives (checked mode).
    """
    comm = runtime_world.comm() if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if copies is None:
        from .backends import backend_of  # noqa: PLC0415

        copies = backend_of(args).copies(args)
    limit = staging_bytes() if staging_limit is None else int(staging_limit)
    chunk_bytes = chunk_bytes_setting() if chunk_bytes is None else chunk_bytes
    pool = copies.host_pool
    try:
        layout = _plan(collective, tuple(args), copies, pool, rank, size, chunk_bytes,
                       limit)
    except (TypeError, ValueError) as exc:
        if report_error is not None:
            report_error(exc)  # checked mode: tells the other ranks, raises
        raise
    slots = pool.get(NSLOTS if pipeline else 1, layout.slot_bytes, limit)
    try:
        _run(layout, copies, host_call, slots, pipeline)
    except BaseException:
        copies.drain()  # no copy may still write into buffers the caller gets back
        raise
    return layout.result if layout.rows is None else _rows(layout.rows)
