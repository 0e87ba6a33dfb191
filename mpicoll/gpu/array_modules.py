"""Array modules: which module's kernels handle an array (numpy for host arrays, the
device backend's module on the device), and copies between host and device in any of them.

:func:`array_module` picks the module from an array, like ``cupy.get_array_module``, but
without importing CuPy for numpy input: a numpy array (or anything that is not a device
array) is numpy; a device array is its device backend's module
(:meth:`mpicoll.gpu.backends.DeviceBackend.array_module`): ``cupy`` for CUDA arrays
(imported then: a device array exists, so CuPy is importable). Other CUDA objects
(``__cuda_array_interface__``, CUDA DLPack: torch CUDA tensors, Numba arrays) are read
through zero-copy CuPy views (:func:`as_module_array`).

Another family of device arrays gets its module through a registered backend
(:func:`mpicoll.gpu.backends.register`). A backend's module provides what the codecs call
(numpy's names for them) plus ``asnumpy(a, out=None)`` and ``asarray(host)``.

Copies between the sides go through :func:`to_host` and :func:`to_device` (the codecs
call them only for payloads and for randomk's indices, never for the dense vector;
:func:`mpicoll.gpu.backends.to_host` for the parameter server's whole arrays).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import backends

__all__ = ["array_module", "is_host_module", "as_module_array", "to_host", "to_device", "to_side",
           "constant"]

#: (id of the module, name, device) -> (the module, the table in it); the module is held
#: so that its id is never reused for another one while the entry lives.
_constants: dict[tuple, tuple[Any, Any]] = {}
_lock = threading.Lock()


def array_module(a: Any) -> Any:
    """The module whose kernels handle ``a``: numpy, or its device backend's (``cupy``).

    Never imports CuPy for numpy arrays, scalars or ``None``.
    """
    if a is None or type(a) is np.ndarray or isinstance(a, (np.generic, int, float)):
        return np
    backend = backends.backend_for(a)
    return np if backend is None else backend.array_module(a)


def is_host_module(xp: Any) -> bool:
    """Whether ``xp`` is numpy (kernels on the host)."""
    return xp is np


def as_module_array(a: Any, xp: Any) -> Any:
    """``a`` as an array of module ``xp`` (numpy, or ``a``'s backend's module), without a
    copy: its backend's view (CUDA objects that are not CuPy arrays become CuPy views:
    ``cupy.asarray`` synchronises the stream of ``__cuda_array_interface__`` v3; DLPack
    objects go through ``cupy.from_dlpack``)."""
    if xp is np:
        return a
    return backends.require(a).view(a)[0]


def to_host(a: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy array ``a`` (of any module) to host memory; into ``out`` when given.

    numpy input is returned as is (or copied into ``out``). The copy is ordered after
    the work queued on the current stream and complete when this returns.
    """
    xp = array_module(a)
    if xp is np:
        return _host_copy(a, out)
    return xp.asnumpy(a, out=out)


def _host_copy(a: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``a`` itself, or copied into ``out`` when given (host to host)."""
    if out is None:
        return a
    np.copyto(out, a)
    return out


def to_device(host: np.ndarray, like: Any, out: Any = None) -> Any:
    """Copy host array ``host`` to the module (and device) of ``like``; into ``out`` when
    given. numpy ``like``: ``host`` itself (or copied into ``out``)."""
    xp = array_module(like if out is None else out)
    if xp is np:
        return _host_copy(host, out)
    if out is None:
        return xp.asarray(host)
    setter = getattr(out, "set", None)
    if setter is not None and out.flags.c_contiguous:
        setter(np.ascontiguousarray(host))
    else:
        xp.copyto(out, xp.asarray(host))
    return out


def to_side(a: Any, like: Any) -> Any:
    """``a`` on the side (module, device) of ``like``: ``a`` itself when it is there
    already, else a copy (through host memory between two device modules)."""
    xp = array_module(like)
    if array_module(a) is xp:
        return a
    host = to_host(a)
    return host if xp is np else to_device(host, like)


def _device_key(xp: Any) -> Any:
    cuda = getattr(xp, "cuda", None)
    if cuda is not None and hasattr(cuda, "Device"):
        return cuda.Device().id
    return None


def constant(xp: Any, name: str, host: np.ndarray) -> Any:
    """``host`` (a read-only table such as the onebit sign table) in module ``xp``, on the
    current device; copied once per module and device."""
    if xp is np:
        return host
    key = (id(xp), name, _device_key(xp))
    with _lock:
        hit = _constants.get(key)
        if hit is None:
            hit = _constants[key] = (xp, xp.asarray(host))
        return hit[1]
