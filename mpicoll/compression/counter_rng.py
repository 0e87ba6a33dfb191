"""Counter-based uniform numbers that numpy and CuPy compute bit for bit alike.

Stochastic rounding needs one uniform number per element. numpy's generators cannot be
reproduced by CuPy's (and copying numpy's numbers to the device would move more bytes
than the payload saves), so the numbers are a hash of ``(key, element index)``: the
SplitMix64 finaliser (Steele, Lea & Flood 2014) over ``key + (index + 1) * golden``,
computed with uint64 multiplications, shifts and xors, whose results do not depend on
the array module. The number of element ``i`` depends only on ``key`` and ``i``, so a
vector processed in blocks (the host) or whole (a device) gets the same numbers.

float32 uniforms take the top 24 bits of the hash (``k / 2**24``), float64 ones the top 53
(``k / 2**53``): exact in their dtype, in ``[0, 1)``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["stream_key", "uniform"]

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(z: int) -> int:
    """The SplitMix64 finaliser on a Python int (uint64 arithmetic)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def stream_key(seed: int, step: int) -> int:
    """The key of encoding number ``step`` of a codec seeded with ``seed`` (a uint64)."""
    return _mix((_mix(int(seed) & _MASK) + 0x9E3779B97F4A7C15 * (int(step) + 1)) & _MASK)


def uniform(xp: Any, key: int, start: int, count: int, dtype: Any) -> Any:
    """Uniform numbers in ``[0, 1)`` of elements ``start .. start+count-1`` of stream
    ``key``, as a new array of module ``xp`` (numpy, CuPy) and float ``dtype``."""
    bits, ftype = (53, np.float64) if np.dtype(dtype) == np.float64 else (24, np.float32)
    z = xp.arange(start + 1, start + count + 1, dtype=xp.uint64)
    xp.multiply(z, _GOLDEN, out=z)
    xp.add(z, np.uint64(key), out=z)
    t = xp.empty_like(z)
    for shift, mult in ((_S30, _M1), (_S27, _M2)):
        xp.right_shift(z, shift, out=t)
        xp.bitwise_xor(z, t, out=z)
        xp.multiply(z, mult, out=z)
    xp.right_shift(z, _S31, out=t)
    xp.bitwise_xor(z, t, out=z)
    xp.right_shift(z, np.uint64(64 - bits), out=z)    # the top ``bits`` bits of the hash
    return xp.multiply(z.astype(ftype), ftype(2.0 ** -bits))
