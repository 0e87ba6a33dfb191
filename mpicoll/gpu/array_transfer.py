"""Whole-array copies between a device array and host memory, for code whose state stays
on the host (the parameter server's workers stage device gradients and pulls here).

Each device object goes through its device backend (:mod:`mpicoll.gpu.backends`): for
CUDA objects (CuPy arrays or anything :func:`mpicoll.gpu.arrays.is_device` accepts), a
zero-copy CuPy view read or written after the producer stream is synchronised, copied by
:func:`mpicoll.gpu.array_modules.to_host` / :func:`~mpicoll.gpu.array_modules.to_device`
(the copies the codecs use).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import backends

__all__ = ["device_view", "to_host", "from_host"]


def device_view(obj: Any) -> Any:
    """An array view (CuPy for CUDA) of device object ``obj``, with its ``shape``,
    ``dtype`` and ``flags``; ``obj``'s producer synchronised."""
    backend = backends.require(obj)
    backend.synchronise(obj)
    return backend.view(obj)[0]


def to_host(obj: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy device object ``obj`` (whole) into host memory: ``out`` or a new C-ordered
    numpy array; complete when this returns."""
    backend = backends.require(obj)
    if out is None:
        view = backend.view(obj)[0]
        out = np.empty(view.shape, dtype=view.dtype)
    return backend.to_host(obj, out)


def from_host(obj: Any, host: np.ndarray) -> None:
    """Copy host array ``host`` into device object ``obj`` (same shape and dtype, C-
    contiguous); complete when this returns."""
    backends.require(obj).from_host(obj, np.ascontiguousarray(host))
