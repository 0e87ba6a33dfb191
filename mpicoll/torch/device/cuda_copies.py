"""The staged pipeline's device copies for torch CUDA tensors (torch's streams and events).

:class:`CudaCopies` implements :class:`mpicoll.gpu.staging.Copies` with torch only (no
CuPy), so :func:`mpicoll.gpu.staging.staged` runs a ``mpicoll.torch`` request in chunks:
the device-to-host copy of chunk k+1 (on the *d2h* stream), the host collective on chunk
k and the host-to-device copy of chunk k-1 (on the *h2d* stream) overlap. Both copy streams
belong to the device's :class:`mpicoll.torch.device.tensors.CudaDevice` (created once, next to the
engine's stream) and first wait for the engine's stream, which produced the buffers (it
waited for the callers' submit-time events and packed the fusion buffer).

The pipeline sees a flat CUDA tensor as a :class:`Span`: the few numpy-like attributes it
reads (``ndim``, ``size``, ``dtype`` as numpy's, slicing).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ...gpu.slots import HostSlots
from ..engine.dtypes import numpy_dtype

__all__ = ["Span", "CudaCopies"]


class Span:
    """A flat contiguous CUDA tensor as the staged pipeline reads an array."""

    __slots__ = ("tensor",)
    ndim = 1

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def size(self) -> int:
        """Elements."""
        return self.tensor.numel()

    @property
    def shape(self) -> tuple[int]:
        """``(size,)``."""
        return (self.tensor.numel(),)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the tensor's host views."""
        return numpy_dtype(self.tensor.dtype)

    def __getitem__(self, index: slice) -> "Span":
        return Span(self.tensor[index])


class CudaCopies:
    """:class:`mpicoll.gpu.staging.Copies` on one CUDA device, with torch.

    Args:
        engine_stream: the stream that produced the buffers (the engine's).
        streams: ``{"d2h": stream, "h2d": stream}``, the device's two copy streams.
        host_pool: the engine's pinned host slots for this device.
    """

    def __init__(self, engine_stream: Any, streams: dict[str, Any],
                 host_pool: HostSlots) -> None:
        self.engine_stream = engine_stream
        self.streams = streams
        self.host_pool = host_pool

    def as_array(self, obj: torch.Tensor) -> Span:
        """A :class:`Span` over flat contiguous ``obj``."""
        return Span(obj.reshape(-1))

    def empty_like(self, obj: torch.Tensor) -> torch.Tensor:
        """``torch.empty_like`` (the adapter always passes its outputs)."""
        return torch.empty_like(obj)

    def empty(self, shape: tuple, dtype: Any, like: torch.Tensor) -> torch.Tensor:
        """A new tensor on ``like``'s device."""
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)

    def begin(self, objs: Sequence[Any]) -> None:
        """Both copy streams wait (on the device) for the engine's stream."""
        ready = torch.cuda.Event()
        ready.record(self.engine_stream)
        for stream in self.streams.values():
            stream.wait_event(ready)

    def d2h(self, dst: np.ndarray, src: Span, chunk: int) -> None:
        """Queue an asynchronous copy into the pinned slot ``dst`` on the d2h stream."""
        with torch.cuda.stream(self.streams["d2h"]):
            torch.from_numpy(dst).copy_(src.tensor, non_blocking=True)

    def h2d(self, dst: Span, src: np.ndarray, chunk: int) -> None:
        """Queue an asynchronous copy from the pinned slot ``src`` on the h2d stream."""
        with torch.cuda.stream(self.streams["h2d"]):
            dst.tensor.copy_(torch.from_numpy(src), non_blocking=True)

    def record(self, stream: str, chunk: int) -> torch.cuda.Event:
        """A new event recorded on ``stream``."""
        event = torch.cuda.Event()
        event.record(self.streams[stream])
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        """Block the host until ``event`` has completed."""
        event.synchronize()

    def stream_wait(self, stream: str, event: torch.cuda.Event) -> None:
        """``stream`` waits for ``event`` on the device (the host does not block)."""
        self.streams[stream].wait_event(event)

    finish = wait

    def drain(self) -> None:
        """Block until both copy streams are idle."""
        for stream in self.streams.values():
            stream.synchronize()
