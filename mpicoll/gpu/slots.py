"""Reusable host slots of the staged path (pinned memory for CuPy), bounded in size."""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np

__all__ = ["HostSlots"]


class HostSlots:
    """Reusable host slots, at most ``limit`` bytes kept between calls.

    Args:
        alloc: ``alloc(nbytes) -> numpy uint8 array`` (pinned memory for CuPy).

    Slots grow when a call needs larger ones; a request above the limit is served by
    buffers that are dropped after the call instead of kept. Views of the slots are
    memoised (:meth:`view`) so that the host collectives see the same numpy objects on
    every call and hit :mod:`mpicoll.fastpath`'s cache.
    """

    def __init__(self, alloc: Callable[[int], np.ndarray]) -> None:
        self._alloc = alloc
        self._slots: list[np.ndarray] = []
        self._views: dict[tuple, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory kept between calls."""
        return sum(s.nbytes for s in self._slots)

    def get(self, nslots: int, nbytes: int, limit: int) -> list[np.ndarray]:
        """``nslots`` buffers of at least ``nbytes`` bytes (uint8)."""
        nbytes = max(int(nbytes), 1)
        with self._lock:
            if nslots * nbytes > limit:  # too big to keep: temporary buffers
                return [self._alloc(nbytes) for _ in range(nslots)]
            if len(self._slots) < nslots or any(s.nbytes < nbytes
                                                for s in self._slots[:nslots]):
                size = max([nbytes] + [s.nbytes for s in self._slots])
                if size * nslots > limit:
                    size = nbytes
                self._slots = []
                self._views.clear()
                self._slots = [self._alloc(size) for _ in range(nslots)]
            return self._slots[:nslots]

    def view(self, slot: np.ndarray, dtype: np.dtype, start: int, count: int) -> np.ndarray:
        """``slot`` as ``count`` elements of ``dtype`` from element ``start`` (memoised)."""
        key = (id(slot), dtype.str, start, count)
        hit = self._views.get(key)
        if hit is not None:
            return hit
        item = dtype.itemsize
        view = slot[start * item:(start + count) * item].view(dtype)
        if len(self._views) > 512:
            self._views.clear()
        if any(slot is s for s in self._slots):  # never memoise temporary buffers
            self._views[key] = view
        return view
