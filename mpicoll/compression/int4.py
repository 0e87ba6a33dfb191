"""A 4-bit codec: two signed 4-bit integers per byte and one float32 scale per chunk.

Payload, in wire order: ``float32[ceil(count/C)]`` scales, then ``uint8[ceil(count/2)]``
levels: ``ceil(count/2) + 4 ceil(count/C)`` bytes for ``count`` floats.

Per chunk of ``C`` elements (``chunk=``, default 256, even): ``s = max|x| / 7``,
``q = clip(rint(x / s), -7, 7)`` (round half to even), 15 levels symmetric about zero.
Each ``q`` travels as the nibble ``q + 8`` (1 .. 15): element ``2i`` in the low four bits
of byte ``i``, element ``2i + 1`` in the high four (an odd count pads the last high
nibble with 8, a zero). A chunk whose scale is zero or denormal is sent as zeros with the
scale ``+0.0``, as ``int8`` does. Deterministic rounding errs by at most ``s / 2`` per
element (up to the float rounding of ``x / s``); with error feedback what it drops is
sent later.

It is the 4-bit pseudo-gradient codec of :class:`mpicoll.torch.DiLoCo` (Streaming DiLoCo
sends its pseudo-gradients in 4 bits; the paper's format is the E3M0 float, this one is
linear with a scale per chunk: see docs/diloco.md). Pass ``"int4"``, ``"int4:C"`` or
``Int4Codec()`` as ``compression=`` to any compressed collective: it is a dense codec,
re-encoded at every hop of the ring.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .codecs import Layout, _ChunkedCodec, _ordered

__all__ = ["Int4Codec"]

#: The largest magnitude of a 4-bit level (levels -7 .. 7).
LEVELS = 7


class Int4Codec(_ChunkedCodec):
    """int4 with one float32 scale per chunk: ``q = clip(rint(x * (1/s)), -7, 7)``,
    ``s = max|x| / 7``, two levels per byte (see the module docstring).

    Args:
        chunk: elements per scale; even, so that chunks start on byte boundaries.
    Raises:
        TypeError, ValueError: ``chunk`` is not a positive even int.
    """

    def __init__(self, chunk: int = 256) -> None:
        super().__init__(chunk)
        if self.chunk % 2:
            raise ValueError(f"chunk must be even for int4 (two elements per byte), "
                             f"got {chunk}")
        self.name = "int4" + (f":{self.chunk}" if self.chunk != 256 else "")

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return _ordered([(np.float32, self.nchunks(count)), (np.uint8, -(-int(count) // 2))])

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        scales, packed = out
        block = min(self._block_size(xp, x.size), x.size)
        tmp = xp.empty(block, dtype=x.dtype)
        nib = xp.empty(block + 1, dtype=np.uint8)
        for lo, hi, k0 in self._blocks(xp, x.size):
            tb = tmp[:hi - lo]
            self._to_levels(xp, x[lo:hi], scales[k0:], LEVELS, tb)
            xp.rint(tb, out=tb)
            xp.clip(tb, -LEVELS, LEVELS, out=tb)
            xp.add(tb, x.dtype.type(8), out=tb)
            n = hi - lo
            nb = nib[:n + (n & 1)]
            xp.copyto(nb[:n], tb, casting="unsafe")
            if n & 1:
                nb[n] = 8
            pairs = nb.reshape(-1, 2)
            dst = packed[lo // 2:lo // 2 + pairs.shape[0]]
            xp.left_shift(pairs[:, 1], np.uint8(4), out=dst)
            xp.bitwise_or(dst, pairs[:, 0], out=dst)

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        scales, packed = payload
        block = min(self._block_size(xp, count), count)
        q = xp.empty(block + 1, dtype=np.int8)
        for lo, hi, k0 in self._blocks(xp, count):
            src = packed[lo // 2:(hi + 1) // 2]
            pairs = q[:2 * src.size].reshape(-1, 2)
            xp.bitwise_and(src, np.uint8(15), out=pairs[:, 0], casting="unsafe")
            xp.right_shift(src, np.uint8(4), out=pairs[:, 1], casting="unsafe")
            qb = q[:hi - lo]
            xp.subtract(qb, np.int8(8), out=qb)
            self._scaled(xp, self._rows(qb), scales[k0:], out[lo:hi])

