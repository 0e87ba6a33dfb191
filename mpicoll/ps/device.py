"""Device arrays on the worker side of the parameter server.

Server state (values, optimizer state, residuals, replicas) always lives in host memory.
A worker may pass device arrays (CuPy, ``__cuda_array_interface__`` objects such as torch
CUDA tensors) as its parameters, gradients and ``out`` arrays, all of one call on the same
side:

- gradients (and initial values) are copied whole to host staging arrays when the call
  starts (:func:`host_arrays`), so the caller may reuse them at once; the protocol,
  compression included, then runs on those host arrays exactly as for host input, so
  the results are the same bits;
- pulls are received into host staging arrays and copied into the caller's device arrays
  (given in ``out``, else new CuPy arrays on the device of the call's arrays) when the
  operation completes (:class:`DevicePull`).

The copies are synchronous (:func:`mpicoll.gpu.backends.to_host`). Even with a CUDA-aware MPI
the worker stages: the servers are host processes, and the worker side's messages are
shards and chunks of many tensors.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..gpu import arrays as device_arrays
from ..gpu import backends
from .errors import PSError

__all__ = ["call_side", "device_views", "host_arrays", "first_device", "DevicePull"]


def _named(what: str, arrays: dict[str, Any] | None) -> list[tuple[str, Any]]:
    if not isinstance(arrays, dict):
        return []
    return [(f"{what}[{name!r}]", a) for name, a in arrays.items() if a is not None]


def _describe(a: Any) -> str:
    return f"{type(a).__module__}.{type(a).__name__}"


def call_side(**dicts: dict[str, Any] | None) -> bool:
    """Whether one call's arrays are device arrays (``True``) or host arrays.

    Args:
        dicts: the call's dicts by argument name (``grads=...``, ``out=...``).
    Raises:
        PSError: device and host arrays mixed in one call (naming one of each).
    """
    device, host = None, None
    for what, arrays in dicts.items():
        for label, a in _named(what, arrays):
            if device_arrays.is_device(a):
                device = device or (label, a)
            else:
                host = host or (label, a)
    if device and host:
        raise PSError(f"{device[0]} is a device array ({_describe(device[1])}) but "
                      f"{host[0]} is a host array ({_describe(host[1])}); pass every array "
                      f"of one call on the same side (device or host)")
    return device is not None


def device_views(arrays: dict[str, Any]) -> dict[str, Any]:
    """``arrays`` with every device object replaced by an array view of it (CuPy; numpy in
    the simulation), which has ``shape``, ``dtype`` and ``flags`` for the checks."""
    return {name: backends.device_view(a) if device_arrays.is_device(a) else a
            for name, a in arrays.items()}


def host_arrays(arrays: dict[str, Any]) -> dict[str, Any]:
    """``arrays`` with every device array copied whole to a new host array."""
    return {name: backends.to_host(a) if device_arrays.is_device(a) else a
            for name, a in arrays.items()}


class DevicePull:
    """The device side of one pull: host staging arrays to receive into, and the device
    arrays they are copied to at the end.

    Args:
        out: the caller's ``out`` (device arrays; missing names get new ones).
        like: a device array of the call (where new arrays are made).
    """

    def __init__(self, out: dict[str, Any] | None, like: Any) -> None:
        self.out = dict(out or {})
        self.like = like
        #: name -> the device array each :meth:`destination` gave
        self.arrays: dict[str, Any] = {}
        self._pairs: list[tuple[np.ndarray, Any]] = []

    def destination(self, name: str, spec: Any) -> tuple[np.ndarray, Any]:
        """``(host staging array, device array)`` for parameter ``spec``.

        Raises:
            PSError: ``out[name]`` is not a C-contiguous device array of the parameter's
                shape and dtype.
        """
        dest = self.out.get(name)
        if dest is None:
            dest = backends.require(self.like).new_like(self.like, spec.shape, spec.dtype)
        view = backends.device_view(dest)
        if tuple(view.shape) != spec.shape or view.dtype != spec.dtype or \
                not view.flags.c_contiguous:
            raise PSError(f"out[{name!r}] must be a C-contiguous {spec.dtype} device array "
                          f"of shape {spec.shape}")
        staging = np.empty(spec.shape, dtype=spec.dtype)
        self._pairs.append((staging, dest))
        self.arrays[name] = dest
        return staging, dest

    def finish(self) -> None:
        """Copy every staging array into its device array (once)."""
        pairs, self._pairs = self._pairs, []
        for staging, dest in pairs:
            backends.from_host(dest, staging)


def first_device(*dicts: dict[str, Any] | None) -> Any:
    """The first device array among ``dicts`` (``None`` if there is none)."""
    for arrays in dicts:
        for _, a in _named("", arrays):
            if device_arrays.is_device(a):
                return a
    return None
