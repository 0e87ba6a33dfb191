"""Test double: fake device arrays and the device backend that handles them on the host.

:class:`FakeDevice` exposes ``__cuda_array_interface__`` v3 over a numpy array, so
:func:`mpicoll.gpu.arrays.is_device` takes it for a device array and the core routes calls
with it to :func:`mpicoll.gpu.route.device_call`. :class:`SimulatedBackend` is the
:class:`mpicoll.gpu.backends.DeviceBackend` that claims them, registered through the
library's own extension point::

    with backends.registered(SimulatedBackend(fake_copies())) as backend:
        mpicoll.allreduce(FakeDevice(x), FakeDevice(y))   # staged through backend.copies

Its staged path runs a :class:`doubles.device_copies.SimulatedCopies`; whole-array copies
(the parameter server's workers) are numpy copies counted in that object's
``copied_bytes``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from mpicoll.gpu.backends import DeviceBackend

from .device_copies import SimulatedCopies

__all__ = ["FakeDevice", "fake_copies", "SimulatedBackend"]


class FakeDevice:
    """Stands in for a device array: ``__cuda_array_interface__`` v3 over a numpy array.

    The pointer is the host address (nothing dereferences it here).
    """

    def __init__(self, array: np.ndarray, stream: int | None = None,
                 strides: tuple | None = None, device: int = 0) -> None:
        self.array = array
        self._stream = stream
        self._strides = strides
        self.device_ordinal = device

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.array.shape, "typestr": self.array.dtype.str,
                "data": (self.array.__array_interface__["data"][0], False),
                "version": 3, "strides": self._strides, "stream": self._stream}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device_ordinal)


def fake_copies(mode: str = "lazy") -> SimulatedCopies:
    """Simulated copies that take :class:`FakeDevice` objects as device arrays."""
    return SimulatedCopies(mode, unwrap=lambda o: o.array if isinstance(o, FakeDevice) else o,
                           wrap=FakeDevice)


class SimulatedBackend(DeviceBackend):
    """The device backend of :class:`FakeDevice` objects (see the module doc).

    Args:
        copies: the staged path's copies of every call (default :func:`fake_copies`).
        aware: what :meth:`aware` answers.
    """

    name = "simulated"

    def __init__(self, copies: SimulatedCopies | None = None,
                 aware: tuple[bool, str] = (False, "simulated")) -> None:
        self.simulated_copies = fake_copies() if copies is None else copies
        self._aware = aware

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, FakeDevice)

    def aware(self) -> tuple[bool, str]:
        return self._aware

    def copies(self, args: Sequence[Any]) -> SimulatedCopies:
        return self.simulated_copies

    def view(self, obj: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
        return self.simulated_copies.as_array(obj), self.simulated_copies.wrap

    def to_host(self, obj: Any, out: np.ndarray) -> np.ndarray:
        self.simulated_copies.copied_bytes["d2h"] += out.nbytes
        np.copyto(out, self.view(obj)[0])
        return out

    def from_host(self, obj: Any, host: np.ndarray) -> None:
        view = self.view(obj)[0]
        self.simulated_copies.copied_bytes["h2d"] += host.nbytes
        np.copyto(view, host.reshape(view.shape))

    def new_like(self, obj: Any, shape: tuple, dtype: Any) -> Any:
        return self.simulated_copies.wrap(np.empty(shape, dtype=dtype))
