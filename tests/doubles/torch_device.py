"""Test double: a host stand-in for a CUDA device in the adapter: CPU tensors that count as device
tensors, a lazy caller stream, and a log of what the engine asked the device to do.

:class:`SimulatedDevice` implements :class:`mpicoll.torch.device.tensors.TensorDevice`. Its device
tensors are CPU tensors of a subclass of :class:`SimulatedTensor` (one per simulated
device), which torch propagates through views, ``detach()``, ``empty_like()`` and
arithmetic, so outputs made like an input stay "on the device". While the device is
registered (:func:`mpicoll.torch.device.tensors.registered`, the extension point the
library's CUDA devices implement too), the engine treats them as device tensors.

Work the test puts on the *caller's stream* (:meth:`SimulatedDevice.on_caller_stream`)
runs only when the engine's stream waits for an event recorded after it: an engine that
reads a tensor without waiting for its submit-time event reads stale data. The engine's
own stream runs eagerly (packing and copies are ordinary CPU operations), and
:attr:`SimulatedDevice.log` records, in order, ``("record", n)``, ``("wait", n)``,
``("d2h", nbytes)``, ``("h2d", nbytes)``, ``("sync",)``, ``("stream",)`` (the engine's
stream made current), ``("pinned", nbytes)`` and ``("buffer", nbytes)`` (device memory
handed to a collective, with ``aware=True``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .device_copies import SimulatedCopies

__all__ = ["SimulatedTensor", "SimulatedDevice"]


def _memory(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a device tensor's memory (what a device pointer would reach)."""
    return tensor.as_subclass(torch.Tensor).detach().numpy()


class SimulatedTensor(torch.Tensor):
    """A CPU tensor that a :class:`SimulatedDevice` claims as its device memory."""


_kinds: dict[int, type] = {}


def _kind(index: int) -> type:
    """The :class:`SimulatedTensor` subclass of device ``index`` (one per index, so that
    tensors kept across devices of the same index, like the engine's fusion buffer, mix)."""
    if index not in _kinds:
        _kinds[index] = type(f"SimulatedTensor{index}", (SimulatedTensor,), {})
    return _kinds[index]


class SimulatedDevice:
    """:class:`mpicoll.torch.device.tensors.TensorDevice` on the host (see the module doc).

    Args:
        index: shown as ``sim:<index>``; devices with different indices are different.
        aware: what :meth:`aware` answers (``True``: the collective gets the "device"
            tensors themselves, as with CUDA-aware MPI).
    """

    def __init__(self, index: int = 0, aware: bool = False) -> None:
        self.name = f"sim:{index}"
        self._aware = aware
        self.kind = _kind(index)
        self.log: list[tuple] = []
        self._caller: list[Callable[[], Any]] = []
        self._ran = 0
        self._lock = threading.Lock()
        #: The chunked staged path's copies (:meth:`copies`), device tensors seen as
        #: numpy views of their memory.
        self.pipeline = SimulatedCopies("lazy", unwrap=_memory)

    # tensors ---------------------------------------------------------------------------
    def claims(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is this device's memory."""
        return isinstance(tensor, self.kind)

    def tensor(self, data: Any) -> torch.Tensor:
        """A device copy of ``data`` (a tensor or anything ``torch.tensor`` takes)."""
        t = data.detach().clone() if isinstance(data, torch.Tensor) else torch.tensor(data)
        return t.as_subclass(self.kind)

    def host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A plain CPU copy of device ``tensor`` (what ``.cpu()`` gives on a GPU)."""
        return torch.Tensor(tensor.detach()).clone().as_subclass(torch.Tensor)

    # the caller's stream --------------------------------------------------------------
    def on_caller_stream(self, op: Callable[[], Any]) -> None:
        """Queue ``op`` on the caller's stream: it runs once an event after it is waited
        for (or at :meth:`flush_caller`)."""
        with self._lock:
            self._caller.append(op)

    def flush_caller(self, upto: int | None = None) -> None:
        """Run the caller's stream up to position ``upto`` (default: everything)."""
        with self._lock:
            end = len(self._caller) if upto is None else upto
            while self._ran < end:
                op = self._caller[self._ran]
                self._ran += 1
                op()

    def pending(self) -> int:
        """Operations queued on the caller's stream that have not run."""
        return len(self._caller) - self._ran

    # TensorDevice ----------------------------------------------------------------------
    def record(self) -> Any:
        with self._lock:
            position = len(self._caller)
        self.log.append(("record", position))
        return position

    def wait(self, event: Any) -> None:
        self.log.append(("wait", event))
        self.flush_caller(event)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        self.log.append(("stream",))
        yield

    def empty(self, shape: tuple, dtype: torch.dtype, event: Any = None) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype).as_subclass(self.kind)

    def pinned(self, nbytes: int) -> np.ndarray:
        self.log.append(("pinned", int(nbytes)))
        return np.empty(int(nbytes), np.uint8)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert not isinstance(dst, SimulatedTensor), "d2h into a device tensor"
        self.log.append(("d2h", dst.numel() * dst.element_size()))
        dst.copy_(src.reshape(-1))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert not isinstance(src, SimulatedTensor), "h2d from a device tensor"
        self.log.append(("h2d", src.numel() * src.element_size()))
        dst.copy_(src.view(dst.shape))

    def synchronize(self) -> None:
        self.log.append(("sync",))

    def aware(self) -> bool:
        return self._aware

    def buffer(self, tensor: torch.Tensor) -> np.ndarray:
        """A numpy view of the "device" memory (what MPI would get as a device pointer)."""
        self.log.append(("buffer", tensor.numel() * tensor.element_size()))
        return _memory(tensor)

    def after_aware(self) -> None:
        self.log.append(("sync",))

    def copies(self, slots: Any) -> SimulatedCopies:
        """The staged pipeline's copies: :attr:`pipeline` (lazy deferred streams, so a
        missing wait gives a wrong result; its ``log`` shows the order of operations),
        with the engine's host slots ``slots``."""
        self.pipeline.host_pool = slots
        return self.pipeline

    def ops(self, *names: str) -> list[tuple]:
        """The log entries whose operation is one of ``names``."""
        return [entry for entry in self.log if entry[0] in names]
