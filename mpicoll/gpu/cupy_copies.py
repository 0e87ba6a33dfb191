"""The staged path's device copies with CuPy: pinned slots, two copy streams, events.

Imported only when a device array reaches the staged path (it imports CuPy). One
:class:`CupyCopies` per CUDA device and thread, holding that device's d2h and h2d
streams (non-blocking: they never wait for the legacy default stream implicitly) and the
pinned host slots (``MPICOLL_STAGING_BYTES`` bounds what is kept between calls).

User objects become CuPy arrays without a copy: CuPy arrays as they are, objects with
``__cuda_array_interface__`` through ``cupy.asarray``, DLPack-only objects through
``cupy.from_dlpack``. New results keep the family of the argument they are made like
(a torch tensor for torch, a CuPy array otherwise).
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import cupy
import numpy as np

from . import arrays
from .slots import HostSlots

__all__ = ["CupyCopies", "copies_for", "pinned_empty"]

_MEMCPY_H2D = 1  # cudaMemcpyHostToDevice
_MEMCPY_D2H = 2  # cudaMemcpyDeviceToHost

_per_thread = threading.local()  # .copies: {device: CupyCopies} of the calling thread


def pinned_empty(nbytes: int) -> np.ndarray:
    """A numpy uint8 array of ``nbytes`` in pinned (page-locked) host memory."""
    mem = cupy.cuda.alloc_pinned_memory(max(int(nbytes), 1))
    return np.frombuffer(mem, np.uint8, int(nbytes))


class CupyCopies:
    """:class:`mpicoll.gpu.staging.Copies` on one CUDA device, with CuPy.

    Args:
        device: the CUDA device ordinal.
    """

    def __init__(self, device: int) -> None:
        self.device = int(device)
        with cupy.cuda.Device(self.device):
            self.streams = {"d2h": cupy.cuda.Stream(non_blocking=True),
                            "h2d": cupy.cuda.Stream(non_blocking=True)}
        self.host_pool = HostSlots(pinned_empty)

    # arrays --------------------------------------------------------------------------
    def as_array(self, obj: Any) -> Any:
        """A CuPy view of ``obj`` (no copy)."""
        if isinstance(obj, cupy.ndarray):
            return obj
        with cupy.cuda.Device(self.device):
            if arrays.cuda_interface(obj) is not None:
                return cupy.asarray(obj)
            return cupy.from_dlpack(obj)

    def empty_like(self, obj: Any) -> Any:
        """A new array like ``obj``: ``torch.empty_like`` for torch, CuPy otherwise."""
        if arrays.package_of(obj) == "torch":
            import torch  # noqa: PLC0415

            return torch.empty_like(obj)
        with cupy.cuda.Device(self.device):
            return cupy.empty_like(self.as_array(obj))

    def empty(self, shape: tuple, dtype: Any, like: Any) -> Any:
        """A new C-ordered array of ``shape`` on this device, in ``like``'s family."""
        if arrays.package_of(like) == "torch":
            import torch  # noqa: PLC0415

            return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
        with cupy.cuda.Device(self.device):
            return cupy.empty(tuple(shape), dtype=dtype)

    # streams -------------------------------------------------------------------------
    def begin(self, objs: Sequence[Any]) -> None:
        """Both copy streams wait for every producer stream of ``objs`` (on the device;
        the host synchronises the device for objects that name none and do not say their
        data is ready: :func:`mpicoll.gpu.arrays.unsynchronised`)."""
        seen: set[int] = set()
        with cupy.cuda.Device(self.device):
            for obj in objs:
                ptr = arrays.producer_stream(obj)  # None for None
                if ptr is None and obj is not None and arrays.unsynchronised(obj):
                    cupy.cuda.runtime.deviceSynchronize()
                if ptr is None or ptr in seen:
                    continue
                seen.add(ptr)
                event = cupy.cuda.Event(disable_timing=True)
                event.record(cupy.cuda.ExternalStream(ptr, self.device))
                for stream in self.streams.values():
                    stream.wait_event(event)

    def d2h(self, dst: np.ndarray, src: Any, chunk: int) -> None:
        """``cudaMemcpyAsync`` device to pinned host, on the d2h stream."""
        cupy.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes,
                                      _MEMCPY_D2H, self.streams["d2h"].ptr)

    def h2d(self, dst: Any, src: np.ndarray, chunk: int) -> None:
        """``cudaMemcpyAsync`` pinned host to device, on the h2d stream."""
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                      _MEMCPY_H2D, self.streams["h2d"].ptr)

    def record(self, stream: str, chunk: int) -> Any:
        """A new event recorded on ``stream``."""
        event = cupy.cuda.Event(disable_timing=True)
        event.record(self.streams[stream])
        return event

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` completes (as ``finish``: until the last h2d
        copy has completed)."""
        event.synchronize()

    finish = wait

    def stream_wait(self, stream: str, event: Any) -> None:
        """``stream`` waits for ``event`` on the device (the host does not block)."""
        self.streams[stream].wait_event(event)

    def drain(self) -> None:
        """Block until both copy streams are idle."""
        for stream in self.streams.values():
            stream.synchronize()


def copies_for(args: Sequence[Any]) -> CupyCopies:
    """The calling thread's :class:`CupyCopies` of the device holding the first device
    array in ``args`` (threads calling at once must not share pinned slots)."""
    device = next((arrays.device_id(a) for a in args if arrays.is_device(a)), None)
    if device is None:
        device = cupy.cuda.runtime.getDevice()
    mine = _per_thread.__dict__.setdefault("copies", {})
    hit = mine.get(device)
    if hit is None:
        hit = mine[device] = CupyCopies(device)
    return hit
