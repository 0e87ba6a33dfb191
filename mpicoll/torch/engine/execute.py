"""Running negotiated responses: fused all-reduce, fused reduce-scatter, all-gather,
broadcast, all-to-all, barrier, join.

Called only by the thread that runs the negotiation round, with the same responses in the
same order on every rank, so every rank issues the same mpicoll collectives on the
adapter's private communicator. A rank without a local request for an all-reduce (it
called ``join()``) takes part with zeros; the other collectives fail in negotiation while
a rank has joined.

The engine passes itself; :class:`EngineInterface` names what is used of it, so this module
does not import :mod:`mpicoll.torch.engine.core` (which imports this one).
"""
from __future__ import annotations

import contextlib
import logging
from math import prod
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch
from mpi4py import MPI

from ... import collectives, timeline
from ...buffers import IN_PLACE
from ...errors import CollectiveError, MismatchError, ProcessFailedError, RemoteError
from ...runtime import failures
from ...ops import scaled_sum
from . import trace
from ...algorithms.adasum import adasum_allreduce
from ...gpu.staging import staging_bytes
from . import pipeline
from ..device.tensors import host_run, request_device
from .dtypes import from_name, numpy_view, reduce_dtype
from .fusion import numel, plan_buckets
from .negotiation import JOIN, Response
from ..ops import Adasum, Average, ReduceOp, Sum, mpicoll_op
from .settings import Settings

__all__ = ["run_responses", "EngineInterface"]

log = logging.getLogger("mpicoll.torch.engine.execute")


class EngineInterface(Protocol):
    """What running responses uses of :class:`mpicoll.torch.engine.core.Engine`."""

    settings: Settings
    comm: Any
    rank: int
    size: int
    local: dict[str, Any]

    def finish(self, key: str, result: Any = None, error: BaseException | None = None,
               extra: Any = None) -> None:
        """Complete this rank's request ``key`` (if it has one)."""

    def fusion_buffer(self, dtype: torch.dtype, count: int, device: Any = None) -> torch.Tensor:
        """A flat scratch tensor of ``count`` elements (on ``device``: ``None`` the host)."""

    def host_slots(self, device: Any) -> Any:
        """The pinned host memory that stages requests on ``device``."""

    def persistent_view(self, flat: torch.Tensor) -> np.ndarray:
        """The same numpy view of ``flat`` every time."""

    def realign_unnamed(self) -> dict[str, list[int]]:
        """Give every rank the same numbering of unnamed requests (collective)."""

    def stop(self, leaving: dict[int, Any]) -> None:
        """Fail what is pending (``leaving``: the ranks that shut down) and make the engine
        thread leave its loop."""


def run_responses(engine: EngineInterface, responses: list[Response]) -> None:
    """Run one round's responses (errors first, then fused all-reduces, then fused
    reduce-scatters, then the rest)."""
    fused: dict[str, list[Response]] = {"allreduce": [], "reducescatter": []}
    others = []
    if responses and responses[0].kind == "realign":
        # before the deadlock's errors wake up threads that would number new requests
        engine.realign_unnamed()
        responses = responses[1:]
    responses = _expand_groups(engine, responses)
    if timeline.enabled():
        _trace_negotiations(engine, responses)
    for response in responses:
        if response.error is not None:
            engine.finish(_local_key(response), error=response_error(engine.rank, response))
        elif response.kind in fused:
            fused[response.kind].append(response)
        else:
            others.append(response)
    threshold = engine.settings.fusion_threshold
    for kind, run in (("allreduce", _allreduce_bucket),
                      ("reducescatter", _reducescatter_bucket)):
        for bucket in plan_buckets(fused[kind], max(threshold, 1)):
            for part in ([r] for r in bucket) if threshold == 0 else [bucket]:
                _guarded(engine, part, run)     # fusion off: one request at a time
    for response in others:
        _guarded(engine, [response], _RUNNERS[response.kind])


def _trace_negotiations(engine: EngineInterface, responses: list[Response]) -> None:
    """Record how long each of this rank's requests of the round waited to be negotiated."""
    for response in responses:
        work = engine.local.get(_local_key(response))
        if work is not None:
            trace.negotiated(response.kind, response.name, work.since)


def _expand_groups(engine: EngineInterface, responses: list[Response]) -> list[Response]:
    """Replace each completed group by its members' responses, in place, so members fuse
    with the round's other requests. A failed group (or a name that one rank used for a
    group and another for something else) fails this rank's entry and all its members."""
    out = []
    for response in responses:
        mine = response.metas.get(engine.rank)
        own_group = mine is not None and mine.kind == "group"
        if response.kind != "group" and not own_group:
            out.append(response)
            continue
        if response.error is not None:
            out.append(response)                          # this rank's own entry
            if own_group:
                out.extend(Response(m.kind, m.name, {}, response.error)
                           for m in mine.members)
            continue
        engine.finish(response.name, result=None)        # the group's own entry
        first = _first_meta(response)
        for index, member in enumerate(first.members):
            out.append(Response(member.kind, member.name,
                                {r: m.members[index] for r, m in response.metas.items()}))
    return out


def response_error(rank: int, response: Response) -> Exception:
    """The exception that ``response.error`` raises on ``rank``: ``ValueError`` on a rank
    whose own arguments were bad and :class:`mpicoll.RemoteError` on the others (the core's
    rule, with the same message everywhere); ``MismatchError`` when ranks disagree;
    ``CollectiveError`` otherwise (an operation that can never complete)."""
    message = response.error or ""
    if response.bad_ranks:
        if rank in response.bad_ranks:
            return ValueError(message)
        return RemoteError(message, {r: response.metas[r].error for r in response.bad_ranks})
    if "disagree" in message:
        return MismatchError(message)
    return CollectiveError(message)


def _local_key(response: Response) -> str:
    return JOIN if response.kind == "join" else response.name


def _guarded(engine: EngineInterface, bucket: list[Response], run: Any) -> None:
    """Run one bucket; its failure fails its requests. Traced (:mod:`.trace`) while a
    timeline records (its requests then finish once its events are recorded)."""
    traced = timeline.enabled() and bucket[0].kind != "shutdown"
    target: Any = engine
    if traced:
        trace.begin_bucket(bucket[0].kind, [r.name for r in bucket])
        target = _DeferredFinish(engine)
    error = None
    try:
        run(target, bucket)
    except Exception as exc:  # noqa: BLE001  (reported through the futures)
        error = exc
        _failed(target, bucket, exc)
    finally:
        if traced:
            trace.end_bucket(error)
            target.flush()


def _failed(engine: EngineInterface, bucket: list[Response], exc: Exception) -> None:
    names = [r.name for r in bucket]
    error = failures.translate(exc, engine.comm, f"{bucket[0].kind} {names} of mpicoll.torch")
    if isinstance(error, ProcessFailedError):
        # a dead peer (ULFM): the whole engine fails (the runtime has revoked the world's
        # communicators), not just this bucket; the round's caller fails every request
        log.warning("mpicoll.torch: %s failed: %s", names, error)
        raise error
    log.exception("mpicoll.torch: %s failed", names)
    for response in bucket:
        engine.finish(_local_key(response), error=exc)


class _DeferredFinish:
    """The engine, with :meth:`finish` held back until :meth:`flush`: the bucket's
    timeline events are recorded before any waiting thread wakes up (and, say, stops the
    timeline)."""

    def __init__(self, engine: EngineInterface) -> None:
        self._engine = engine
        self._finished: list[tuple[tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        self._finished.append((args, kwargs))

    def flush(self) -> None:
        for args, kwargs in self._finished:
            self._engine.finish(*args, **kwargs)


def _first_meta(response: Response) -> Any:
    return next(iter(response.metas.values()))


#: Integer dtypes whose exact division toward zero torch implements (``div_(rounding_mode=
#: "trunc")``); other integer dtypes divide through float64.
_TRUNC_DIV = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _scale(flat: torch.Tensor, factor: float) -> None:
    """Multiply ``flat`` by ``factor`` in place, as Horovod scales: integer tensors in
    float64, cast back toward zero; floating tensors in their own dtype (float16 and
    bfloat16 computed in float32 and rounded once)."""
    if factor == 1.0:
        return
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat.mul_(factor)
    else:
        flat.copy_(flat.to(torch.float64).mul_(factor))


def _finalize(flat: torch.Tensor, op: ReduceOp, postscale: float, size: int) -> None:
    """Apply Average's division by ``size`` and the postscale factor, in place.

    An integer Average without a postscale factor divides exactly, toward zero (the value
    Horovod's float64 scaling gives)."""
    average = int(op) == int(Average) and size > 1
    if average and postscale == 1.0 and flat.dtype in _TRUNC_DIV:
        flat.div_(size, rounding_mode="trunc")
        return
    _scale(flat, postscale / size if average else postscale)


def _passed_down(op: ReduceOp, postscale: float, dtype: torch.dtype, size: int) -> Any:
    """The core op that folds Average's division and ``postscale`` into the all-reduce
    (:func:`mpicoll.ops.scaled_sum`: multiplied on each rank's shard by the algorithms
    that scale shards), or ``None`` when :func:`_finalize` must do it afterwards (integer
    and float16 buffers, whose scaling torch computes in another dtype; other ops;
    nothing to scale)."""
    if dtype not in (torch.float32, torch.float64) or int(op) not in (int(Average), int(Sum)):
        return None
    factor = postscale / size if int(op) == int(Average) else postscale
    return None if factor == 1.0 else scaled_sum(factor)


def _allreduce_bucket(engine: EngineInterface, bucket: list[Response]) -> None:
    meta = _first_meta(bucket[0])
    dtype = from_name(meta.dtype)
    rdtype = reduce_dtype(dtype)
    op = ReduceOp(meta.op)
    works = [engine.local.get(r.name) for r in bucket]
    adasum = int(op) == int(Adasum)         # per-tensor dot products: the negotiated layout
    dev = request_device(works)
    _await(dev, works)
    with _on_stream(dev):                    # the fusion buffer is packed on the device
        flat, parts = _fill(engine, bucket, works, dtype, rdtype, adasum, dev)
    in_place = parts is None
    scaled = False
    if flat.numel() and engine.size > 1:
        core_op = None if adasum else _passed_down(op, meta.postscale, flat.dtype,
                                                   engine.size)
        scaled = core_op is not None

        def reduce(array: Any) -> None:
            if adasum:
                trace.step("MPI_ADASUM_ALLREDUCE")
                adasum_allreduce(array, [part.numel() for part in parts], engine.comm)
            else:
                trace.step("MPI_ALLREDUCE")
                collectives.allreduce(IN_PLACE, array, op=core_op or mpicoll_op(op),
                                      comm=engine.comm, algorithm=engine.settings.algorithm)

        if not adasum and pipeline.chunked(engine, "allreduce", flat.numel(),
                                           flat.element_size(), bucket):
            pipeline.run(engine, dev, "allreduce", [], [flat], reduce)
        elif dev is None:
            reduce(engine.persistent_view(flat) if in_place and meta.layout
                   else numpy_view(flat))
        else:                                # Adasum's dot products run on the host
            _staged(engine, dev, [flat], [flat], reduce, aware=not adasum)
    trace.step(None if in_place else "MEMCPY_OUT_FUSION_BUFFER")
    with _on_stream(dev):
        _unpack(flat, works, parts, op, meta.postscale, engine.size, scaled)
    if dev is not None:
        dev.synchronize()                    # results ready for any stream
    for response, work in zip(bucket, works):
        if work is not None:
            engine.finish(response.name, result=work.output)


def _fill(engine: EngineInterface, bucket: list[Response], works: list, dtype: torch.dtype,
          rdtype: torch.dtype, adasum: bool, dev: Any) -> tuple[torch.Tensor, Any]:
    """The flat tensor an all-reduce bucket reduces (prescaled), and its part for each
    request, or ``None`` when it is the outputs themselves: zero-copy when the outputs tile
    one contiguous range (a single tensor, or gradients that DistributedOptimizer keeps as
    views of one flat buffer), else packed into the fusion buffer (on ``dev``; ``None``:
    the host)."""
    meta = _first_meta(bucket[0])
    adjacent = _adjacent_outputs(works, dtype) if rdtype is dtype and not adasum else None
    if adjacent is not None:
        for work in works:
            if work.tensor is not work.output:
                work.output.copy_(work.tensor)
        flat, parts = adjacent, None
    else:
        trace.step("MEMCPY_IN_FUSION_BUFFER")
        sizes = [numel(_first_meta(r)) for r in bucket]
        flat = engine.fusion_buffer(rdtype, sum(sizes), dev)
        parts = torch.split(flat, sizes)
        for work, part in zip(works, parts):
            if work is None:
                part.zero_()
            else:
                part.copy_(work.tensor.reshape(-1))
    _scale(flat, meta.prescale)
    return flat, parts


def _unpack(flat: torch.Tensor, works: list, parts: Any, op: ReduceOp, postscale: float,
            size: int, scaled: bool) -> None:
    """Finalize (Average, postscale) a reduced bucket and copy its ``parts`` (``None``: in
    place) out to the outputs."""
    if not scaled:
        _finalize(flat, op, postscale, size)
    for work, part in zip(works, parts or ()):
        if work is not None:
            work.output.copy_(part.view(work.output.shape))


def _await(dev: Any, works: list) -> None:
    """The engine's stream waits for each request's submit-time event (nothing on the
    host: ``dev`` ``None``)."""
    for work in works:
        if dev is not None and work is not None and work.ready is not None:
            dev.wait(work.ready)


def _on_stream(dev: Any) -> contextlib.AbstractContextManager:
    """Make the engine's stream of ``dev`` current (nothing on the host)."""
    return contextlib.nullcontext() if dev is None else dev.stream()


def _staged(engine: EngineInterface, dev: Any, inputs: list, outputs: list, fn: Any,
            aware: bool = True) -> None:
    """:func:`mpicoll.torch.device.tensors.host_run` with the engine's pinned memory for ``dev``."""
    host_run(dev, engine.host_slots(dev), staging_bytes(), inputs, outputs, fn, aware)


def _adjacent_outputs(works: list, dtype: torch.dtype) -> torch.Tensor | None:
    """One flat tensor over the outputs of ``works`` if they exactly tile a contiguous range
    of one storage (in any order), else ``None``."""
    if any(w is None or not w.output.is_contiguous() or w.output.dtype is not dtype
           or w.output.numel() == 0 for w in works):
        return None
    if len(works) == 1:
        return works[0].output.view(-1)
    outputs = sorted((w.output for w in works), key=lambda t: t.data_ptr())
    storage = outputs[0].untyped_storage()
    item = dtype.itemsize
    end = outputs[0].data_ptr()
    for t in outputs:
        if t.data_ptr() != end or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += t.numel() * item
    first = outputs[0]
    total = (end - first.data_ptr()) // item
    return torch.empty(0, dtype=dtype, device=first.device).set_(
        storage, first.storage_offset(), (total,))


def _allgather(engine: EngineInterface, bucket: list[Response]) -> None:
    response = bucket[0]
    meta = _first_meta(response)
    dtype = from_name(meta.dtype)
    rows = tuple(meta.shape[1:])
    row = int(prod(rows))
    dims = [response.metas[r].shape[0] for r in range(engine.size)]   # nobody joined
    work = engine.local[response.name]
    dev = request_device([work])
    padded = len(set(dims)) > 1              # unequal blocks: padded to the largest
    with _scope(dev, [work]):
        mine = work.tensor.contiguous()
        out = _empty(dev, (sum(dims), *rows), dtype, work)
        if engine.size == 1:
            out.copy_(mine)
        elif out.numel():
            send, recv, block = mine.view(-1), out.view(-1), max(dims) * row
            if padded:
                trace.step("MEMCPY_IN_FUSION_BUFFER")
                send = _empty(dev, (block,), dtype).zero_()
                send[:mine.numel()].copy_(mine.reshape(-1))
                recv = _empty(dev, (block * engine.size,), dtype)
            trace.step("MPI_ALLGATHER")
            _collect(engine, dev, [send], [recv],
                     lambda a, b: collectives.allgather(a, b, comm=engine.comm),
                     "allgather", bucket=bucket)
            if padded:
                trace.step("MEMCPY_OUT_FUSION_BUFFER")
                torch.cat([recv[r * block:r * block + d * row] for r, d in enumerate(dims)],
                          out=out.view(-1))
    engine.finish(response.name, result=out, extra=dims)


def _broadcast(engine: EngineInterface, bucket: list[Response]) -> None:
    response = bucket[0]
    meta = _first_meta(response)
    work = engine.local[response.name]
    target = work.output                     # nobody joined: every rank has it
    dev = request_device([work])
    with _scope(dev, [work]):
        buf = target if target.is_contiguous() else target.contiguous()
        if buf.numel() and engine.size > 1:
            trace.step("MPI_BCAST")
            at_root = engine.rank == meta.root
            _collect(engine, dev, [buf.view(-1)] if at_root else [],
                     [] if at_root else [buf.view(-1)],
                     lambda a: collectives.broadcast(a, root=meta.root, comm=engine.comm),
                     "broadcast", meta.root, bucket)
            trace.step(None)
        if buf is not target:
            target.copy_(buf)
    engine.finish(response.name, result=target)


def _alltoall(engine: EngineInterface, bucket: list[Response]) -> None:
    """All-to-all along dimension 0 (one ``MPI_Alltoallv`` on the adapter's communicator;
    every rank's splits come from the negotiation table, no extra message)."""
    response = bucket[0]
    n, me = engine.size, engine.rank
    meta = response.metas[me]
    dtype = from_name(meta.dtype)
    rows = tuple(meta.shape[1:])
    row = int(prod(rows))
    splits = [alltoall_splits(response.metas[r], n) for r in range(n)]
    received = [splits[r][me] for r in range(n)]
    work = engine.local.get(response.name)
    dev = request_device([work])
    with _scope(dev, [work]):
        out = _empty(dev, (sum(received), *rows), dtype, work)
        source = work.tensor.contiguous()
        if n == 1:
            out.copy_(source[:received[0]])
        elif row and any(any(rank_splits) for rank_splits in splits):   # the same everywhere
            item = dtype.itemsize * row              # bytes per row

            def exchange(send: Any, recv: Any) -> None:   # mpi4py packs blocks in order
                engine.comm.Alltoallv([send, [s * item for s in splits[me]], MPI.BYTE],
                                      [recv, [s * item for s in received], MPI.BYTE])

            trace.step("MPI_ALLTOALL")
            _collect(engine, dev, [source.view(-1).view(torch.uint8)],
                     [out.view(-1).view(torch.uint8)], exchange)
    engine.finish(response.name, result=(out, torch.tensor(received, dtype=torch.int32)))


@contextlib.contextmanager
def _scope(dev: Any, works: list) -> Iterator[None]:
    """For device requests: wait for their submit-time events, run the body on the
    engine's stream, then synchronise it (results ready for any stream). Nothing on the
    host."""
    _await(dev, works)
    with _on_stream(dev):
        yield
    if dev is not None:
        dev.synchronize()


def _empty(dev: Any, shape: tuple, dtype: torch.dtype, work: Any = None) -> torch.Tensor:
    """A new tensor on ``dev`` (``None``: the host); a result for ``work``'s caller when
    ``work`` is given, else engine scratch."""
    if dev is None:
        return torch.empty(shape, dtype=dtype)
    return dev.empty(shape, dtype, None if work is None else work.ready)


def _collect(engine: EngineInterface, dev: Any, inputs: list, outputs: list,
             fn: Any, chunkable: str | None = None, root: int = 0,
             bucket: Sequence[Response] = ()) -> None:
    """``fn(*inputs, *outputs)`` on numpy views of flat host tensors, or for device
    tensors through :func:`_staged` (pinned host memory, or CUDA-aware MPI); in chunks
    (:mod:`.pipeline`) where the collective ``chunkable`` is staged on some rank (the
    negotiated metadata of ``bucket``, the responses it runs) and spans several chunks."""
    first = (inputs or outputs)[0]
    if chunkable is not None and pipeline.chunked(engine, chunkable, first.numel(),
                                                  first.element_size(), bucket):
        pipeline.run(engine, dev, chunkable, inputs, outputs, fn, root)
    elif dev is None:
        fn(*(numpy_view(t) for t in (*inputs, *outputs)))
    else:
        _staged(engine, dev, inputs, outputs, fn)


def alltoall_splits(meta: Any, size: int) -> tuple[int, ...]:
    """The rows ``meta``'s rank sends to each rank (its splits, or dimension 0 evenly)."""
    return tuple(meta.splits) if meta.splits else (meta.shape[0] // size,) * size


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Rows of dimension 0 that each rank gets: Horovod's rule, ``rows // size`` each and
    one more for the first ``rows % size`` ranks."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _reducescatter_bucket(engine: EngineInterface, bucket: list[Response]) -> None:
    """Reduce-scatter of one or more tensors (same reduction dtype, op and scaling) as one
    ``mpicoll.reduce_scatter``: rank ``r``'s block is the concatenation of its rows of every
    tensor, padded with zeros to the largest block, so blocks are equal."""
    n, me = engine.size, engine.rank
    meta = _first_meta(bucket[0])
    dtype = from_name(meta.dtype)
    rdtype = reduce_dtype(dtype)
    op = ReduceOp(meta.op)
    shapes = [_first_meta(response).shape for response in bucket]
    counts = [[rows * int(prod(shape[1:])) for rows in reducescatter_rows(shape[0], n)]
              for shape in shapes]                   # per tensor: elements per rank
    block = max(sum(c[r] for c in counts) for r in range(n))
    works = [engine.local.get(r.name) for r in bucket]
    dev = request_device(works)
    results = []
    with _scope(dev, works):
        trace.step("MEMCPY_IN_FUSION_BUFFER")
        send = engine.fusion_buffer(rdtype, block * n, dev)
        send.zero_()
        offsets = [0] * n                            # filled part of each rank's block
        for work, count in zip(works, counts):
            for r, rows in enumerate(torch.split(work.tensor.reshape(-1), count)):
                dst = r * block + offsets[r]
                send[dst:dst + count[r]].copy_(rows)
                offsets[r] += count[r]
        _scale(send, meta.prescale)
        recv = _empty(dev, (block,), rdtype, works[0])
        if n == 1:
            recv.copy_(send)
        elif block:
            trace.step("MPI_REDUCESCATTER")
            _collect(engine, dev, [send], [recv],
                     lambda a, b: collectives.reduce_scatter(a, b, op=mpicoll_op(op),
                                                             comm=engine.comm),
                     "reduce_scatter", bucket=bucket)
        trace.step("MEMCPY_OUT_FUSION_BUFFER")
        _finalize(recv, op, meta.postscale, n)
        mine = [count[me] for count in counts]
        for shape, part in zip(shapes, torch.split(recv[:sum(mine)], mine)):
            out = part.to(dtype).view(reducescatter_rows(shape[0], n)[me], *shape[1:])
            results.append(out.clone() if rdtype is dtype and len(bucket) > 1 else out)
    for response, out in zip(bucket, results):
        engine.finish(response.name, result=out)


def _barrier(engine: EngineInterface, bucket: list[Response]) -> None:
    engine.finish(bucket[0].name, result=None)


def _join(engine: EngineInterface, bucket: list[Response]) -> None:
    engine.finish(JOIN, result=bucket[0].last_joined)


def _shutdown(engine: EngineInterface, bucket: list[Response]) -> None:
    engine.finish(bucket[0].name, result=None)      # this rank's own request, if it asked
    engine.stop(bucket[0].metas)


_RUNNERS = {"allgather": _allgather, "broadcast": _broadcast, "alltoall": _alltoall,
            "barrier": _barrier,
            "join": _join, "shutdown": _shutdown}
