"""Whole-array copies between a device array and host memory, for code whose state stays
on the host (the parameter server's workers stage device gradients and pulls here): the
device object's view, synchronised with its producer stream, copied by
:func:`mpicoll.gpu.array_modules.to_host` / :func:`~mpicoll.gpu.array_modules.to_device`
(the copies the codecs use).

Device objects are CuPy arrays or anything :func:`mpicoll.gpu.arrays.is_device` accepts;
they are read and written through zero-copy CuPy views after their producer stream is
synchronised. Inside :func:`mpicoll.gpu.route.simulated` (CPU tests) the simulation's
copies object stands in for CuPy: its arrays are numpy, and the bytes copied each way
are added to its ``copied_bytes``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import array_modules, arrays, route

__all__ = ["device_view", "to_host", "from_host", "new_like"]


def device_view(obj: Any) -> Any:
    """An array view (CuPy; numpy in the simulation) of device object ``obj``, with its
    ``shape``, ``dtype`` and ``flags``; ``obj``'s producer stream synchronised."""
    sim = route.simulation()
    if sim is not None:
        return sim[0].as_array(obj)
    route.synchronise(obj)
    return route.as_device_array(obj)[0]


def _count(direction: str, nbytes: int) -> None:
    sim = route.simulation()
    if sim is not None and hasattr(sim[0], "copied_bytes"):
        sim[0].copied_bytes[direction] += nbytes


def to_host(obj: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy device object ``obj`` (whole) into host memory: ``out`` or a new C-ordered
    numpy array; complete when this returns."""
    view = device_view(obj)
    if out is None:
        out = np.empty(view.shape, dtype=view.dtype)
    _count("d2h", out.nbytes)
    array_modules.to_host(view, out=out)
    return out


def from_host(obj: Any, host: np.ndarray) -> None:
    """Copy host array ``host`` into device object ``obj`` (same shape and dtype, C-
    contiguous); complete when this returns."""
    view = device_view(obj)
    _count("h2d", host.nbytes)
    array_modules.to_device(np.ascontiguousarray(host).reshape(view.shape), view, out=view)


def new_like(obj: Any, shape: tuple, dtype: Any) -> Any:
    """A new device array of ``shape`` and ``dtype`` on the device holding ``obj`` (a CuPy
    array; the simulation's device object in tests)."""
    sim = route.simulation()
    if sim is not None:
        return sim[0].wrap(np.empty(shape, dtype=dtype))
    import cupy  # noqa: PLC0415  (a device array exists: CuPy is importable)

    device = arrays.device_id(obj)
    with cupy.cuda.Device(cupy.cuda.runtime.getDevice() if device is None else device):
        return cupy.empty(shape, dtype=dtype)
