"""Chunked, pipelined staging of ``mpicoll.torch`` requests: the core's staged pipeline
(:func:`mpicoll.gpu.staging.staged`) run on the adapter's flat tensors.

A request on device tensors that the engine stages through pinned host memory (MPI not
CUDA-aware) and whose buffer spans more than one chunk (``MPICOLL_STAGING_CHUNK_BYTES``,
``MPICOLL_STAGING_BYTES``: :func:`mpicoll.gpu.staging.chunks`) runs as a series of host
collectives on chunks: the device-to-host copy of chunk k+1, the host collective on
chunk k and the host-to-device copy of chunk k-1 overlap on the device's two copy
streams (:meth:`TensorDevice.copies <mpicoll.torch.device.tensors.TensorDevice.copies>`). The
collectives whose layout allows it: all-reduce (fused buckets, DistributedOptimizer's
flat buffers, Average, pre- and postscale: elementwise), broadcast (elementwise),
all-gather and reduce-scatter (the core's packed chunks of every rank's block).
All-to-all (per-rank counts of bytes: the core's pipeline has no layout for it) and
Adasum (dot products over whole tensors) stay one copy each way.

Every rank must make the same host calls, but a rank knows only where its *own* tensors
are (ranks may disagree: device here, host there; aware or staged). So each rank says
in its negotiated metadata whether it stages a request
(:attr:`Meta.stages <mpicoll.torch.engine.negotiation.Meta>`, set at submission), and every
rank reads the same answer from the response: if any rank stages a request that spans
several chunks, every rank runs the chunks: staging ranks (and CUDA-aware ones) with
their device's copies, host ranks with plain numpy copies into host slots
(:class:`mpicoll.gpu.numpy_copies.NumpyCopies`). If none does, nothing changes: one host
collective on the host buffers, or device pointers to a CUDA-aware MPI. No message beyond
the negotiation's. The staging settings are read at a communicator's first request
(:func:`forget` reads them again).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...buffers import IN_PLACE
from ...context import get_context
from ...gpu import staging
from ...gpu.numpy_copies import NumpyCopies
from .dtypes import move_dtype, numpy_view

__all__ = ["CHUNKABLE", "chunked", "run", "forget"]

#: The collectives (the core's names) whose staged requests run in chunks.
CHUNKABLE = ("allreduce", "broadcast", "allgather", "reduce_scatter")

_KEY = "mpicoll.torch.engine.pipeline.settings"


class _HostStage:
    """What :meth:`Engine.host_slots` needs to keep host ranks' slots (plain memory)."""

    name = "host"

    @staticmethod
    def pinned(nbytes: int) -> np.ndarray:
        return np.empty(int(nbytes), np.uint8)


class _Settings:
    """Per engine communicator (the same on every rank): the staging settings, read once."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Read the settings again."""
        self.chunk_bytes = staging.chunk_bytes_setting()
        self.limit = staging.staging_bytes()


def _settings(engine: Any) -> _Settings:
    return get_context(engine.comm).resource(_KEY, _Settings)


def chunked(engine: Any, collective: str, count: int, itemsize: int,
            responses: Sequence[Any]) -> bool:
    """Whether every rank runs this request in chunks (see the module doc): some rank
    stages it (the negotiated metadata of ``responses``, the responses it runs) and it
    spans several chunks. No message; the same on every rank.

    Args:
        engine: the engine (its ``comm`` and ``size``).
        collective: one of :data:`CHUNKABLE`.
        count: elements (``reduce_scatter``: the whole send buffer; ``allgather``: one
            rank's block), equal on every rank. itemsize: bytes per element.
        responses: the request's responses (a fused bucket, or one).
    Raises:
        ValueError: a staging variable is not a valid number of bytes (on every rank).
    """
    if engine.size < 2 or not any(meta.stages for response in responses
                                  for meta in response.metas.values()):
        return False
    settings = _settings(engine)
    _, n = staging.chunks(collective, count, itemsize, engine.size, settings.chunk_bytes,
                          settings.limit)
    return n > 1


def forget(engine: Any) -> None:
    """Read the staging settings of ``engine``'s communicator again (tests; call on every
    rank at the same point)."""
    _settings(engine).reset()


def _args(collective: str, inputs: Sequence[Any], outputs: Sequence[Any], root: int,
          ) -> tuple[tuple, Callable[[Callable[..., Any]], Callable[[tuple], Any]]]:
    """The staged call's arguments, and how a host call becomes ``fn``'s arguments."""
    if collective == "allreduce":                   # in place on the output
        return (IN_PLACE, outputs[0], None), lambda fn: lambda a: fn(a[1])
    if collective == "broadcast":
        return ((inputs or outputs)[0], root), lambda fn: lambda a: fn(a[0])
    if collective == "allgather":
        return (inputs[0], outputs[0]), lambda fn: lambda a: fn(*a)
    return (inputs[0], outputs[0], None), lambda fn: lambda a: fn(a[0], a[1])  # reduce_scatter


def run(engine: Any, dev: Any, collective: str, inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor], fn: Callable[..., Any], root: int = 0) -> None:
    """Run ``fn`` (the host collective, as :func:`mpicoll.torch.device.tensors.host_run` calls it)
    in chunks through :func:`mpicoll.gpu.staging.staged`.

    Args:
        engine: the engine (``comm``, ``host_slots``).
        dev: the tensors' device (``None``: host tensors, copied into host slots).
        collective: one of :data:`CHUNKABLE`; ``inputs`` and ``outputs`` as for
            ``host_run``: allreduce ``[], [flat]`` (in place); broadcast ``[buf], []`` at
            the root, ``[], [buf]`` elsewhere; allgather and reduce_scatter
            ``[send], [recv]``. Flat contiguous tensors.
        fn: ``fn(*buffers)`` on numpy arrays: allreduce ``fn(buf)``, broadcast ``fn(buf)``,
            allgather ``fn(IN_PLACE, packed)``, reduce_scatter ``fn(packed, mine)``.
        root: the broadcast's root.
    """
    if dev is None:
        copies = NumpyCopies(engine.host_slots(_HostStage))
        move = numpy_view
    else:
        copies = dev.copies(engine.host_slots(dev))

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.view(move_dtype(t.dtype))
    args, host = _args(collective, [move(t) for t in inputs], [move(t) for t in outputs],
                       root)
    settings = _settings(engine)
    staging.staged(collective, args, host(fn), comm=engine.comm, copies=copies,
                   chunk_bytes=settings.chunk_bytes, staging_limit=settings.limit)
