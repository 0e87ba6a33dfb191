"""Test double: a device array module for the codecs, on the host.

:class:`DevArray` (a numpy subclass standing for device memory) is handled by
:class:`FakeDeviceModule`, which runs numpy's kernels but refuses host arrays as their
operands (as CuPy refuses numpy arrays) and counts every byte copied between the sides
(class-wide: ``d2h``, ``h2d``, ``calls``). :func:`fake_device_module` registers
:class:`ArrayModuleBackend` for them through the library's device backend registry
(:func:`mpicoll.gpu.backends.registered`), so :func:`mpicoll.gpu.array_modules.array_module`
gives the module for them as it gives CuPy for CUDA arrays.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from mpicoll.gpu.backends import DeviceBackend, registered

__all__ = ["DevArray", "FakeDeviceModule", "ArrayModuleBackend", "fake_device_module", "dev",
           "host_bytes"]


class DevArray(np.ndarray):
    """Stands for an array in device memory: numpy ufuncs on it refuse host operands."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.pop("out", None)
        args = [_unwrap(a, f"{ufunc.__name__}") for a in inputs]
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o, f"{ufunc.__name__} out") for o in out)
        return _wrap(getattr(ufunc, method)(*args, **kwargs))

    def set(self, host: np.ndarray) -> None:
        """Copy host memory in (CuPy's ``ndarray.set``)."""
        FakeDeviceModule.h2d += host.nbytes
        np.copyto(self.view(np.ndarray), host)


def _unwrap(a: Any, what: str) -> Any:
    if isinstance(a, DevArray):
        return a.view(np.ndarray)
    if isinstance(a, np.ndarray) and a.ndim > 0:
        raise TypeError(f"{what}: a host array in a device kernel")
    if isinstance(a, (list, tuple)):
        return type(a)(_unwrap(v, what) for v in a)
    return a


def _wrap(r: Any) -> Any:
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, np.ndarray) and not isinstance(r, DevArray):
        return r.view(DevArray)
    return r


class FakeDeviceModule:
    """numpy's functions on :class:`DevArray` only; transfers counted (class-wide)."""

    __name__ = "fakedevice"
    d2h = 0
    h2d = 0
    calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(np, name)
        if not callable(fn) or isinstance(fn, type):
            return fn               # dtypes and constants (uint64, inf...)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            FakeDeviceModule.calls.append(name)
            args = [_unwrap(a, name) for a in args]
            kwargs = {k: _unwrap(v, name) for k, v in kwargs.items()}
            return _wrap(fn(*args, **kwargs))
        return kernel

    @staticmethod
    def asnumpy(a: DevArray, out: np.ndarray | None = None) -> np.ndarray:
        FakeDeviceModule.d2h += a.nbytes
        host = a.view(np.ndarray)
        if out is None:
            return host.copy()
        np.copyto(out, host)
        return out

    @staticmethod
    def asarray(host: Any) -> DevArray:
        host = np.asarray(host)
        FakeDeviceModule.h2d += host.nbytes
        return host.copy().view(DevArray)


class ArrayModuleBackend(DeviceBackend):
    """The device backend of :class:`DevArray`: only what the codecs need (its module)."""

    name = "fakedevice"

    def __init__(self) -> None:
        self.module = FakeDeviceModule()

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, DevArray)

    def array_module(self, obj: Any) -> Any:
        return self.module


@contextlib.contextmanager
def fake_device_module() -> Iterator[FakeDeviceModule]:
    """Within: :class:`DevArray` is handled by a fresh :class:`FakeDeviceModule` (its
    counters reset); yields the module."""
    FakeDeviceModule.d2h = FakeDeviceModule.h2d = 0
    FakeDeviceModule.calls = []
    with registered(ArrayModuleBackend()) as backend:
        yield backend.module


def dev(a: np.ndarray) -> DevArray:
    return a.copy().view(DevArray)


def host_bytes(payload: tuple) -> list[bytes]:
    return [np.asarray(p.view(np.ndarray) if isinstance(p, DevArray) else p).tobytes()
            for p in payload]
