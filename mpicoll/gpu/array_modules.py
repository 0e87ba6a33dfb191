"""Array modules: which module's kernels handle an array (numpy for host arrays, CuPy on
the device, or a registered one), and copies between host and device in any of them.

:func:`array_module` picks the module from an array, like ``cupy.get_array_module``, but
without importing CuPy for numpy input: a numpy array (or anything that is not a device
array) is numpy; a CuPy array is ``cupy`` (imported then: a CuPy array exists, so CuPy is
importable). Other device objects (``__cuda_array_interface__``, CUDA DLPack: torch CUDA
tensors, Numba arrays) are read through zero-copy CuPy views (:func:`as_module_array`).

Other array modules can be registered for their array type (:func:`register`): the CPU
tests register a fake device module over numpy that refuses host arrays in its kernels
and counts the bytes copied between the sides. A registered module provides what the
codecs call (numpy's names for them) plus ``asnumpy(a, out=None)`` and ``asarray(host)``.

Copies between the sides go through :func:`to_host` and :func:`to_device` (the codecs
call them only for payloads and for randomk's indices, never for the dense vector;
:mod:`mpicoll.gpu.array_transfer` for the parameter server's whole arrays).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import arrays as device_arrays

__all__ = ["array_module", "is_host_module", "as_module_array", "to_host", "to_device", "to_side",
           "register", "unregister", "constant"]

_registered: dict[type, Any] = {}
_constants: dict[tuple, Any] = {}
_lock = threading.Lock()


def register(array_type: type, module: Any) -> None:
    """Run codecs on arrays of ``array_type`` with ``module`` (tests, other libraries)."""
    _registered[array_type] = module


def unregister(array_type: type) -> None:
    """Undo :func:`register` (nothing if ``array_type`` was not registered)."""
    module = _registered.pop(array_type, None)
    with _lock:
        for key in [k for k in _constants if k[0] == id(module)]:
            del _constants[key]


def _registered_module(a: Any) -> Any:
    if not _registered:
        return None
    for cls in type(a).__mro__:
        module = _registered.get(cls)
        if module is not None:
            return module
    return None


def _is_cupy(a: Any) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def array_module(a: Any) -> Any:
    """The module whose kernels handle ``a``: numpy, ``cupy``, or a registered one.

    Never imports CuPy for numpy arrays, scalars or ``None``.
    """
    if a is None or type(a) is np.ndarray:
        return np
    module = _registered_module(a)
    if module is not None:
        return module
    if isinstance(a, (np.ndarray, np.generic, int, float)):
        return np
    if _is_cupy(a) or device_arrays.is_device(a):
        import cupy  # noqa: PLC0415  (a device array exists: CuPy must handle it)

        return cupy
    return np


def is_host_module(xp: Any) -> bool:
    """Whether ``xp`` is numpy (kernels on the host)."""
    return xp is np


def as_module_array(a: Any, xp: Any) -> Any:
    """``a`` as an array of module ``xp``, without a copy: device objects that are not
    CuPy arrays become CuPy views (``cupy.asarray`` synchronises the stream of
    ``__cuda_array_interface__`` v3; DLPack objects go through ``cupy.from_dlpack``)."""
    if xp is np or _registered_module(a) is xp or _is_cupy(a):
        return a
    if device_arrays.cuda_interface(a) is not None:
        return xp.asarray(a)
    return xp.from_dlpack(a)


def to_host(a: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy array ``a`` (of any module) to host memory; into ``out`` when given.

    numpy input is returned as is (or copied into ``out``). The copy is ordered after
    the work queued on the current stream and complete when this returns.
    """
    xp = array_module(a)
    if xp is np:
        return _host_copy(a, out)
    if out is None:
        return xp.asnumpy(a)
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
            hit = _constants[key] = xp.asarray(host)
        return hit
