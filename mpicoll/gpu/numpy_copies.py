"""The staged path's copies for buffers already in host memory: plain numpy copies.

A rank whose buffers are on the host makes the same host calls as the ranks that stage
device buffers when every rank must split a collective into the same chunks (a
``mpicoll.torch`` request staged on some ranks, host tensors on others):
:func:`mpicoll.gpu.staging.staged` with :class:`NumpyCopies` packs and unpacks numpy
arrays exactly as it does device arrays, with no device and nothing deferred.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .slots import HostSlots
from .staging import Copies

__all__ = ["NumpyCopies"]


class NumpyCopies(Copies):
    """:class:`mpicoll.gpu.staging.Copies` on numpy arrays: every copy runs at once, so
    the stream methods (``begin``, ``record``, ``wait``, ``stream_wait``, ``finish``,
    ``drain``) are the protocol's, which do nothing (no streams, nothing to wait for).

    Args:
        host_pool: the reusable host slots of this rank's calls.
    """

    def __init__(self, host_pool: HostSlots) -> None:
        self.host_pool = host_pool

    def as_array(self, obj: Any) -> np.ndarray:
        """``obj`` itself (a numpy array)."""
        if not isinstance(obj, np.ndarray):
            raise TypeError(f"NumpyCopies handles numpy arrays, not {type(obj).__name__}")
        return obj

    def empty_like(self, obj: Any) -> np.ndarray:
        """``numpy.empty_like``."""
        return np.empty_like(obj)

    def empty(self, shape: tuple, dtype: Any, like: Any) -> np.ndarray:
        """A new C-ordered array."""
        return np.empty(shape, dtype=dtype)

    def d2h(self, dst: np.ndarray, src: np.ndarray, chunk: int) -> None:
        """``dst[...] = src`` now."""
        np.copyto(dst, src)

    h2d = d2h
