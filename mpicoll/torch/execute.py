"""Running negotiated responses: fused all-reduce, all-gather, broadcast, barrier, join.

Called only by the thread that runs the negotiation round, with the same responses in the
same order on every rank, so every rank issues the same mpicoll collectives on the
adapter's private communicator. A rank without a local request for a response (it called
``join()``) takes part with zeros (all-reduce), no rows (all-gather) or a scratch buffer
(broadcast).

The engine passes itself; :class:`EngineInterface` names what is used of it, so this module
does not import :mod:`mpicoll.torch.engine` (which imports this one).
"""
from __future__ import annotations

import logging
from math import prod
from typing import Any, Protocol

import numpy as np
import torch

from .. import collectives
from ..buffers import IN_PLACE
from ..errors import CollectiveError, MismatchError
from .dtypes import from_name, numpy_view, reduce_dtype
from .fusion import numel, plan_buckets
from .negotiation import JOIN, Response
from .ops import Average, ReduceOp, mpicoll_op
from .settings import Settings

__all__ = ["run_responses", "EngineInterface"]

log = logging.getLogger("mpicoll.torch.execute")


class EngineInterface(Protocol):
    """What running responses uses of :class:`mpicoll.torch.engine.Engine`."""

    settings: Settings
    comm: Any
    size: int
    local: dict[str, Any]

    def finish(self, key: str, result: Any = None, error: BaseException | None = None,
               extra: Any = None) -> None:
        """Complete this rank's request ``key`` (if it has one)."""

    def fusion_buffer(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """A flat scratch tensor of ``count`` elements."""

    def persistent_view(self, flat: torch.Tensor) -> np.ndarray:
        """The same numpy view of ``flat`` every time."""

    def stop(self) -> None:
        """Make the engine thread leave its loop."""


def run_responses(engine: EngineInterface, responses: list[Response]) -> None:
    """Run one round's responses (errors first, then fused all-reduces, then the rest)."""
    ok_allreduce = []
    others = []
    for response in responses:
        if response.error is not None:
            cls = MismatchError if "disagree" in response.error else CollectiveError
            engine.finish(_local_key(response), error=cls(response.error))
        elif response.kind == "allreduce":
            ok_allreduce.append(response)
        else:
            others.append(response)
    for bucket in plan_buckets(ok_allreduce, max(engine.settings.fusion_threshold, 1)):
        if engine.settings.fusion_threshold == 0 and len(bucket) > 1:
            for response in bucket:
                _guarded(engine, [response], _allreduce_bucket)
        else:
            _guarded(engine, bucket, _allreduce_bucket)
    for response in others:
        _guarded(engine, [response], _RUNNERS[response.kind])


def _local_key(response: Response) -> str:
    return JOIN if response.kind == "join" else response.name


def _guarded(engine: EngineInterface, bucket: list[Response], run: Any) -> None:
    try:
        run(engine, bucket)
    except Exception as exc:  # noqa: BLE001  (reported through the futures)
        log.exception("mpicoll.torch: %s failed", [r.name for r in bucket])
        for response in bucket:
            engine.finish(_local_key(response), error=exc)


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


def _allreduce_bucket(engine: EngineInterface, bucket: list[Response]) -> None:
    meta = _first_meta(bucket[0])
    dtype = from_name(meta.dtype)
    rdtype = reduce_dtype(dtype)
    op = ReduceOp(meta.op)
    works = [engine.local.get(r.name) for r in bucket]
    adjacent = _adjacent_outputs(works, dtype) if rdtype is dtype else None
    if adjacent is not None:
        # Zero-copy: the outputs tile one contiguous range (a single tensor, or gradients
        # that DistributedOptimizer keeps as views of one flat buffer): reduce it in place.
        flat = adjacent
        for work in works:
            if work.tensor is not work.output:
                work.output.copy_(work.tensor)
        segments = [(0, 0)] * len(works)
        in_place = True
    else:
        total = sum(numel(_first_meta(r)) for r in bucket)
        flat = engine.fusion_buffer(rdtype, total)
        segments = []
        offset = 0
        for response, work in zip(bucket, works):
            n = numel(_first_meta(response))
            if work is None:
                flat[offset:offset + n].zero_()
            else:
                flat[offset:offset + n].copy_(work.tensor.reshape(-1))
            segments.append((offset, n))
            offset += n
        in_place = False
    _scale(flat, meta.prescale)
    if flat.numel() and engine.size > 1:
        array = engine.persistent_view(flat) if in_place and meta.layout else numpy_view(flat)
        collectives.allreduce(IN_PLACE, array, op=mpicoll_op(op), comm=engine.comm,
                              algorithm=engine.settings.algorithm)
    _finalize(flat, op, meta.postscale, engine.size)
    for response, work, (offset, n) in zip(bucket, works, segments):
        if work is None:
            continue
        if not in_place:
            work.output.copy_(flat[offset:offset + n].view(work.output.shape))
        engine.finish(response.name, result=work.output)


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
    return torch.empty(0, dtype=dtype).set_(storage, first.storage_offset(), (total,))


def _allgather(engine: EngineInterface, bucket: list[Response]) -> None:
    response = bucket[0]
    meta = _first_meta(response)
    dtype = from_name(meta.dtype)
    rows = tuple(meta.shape[1:])
    row = int(prod(rows))
    dims = [response.metas[r].shape[0] if r in response.metas else 0
            for r in range(engine.size)]
    work = engine.local.get(response.name)
    mine = (work.tensor.contiguous() if work is not None
            else torch.empty((0, *rows), dtype=dtype))
    out = torch.empty((sum(dims), *rows), dtype=dtype)
    if out.numel():
        if engine.size == 1:
            out.copy_(mine)
        elif len(set(dims)) == 1:
            collectives.allgather(numpy_view(mine), numpy_view(out), comm=engine.comm)
        else:
            block = max(dims) * row
            send = torch.zeros(block, dtype=dtype)
            send[:mine.numel()].copy_(mine.reshape(-1))
            recv = torch.empty(block * engine.size, dtype=dtype)
            collectives.allgather(numpy_view(send), numpy_view(recv), comm=engine.comm)
            flat = out.view(-1)
            offset = 0
            for r, d in enumerate(dims):
                flat[offset:offset + d * row].copy_(recv[r * block:r * block + d * row])
                offset += d * row
    engine.finish(response.name, result=out, extra=dims)


def _broadcast(engine: EngineInterface, bucket: list[Response]) -> None:
    response = bucket[0]
    meta = _first_meta(response)
    work = engine.local.get(response.name)
    target = work.output if work is not None else torch.empty(meta.shape,
                                                               dtype=from_name(meta.dtype))
    buf = target if target.is_contiguous() else target.contiguous()
    if buf.numel() and engine.size > 1:
        collectives.broadcast(numpy_view(buf), root=meta.root, comm=engine.comm)
    if buf is not target:
        target.copy_(buf)
    engine.finish(response.name, result=target)


def _barrier(engine: EngineInterface, bucket: list[Response]) -> None:
    engine.finish(bucket[0].name, result=None)


def _join(engine: EngineInterface, bucket: list[Response]) -> None:
    engine.finish(JOIN, result=bucket[0].last_joined)


def _shutdown(engine: EngineInterface, bucket: list[Response]) -> None:
    engine.stop()
    engine.finish(bucket[0].name, result=None)


_RUNNERS = {"allgather": _allgather, "broadcast": _broadcast, "barrier": _barrier,
            "join": _join, "shutdown": _shutdown}
