"""Device tensors in the adapter: where a request's tensors live, the engine's stream, and
the staged (pinned host) path.

A request whose tensors are on a CUDA device runs as on the host, with four differences,
all going through a :class:`TensorDevice` (:class:`CudaDevice` here, or another
implementation registered with :func:`register`):

- at submission, an event is recorded on the caller's current stream
  (:meth:`TensorDevice.record`); the engine's own stream waits for it
  (:meth:`TensorDevice.wait`) before it reads or writes the request's tensors;
- packing into the fusion buffer (on the device), scaling and unpacking run on the
  engine's stream (:meth:`TensorDevice.stream`);
- the collective itself (:func:`host_run`): with CUDA-aware MPI (and CuPy for mpicoll's
  device reductions) the device tensors go to mpicoll's collectives, which hand device
  pointers to MPI (:mod:`mpicoll.gpu.route`); otherwise each buffer is copied once to
  pinned host memory, the host collective runs on numpy views of it, and each result is
  copied back once. All-reduce, broadcast, all-gather and reduce-scatter buffers that
  span several staging chunks go through the core's chunked pipeline instead
  (:mod:`mpicoll.torch.engine.pipeline`, with the device's :meth:`TensorDevice.copies`);
- before the request's future completes, the engine's stream is synchronised
  (:meth:`TensorDevice.synchronize`): results are ready for any stream when
  ``synchronize()`` returns, as on the host.

:func:`device_of` is the host path's only cost: one attribute test per tensor (and one
test of an empty list).

Devices: CUDA tensors (``tensor.is_cuda``) belong to the library's :class:`CudaDevice` of
their index. Other tensors belong to the first device registered with :func:`register`
(or :func:`registered`, a context manager) whose :meth:`TensorDevice.claims` accepts them
(the CPU tests register a host stand-in this way); the rest are host tensors.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..engine.dtypes import numpy_dtype, move_dtype

__all__ = ["TensorDevice", "CudaDevice", "device_of", "request_device", "same_device",
           "register", "unregister", "registered", "host_run", "ALIGN"]

log = logging.getLogger("mpicoll.torch.device.tensors")

#: Byte alignment of each buffer inside a pinned host slot (a multiple of every itemsize).
ALIGN = 64


class TensorDevice(Protocol):
    """What the engine needs of a device (see the module doc)."""

    #: Shown in errors (``"cuda:0"``).
    name: str

    def claims(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in this device's memory."""

    def record(self) -> Any:
        """An event on the calling thread's current stream of this device (at submit)."""

    def wait(self, event: Any) -> None:
        """Make the engine's stream wait for ``event`` (recorded by :meth:`record`)."""

    def stream(self) -> contextlib.AbstractContextManager:
        """Make the engine's stream current: device work inside runs on it."""

    def empty(self, shape: tuple, dtype: torch.dtype, event: Any = None) -> torch.Tensor:
        """A new tensor on the device, for the stream ``event`` was recorded on (results
        handed to the caller), else for the engine's stream (scratch)."""

    def pinned(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of page-locked host memory as a numpy uint8 array."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue on the engine's stream a copy of device ``src`` into host ``dst``."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue on the engine's stream a copy of host ``src`` into device ``dst``."""

    def synchronize(self) -> None:
        """Block until everything queued on the engine's stream has run."""

    def aware(self) -> bool:
        """Whether device memory goes to MPI directly (no staging)."""

    def buffer(self, tensor: torch.Tensor) -> Any:
        """What a collective gets for device ``tensor`` with CUDA-aware MPI."""

    def after_aware(self) -> None:
        """After a collective on device memory: block until its device work is done."""

    def copies(self, slots: Any) -> Any:
        """The staged pipeline's device interface (:class:`mpicoll.gpu.staging.Copies`:
        two copy streams that first wait for the engine's stream, events) with the
        engine's pinned host slots ``slots``."""


class CudaDevice:
    """:class:`TensorDevice` of one CUDA device, with torch's streams and events.

    The engine's stream is created at the first device request. CUDA-awareness is
    :func:`mpicoll.gpu.detect.cuda_aware`, and needs CuPy (mpicoll's device reductions):
    without it, device requests are staged (logged once).
    """

    def __init__(self, index: int) -> None:
        self.index = int(index)
        self.name = f"cuda:{self.index}"
        self._stream: Any = None
        self._copy_streams: dict[str, Any] = {}
        self._aware: bool | None = None

    def claims(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_cuda) and tensor.get_device() == self.index

    def _engine_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.index)
        return self._stream

    def record(self) -> Any:
        stream = torch.cuda.current_stream(self.index)
        event = torch.cuda.Event()
        event.record(stream)
        return (event, stream)

    def wait(self, event: Any) -> None:
        ready, stream = event
        if stream.device.index == self.index:
            self._engine_stream().wait_event(ready)
        else:
            ready.synchronize()              # another device's stream: wait on the host

    def stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._engine_stream())

    def empty(self, shape: tuple, dtype: torch.dtype, event: Any = None) -> torch.Tensor:
        # the caching allocator ties a block to the stream it was allocated on: results
        # belong to the caller's stream, scratch to the engine's
        engine = self._engine_stream()
        stream = event[1] if event is not None else engine
        with torch.cuda.stream(stream):
            out = torch.empty(shape, dtype=dtype, device=self.name)
        if stream != engine:
            # a block the caller's stream freed may still be in use by work queued on it:
            # the engine's stream (and the copy streams, which wait for it) writes after
            engine.wait_stream(stream)
        return out

    def pinned(self, nbytes: int) -> np.ndarray:
        return torch.empty(max(int(nbytes), 1), dtype=torch.uint8,
                           pin_memory=True).numpy()[:int(nbytes)]

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._engine_stream()):
            dst.copy_(src, non_blocking=True)

    to_device = to_host                      # copy_ takes either direction

    def synchronize(self) -> None:
        self._engine_stream().synchronize()

    def aware(self) -> bool:
        if self._aware is None:
            from ...gpu import detect  # noqa: PLC0415

            aware, why = detect.cuda_aware()
            if aware:
                try:
                    import cupy  # noqa: F401, PLC0415
                except ImportError:
                    log.warning("MPI is CUDA-aware (%s) but CuPy is not installed: "
                                "mpicoll.torch stages CUDA tensors through host memory", why)
                    aware = False
            self._aware = aware
        return self._aware

    def copies(self, slots: Any) -> Any:
        """:class:`mpicoll.torch.device.cuda_copies.CudaCopies` on this device's two copy
        streams (created at the first chunked request)."""
        from .cuda_copies import CudaCopies  # noqa: PLC0415

        if not self._copy_streams:
            self._copy_streams = {name: torch.cuda.Stream(device=self.index)
                                  for name in ("d2h", "h2d")}
        return CudaCopies(self._engine_stream(), self._copy_streams, slots)

    def buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor itself: mpicoll's collectives route CUDA tensors
        (:mod:`mpicoll.gpu.route`: producer synchronised, a zero-copy CuPy view)."""
        return tensor

    def after_aware(self) -> None:
        """After a collective on device pointers: wait for CuPy's reductions (they run on
        CuPy's current stream of the engine thread)."""
        import cupy  # noqa: PLC0415

        with cupy.cuda.Device(self.index):
            cupy.cuda.get_current_stream().synchronize()


_cuda: dict[int, CudaDevice] = {}
_cuda_lock = threading.Lock()
#: Devices of :func:`register`, in registration order (empty: only CUDA and host).
_registered: list[TensorDevice] = []


def _cuda_device(index: int) -> CudaDevice:
    hit = _cuda.get(index)
    if hit is None:
        with _cuda_lock:
            hit = _cuda.setdefault(index, CudaDevice(index))
    return hit


def device_of(tensor: Any) -> TensorDevice | None:
    """The device holding ``tensor``; ``None`` for host memory (and for ``None``)."""
    if tensor is None:
        return None
    if tensor.is_cuda:
        return _cuda_device(tensor.get_device())
    for dev in _registered:
        if dev.claims(tensor):
            return dev
    return None


def same_device(tensors: Sequence[Any], what: str = "tensors") -> TensorDevice | None:
    """The one device of ``tensors`` (``None``: all on the host).

    Raises:
        TypeError: host and device tensors mixed, or tensors on different devices.
    """
    devices = [device_of(t) for t in tensors if t is not None]
    if any(dev is not devices[0] for dev in devices):
        names = sorted({"cpu" if d is None else d.name for d in devices})
        raise TypeError(f"{what} are on {' and '.join(names)}; pass every tensor of one "
                        f"call on one device (or all on the host)")
    return devices[0] if devices else None


def request_device(works: Sequence[Any]) -> TensorDevice | None:
    """The device a bucket of requests runs on: the first device tensor's (``None``: all
    on the host). Host tensors fused with device ones are copied in and out (ranks fuse
    what they negotiated, whatever device each rank's tensors are on)."""
    for work in works:
        for t in () if work is None else (work.tensor, work.output):
            dev = device_of(t)
            if dev is not None:
                return dev
    return None


def register(device: TensorDevice) -> None:
    """Tensors that ``device`` claims (:meth:`TensorDevice.claims`) are its device tensors
    from now on (CUDA tensors stay :class:`CudaDevice`'s)."""
    _registered.append(device)


def unregister(device: TensorDevice) -> None:
    """Undo :func:`register` (nothing if ``device`` is not registered)."""
    if device in _registered:
        _registered.remove(device)


@contextlib.contextmanager
def registered(*devices: TensorDevice) -> Iterator[None]:
    """Within: ``devices`` are registered (:func:`register`)."""
    for dev in devices:
        register(dev)
    try:
        yield
    finally:
        for dev in devices:
            unregister(dev)


def host_run(dev: TensorDevice, slots: Any, limit: int, inputs: Sequence[torch.Tensor],
             outputs: Sequence[torch.Tensor], fn: Callable[..., Any],
             aware: bool = True) -> None:
    """Run ``fn`` (a collective) on flat contiguous device tensors: ``fn(*buffers)``, one
    buffer per distinct tensor of ``inputs + outputs`` in that order (a tensor that is both,
    in place, comes once).

    With CUDA-aware MPI (and ``aware``) the buffers are the device tensors themselves, after
    the engine's stream is synchronised; otherwise numpy views of pinned host memory: each
    input copied there once before, each output copied back once after. bfloat16 moves as
    int16 either way. The caller synchronises the
    engine's stream before handing the outputs out.

    Args:
        dev: the device. slots: the engine's :class:`mpicoll.gpu.slots.HostSlots` for it.
        limit: bytes of pinned memory kept between calls (``MPICOLL_STAGING_BYTES``).
        inputs, outputs: flat contiguous tensors on ``dev``.
        fn: the collective (the same call on every rank, whatever device they use).
        aware: ``False`` stages even with CUDA-aware MPI (host-only algorithms).
    """
    moved = [t.view(move_dtype(t.dtype)) for t in (*inputs, *outputs)]
    distinct = list({_key(t): t for t in moved}.values())
    if aware and dev.aware():
        dev.synchronize()
        fn(*(dev.buffer(t) for t in distinct))
        dev.after_aware()
        return
    views = {}
    slot = slots.get(1, sum(_aligned(t) for t in distinct), limit)[0]
    offset = 0
    for t in distinct:
        dtype = numpy_dtype(t.dtype)
        views[_key(t)] = slots.view(slot, dtype, offset // dtype.itemsize, t.numel())
        offset += _aligned(t)
    for t in {_key(t): t for t in moved[:len(inputs)]}.values():
        if t.numel():
            dev.to_host(torch.from_numpy(views[_key(t)]), t)
    dev.synchronize()
    fn(*(views[_key(t)] for t in distinct))
    for t in {_key(t): t for t in moved[len(inputs):]}.values():
        if t.numel():
            dev.to_device(t, torch.from_numpy(views[_key(t)]))


def _aligned(t: torch.Tensor) -> int:
    """Bytes of ``t`` rounded up to :data:`ALIGN`."""
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.numel(), t.dtype)
