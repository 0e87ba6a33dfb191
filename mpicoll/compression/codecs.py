"""Gradient codecs: what a float vector becomes on the wire, and back.

Every codec turns a flat float32/float64 vector of ``count`` elements into a *payload*: a
tuple of contiguous numpy arrays whose dtypes and lengths depend only on ``count`` and the
input dtype (:meth:`Codec.layout`), so a receiver can allocate its buffer before the message
arrives. The parts of a payload are laid out back to back in one ``uint8`` buffer, largest
item size first (so every part is aligned without padding); :func:`new_payload` allocates
it and the whole buffer is what travels (``Codec.wire_bytes(count)`` bytes).

=============  =====================================================  ==========================
codec          payload (in wire order)                                bytes for ``count`` floats
=============  =====================================================  ==========================
``none``       the values in the input dtype                          ``count * itemsize``
``fp16``       ``float16[count]``                                     ``2 count``
``bf16``       ``uint16[count]``: upper half of float32, RNE          ``2 count``
``int8``       ``float32[nchunks]`` scales, ``int8[count]``           ``count + 4 ceil(count/C)``
``onebit``     ``float32[nchunks]`` scales, ``uint8[ceil(count/8)]``  ``ceil(count/8) + 4 ceil(count/C)``
``topk:r``     values ``dtype[k]``, indices ``int32[k]`` (sorted)     ``k (itemsize + 4)``
``randomk:r``  values ``dtype[k]``, indices ``int32[k]`` (sorted)     ``k (itemsize + 4)``
=============  =====================================================  ==========================

``C`` is the chunk size (``chunk=``, default 256 elements); ``k = ceil(r * count)`` (at least
1 when ``count > 0``); indices are ``int64`` past 2**31 - 1 elements.

Every kernel is vectorised numpy, and the chunked codecs work through the vector in blocks
of whole chunks (``BLOCK_ELEMENTS``) so their temporaries stay in cache.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["Codec", "NoneCodec", "FP16Codec", "BF16Codec", "Int8Codec", "OneBitCodec",
           "TopKCodec", "RandomKCodec", "CODECS", "get_codec", "new_payload",
           "payload_views", "layout_nbytes", "check_float_dtype", "BLOCK_ELEMENTS"]

#: Elements the chunked codecs process per inner block (a whole number of chunks is used).
BLOCK_ELEMENTS = 1 << 17

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

Layout = tuple  # tuple[tuple[np.dtype, int], ...]


def check_float_dtype(dtype: Any, argname: str, codec_name: str) -> np.dtype:
    """Return ``dtype`` as a numpy dtype if it is float32 or float64.

    Raises:
        TypeError: any other dtype (integers, float16, complex, ...).
    """
    dt = np.dtype(dtype)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{argname} has dtype {dt}; compression={codec_name!r} needs "
                        f"float32 or float64 data")
    return dt


def layout_nbytes(layout: Layout) -> int:
    """Bytes of a payload with this layout."""
    return sum(np.dtype(dt).itemsize * n for dt, n in layout)


def payload_views(layout: Layout, raw: np.ndarray) -> tuple:
    """Views of the parts of a payload laid out back to back in the byte buffer ``raw``."""
    parts = []
    off = 0
    for dt, n in layout:
        dt = np.dtype(dt)
        nbytes = dt.itemsize * n
        parts.append(raw[off:off + nbytes].view(dt))
        off += nbytes
    return tuple(parts)


def new_payload(codec: "Codec", count: int, dtype: Any = np.float32) -> tuple[np.ndarray, tuple]:
    """Allocate one payload buffer for ``count`` elements: ``(raw uint8 buffer, parts)``."""
    layout = codec.layout(count, dtype)
    raw = np.empty(layout_nbytes(layout), dtype=np.uint8)
    return raw, payload_views(layout, raw)


def _ordered(parts: Sequence[tuple[Any, int]]) -> Layout:
    """Parts sorted by item size, largest first (stable), so every view is aligned."""
    return tuple(sorted(((np.dtype(d), int(n)) for d, n in parts),
                        key=lambda p: -p[0].itemsize))


class Codec:
    """Interface of a codec.

    Attributes:
        name: the spec :func:`get_codec` accepts for it (``"int8"``, ``"topk:0.01"``...).
        lossy: whether ``decode(encode(x))`` can differ from ``x`` (error feedback is on
            by default for lossy codecs).
        dense: whether the payload covers every element (dense codecs are re-encoded at
            every hop of a ring; sparse ones are all-gathered and summed).
    """

    name = "codec"
    lossy = True
    dense = True

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        """The ``(dtype, length)`` of each payload part for ``count`` elements of ``dtype``."""
        raise NotImplementedError

    def wire_bytes(self, count: int, dtype: Any = np.float32) -> int:
        """Bytes of the payload for ``count`` elements of ``dtype``."""
        return layout_nbytes(self.layout(count, dtype))

    def check_dtype(self, dtype: Any, argname: str = "x") -> np.dtype:
        """Raise ``TypeError`` (naming ``argname``) unless this codec encodes ``dtype``."""
        return check_float_dtype(dtype, argname, self.name)

    def encode(self, x: np.ndarray, out: tuple | None = None) -> tuple:
        """Encode the flat vector ``x``.

        Args:
            x: flat contiguous float32/float64 array.
            out: payload parts to write (from :func:`new_payload`); allocated if ``None``.
        Returns:
            The payload: a tuple of contiguous arrays (``out`` when given).
        """
        dt = self.check_dtype(x.dtype, "x")
        if out is None:
            out = new_payload(self, x.size, dt)[1]
        self._encode(x, out)
        return out

    def decode(self, payload: Sequence[np.ndarray], count: int, dtype: Any = np.float32,
               out: np.ndarray | None = None) -> np.ndarray:
        """Decode a payload of ``count`` elements into a flat array of ``dtype``.

        Args:
            payload: the parts, as :meth:`encode` returned them (or received).
            out: flat array of ``count`` elements of ``dtype`` to write; allocated if ``None``.
        """
        dt = self.check_dtype(dtype, "dtype")
        if out is None:
            out = np.empty(count, dtype=dt)
        self._decode(tuple(payload), count, out)
        return out

    def roundtrip(self, x: np.ndarray) -> np.ndarray:
        """``decode(encode(x))``: what a receiver would get for ``x``."""
        return self.decode(self.encode(x), x.size, x.dtype)

    def state_dict(self) -> dict:
        """The state that decides this codec's next encodings (random-k's step, stochastic
        int8's generator), for checkpoints: plain ints and strings. Empty for codecs whose
        encoding depends on the input alone."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (for a codec of the same name).

        Raises:
            ValueError: ``state`` does not belong to a codec like this one.
        """
        self._check_state(state, ())

    # implementations ------------------------------------------------------------------
    def _encode(self, x: np.ndarray, out: tuple) -> None:
        raise NotImplementedError

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def _check_state(self, state: Any, keys: tuple) -> None:
        """Raise ``ValueError`` unless ``state`` is a dict with exactly ``keys``."""
        if not isinstance(state, dict) or set(state) != set(keys):
            raise ValueError(f"codec state {state!r} does not belong to compression="
                             f"{self.name!r} (expected the keys {sorted(keys)})")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class NoneCodec(Codec):
    """No compression: the values as they are (lossless)."""

    name = "none"
    lossy = False

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return ((np.dtype(dtype), int(count)),)

    def _encode(self, x: np.ndarray, out: tuple) -> None:
        np.copyto(out[0], x)

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        np.copyto(out, payload[0], casting="unsafe")


class FP16Codec(Codec):
    """IEEE half precision (``astype(float16)``: round to nearest even, overflow to inf)."""

    name = "fp16"

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return ((np.dtype(np.float16), int(count)),)

    def _encode(self, x: np.ndarray, out: tuple) -> None:
        np.copyto(out[0], x, casting="unsafe")

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        np.copyto(out, payload[0], casting="unsafe")


class BF16Codec(Codec):
    """bfloat16: the upper 16 bits of float32, rounded to nearest even; NaN stays NaN.

    float64 input is first rounded to float32 (double rounding, as a cast chain would).
    """

    name = "bf16"

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return ((np.dtype(np.uint16), int(count)),)

    def _encode(self, x: np.ndarray, out: tuple) -> None:
        dst = out[0]
        step = BLOCK_ELEMENTS
        t = np.empty(min(step, x.size), dtype=np.uint32)
        for lo in range(0, x.size, step):
            xb = x[lo:lo + step]
            x32 = xb if xb.dtype == np.float32 else xb.astype(np.float32)
            b = x32.view(np.uint32)
            tb = t[:b.size]
            np.right_shift(b, 16, out=tb)
            np.bitwise_and(tb, 1, out=tb)
            tb += 0x7FFF
            tb += b
            np.right_shift(tb, 16, out=tb)
            np.copyto(dst[lo:lo + step], tb, casting="unsafe")
        nan = np.isnan(x)
        if nan.any():  # rounding could carry a NaN's low mantissa bits into infinity
            b = x[nan].astype(np.float32).view(np.uint32)
            dst[nan] = (b >> 16).astype(np.uint16) | np.uint16(0x0040)

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        src = payload[0]
        if out.dtype == np.float32:
            o = out.view(np.uint32)
            np.copyto(o, src)
            np.left_shift(o, 16, out=o)
            return
        step = BLOCK_ELEMENTS
        t = np.empty(min(step, count), dtype=np.uint32)
        for lo in range(0, count, step):
            tb = t[:min(step, count - lo)]
            np.copyto(tb, src[lo:lo + step])
            np.left_shift(tb, 16, out=tb)
            np.copyto(out[lo:lo + step], tb.view(np.float32))


class _ChunkedCodec(Codec):
    """Shared parts of the codecs with one float32 scale per chunk of ``chunk`` elements."""

    def __init__(self, chunk: int = 256) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
            raise TypeError(f"chunk must be an int, not {type(chunk).__name__}")
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.chunk = int(chunk)
        # whole chunks per inner block (at least one)
        self._block = max(1, BLOCK_ELEMENTS // self.chunk) * self.chunk

    def nchunks(self, count: int) -> int:
        """Number of chunks (and scales) for ``count`` elements."""
        return -(-int(count) // self.chunk)

    def _blocks(self, count: int):
        """(lo, hi, first chunk) of each inner block; blocks hold whole chunks."""
        for lo in range(0, count, self._block):
            yield lo, min(count, lo + self._block), lo // self.chunk

    def _rows(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``a`` split into full chunks (2-D) and the partial tail chunk (1-D, maybe empty)."""
        full = a.size // self.chunk * self.chunk
        return a[:full].reshape(-1, self.chunk), a[full:]


class Int8Codec(_ChunkedCodec):
    """int8 with one float32 scale per chunk: ``q = round(x / s)``, ``s = max|x| / 127``.

    Deterministic rounding (to nearest even) errs by at most ``s/2`` per element; stochastic
    rounding (``stochastic=True``: ``q = floor(x/s + u)``, ``u`` uniform in [0, 1) from a
    ``numpy.random.Generator`` seeded with ``seed``) is unbiased and errs by less than
    ``s``. Up to float rounding in ``x / s`` in both cases. A chunk of zeros has scale 0.
    """

    def __init__(self, chunk: int = 256, stochastic: bool = False, seed: int = 0) -> None:
        super().__init__(chunk)
        self.stochastic = bool(stochastic)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.name = "int8" + (f":{self.chunk}" if self.chunk != 256 else "") + \
            (":stochastic" if self.stochastic else "")

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return _ordered([(np.float32, self.nchunks(count)), (np.int8, count)])

    def _encode(self, x: np.ndarray, out: tuple) -> None:
        scales, q = out
        tmp = np.empty(min(self._block, x.size), dtype=x.dtype)
        for lo, hi, k0 in self._blocks(x.size):
            xb = x[lo:hi]
            full, tail = self._rows(xb)
            nfull = full.shape[0]
            amax = np.empty(nfull + (1 if tail.size else 0), dtype=x.dtype)
            if nfull:
                np.maximum(full.max(axis=1), -full.min(axis=1), out=amax[:nfull])
            if tail.size:
                amax[nfull] = max(tail.max(), -tail.min())
            sc = scales[k0:k0 + amax.size]
            np.divide(amax, 127.0, out=sc, casting="unsafe")
            inv = np.divide(1.0, sc, out=np.zeros(sc.size, dtype=x.dtype), where=sc > 0)
            tb = tmp[:xb.size]
            tfull, ttail = self._rows(tb)
            if nfull:
                np.multiply(full, inv[:nfull, None], out=tfull)
            if tail.size:
                np.multiply(tail, inv[-1], out=ttail)
            if self.stochastic:
                tb += self._rng.random(tb.size, dtype=np.float64 if tb.dtype == np.float64
                                       else np.float32)
                np.floor(tb, out=tb)
                np.clip(tb, -127, 127, out=tb)
            else:
                np.rint(tb, out=tb)
            np.copyto(q[lo:hi], tb, casting="unsafe")

    def state_dict(self) -> dict:
        """Stochastic rounding: the generator's state (``numpy`` ``bit_generator.state``)."""
        return {"rng": self._rng.bit_generator.state} if self.stochastic else {}

    def load_state_dict(self, state: dict) -> None:
        if not self.stochastic:
            super().load_state_dict(state)
            return
        self._check_state(state, ("rng",))
        self._rng.bit_generator.state = state["rng"]

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        scales, q = payload
        for lo, hi, k0 in self._blocks(count):
            qf, qt = self._rows(q[lo:hi])
            of, ot = self._rows(out[lo:hi])
            nfull = qf.shape[0]
            if nfull:
                np.multiply(qf, scales[k0:k0 + nfull, None], out=of, casting="unsafe")
            if qt.size:
                np.multiply(qt, scales[k0 + nfull], out=ot, casting="unsafe")


#: Row ``b`` holds the 8 signs (+1 for a clear bit, -1 for a set bit) of packed byte ``b``.
_SIGN_TABLE = (1.0 - 2.0 * np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)
               ).astype(np.float32)


class OneBitCodec(_ChunkedCodec):
    """1-bit: the sign of each element (``np.packbits``, big-endian bit order; a set bit
    means negative, so ``+0`` is positive and ``-0`` negative) and one float32 scale per
    chunk, the mean of ``|x|`` over the chunk (1-bit SGD / 1-bit Adam). Decodes to
    ``±scale``. For training with momentum SGD compress the momentum rather than the
    gradient (``Compression.onebit.with_momentum(beta)``; docs/compression.md, *Training
    with compression*): with error feedback on gradients and momentum applied after the
    reduction the example's training diverged.

    ``chunk`` must be a multiple of 8 so chunks start on byte boundaries.
    """

    def __init__(self, chunk: int = 256) -> None:
        super().__init__(chunk)
        if self.chunk % 8:
            raise ValueError(f"chunk must be a multiple of 8 for onebit, got {chunk}")
        self.name = "onebit" + (f":{self.chunk}" if self.chunk != 256 else "")

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return _ordered([(np.float32, self.nchunks(count)), (np.uint8, -(-int(count) // 8))])

    def _encode(self, x: np.ndarray, out: tuple) -> None:
        scales, bits = out
        tmp = np.empty(min(self._block, x.size), dtype=x.dtype)
        neg = np.empty(min(self._block, x.size), dtype=np.bool_)
        for lo, hi, k0 in self._blocks(x.size):
            xb = x[lo:hi]
            tb = tmp[:xb.size]
            np.abs(xb, out=tb)
            full, tail = self._rows(tb)
            nfull = full.shape[0]
            sc = scales[k0:k0 + nfull + (1 if tail.size else 0)]
            if nfull:
                np.multiply(full.sum(axis=1), 1.0 / self.chunk, out=sc[:nfull],
                            casting="unsafe")
            if tail.size:
                sc[nfull] = tail.sum() / tail.size
            nb = neg[:xb.size]
            np.signbit(xb, out=nb)
            bits[lo // 8:(hi + 7) // 8] = np.packbits(nb)

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        scales, bits = payload
        tmp = np.empty((min(self._block, count) + 7) // 8 * 8, dtype=np.float32)
        for lo, hi, k0 in self._blocks(count):
            nbytes = (hi - lo + 7) // 8
            t2 = tmp[:nbytes * 8].reshape(nbytes, 8)
            np.take(_SIGN_TABLE, bits[lo // 8:lo // 8 + nbytes], axis=0, out=t2)
            signs = tmp[:hi - lo]
            sf, st = self._rows(signs)
            of, ot = self._rows(out[lo:hi])
            nfull = sf.shape[0]
            if nfull:
                np.multiply(sf, scales[k0:k0 + nfull, None], out=of)
            if st.size:
                np.multiply(st, scales[k0 + nfull], out=ot)


def _check_ratio(ratio: Any, what: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} ratio must be a number in (0, 1], not {type(ratio).__name__}")
    r = float(ratio)
    if not (0.0 < r <= 1.0):
        raise ValueError(f"{what} ratio must be in (0, 1], got {ratio!r}")
    return r


class _SparseCodec(Codec):
    dense = False
    kind = "sparse"

    def __init__(self, ratio: float) -> None:
        self.ratio = _check_ratio(ratio, self.kind)
        self.name = f"{self.kind}:{self.ratio:g}"

    def k(self, count: int) -> int:
        """Elements kept out of ``count``: ``ceil(ratio * count)``, at least 1 if any."""
        count = int(count)
        if count == 0:
            return 0
        return min(count, max(1, math.ceil(self.ratio * count - 1e-9)))

    @staticmethod
    def index_dtype(count: int) -> np.dtype:
        return np.dtype(np.int32) if count <= np.iinfo(np.int32).max else np.dtype(np.int64)

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        k = self.k(count)
        return _ordered([(np.dtype(dtype), k), (self.index_dtype(count), k)])

    def _select(self, x: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError

    def _parts(self, payload: tuple) -> tuple[np.ndarray, np.ndarray]:
        """(values, indices) whatever their wire order."""
        a, b = payload
        return (a, b) if a.dtype.kind == "f" else (b, a)

    def _encode(self, x: np.ndarray, out: tuple) -> None:
        values, idx = self._parts(out)
        k = idx.size
        if k == 0:
            return
        sel = self._select(x, k)
        sel.sort()
        np.copyto(idx, sel, casting="unsafe")
        np.take(x, sel, out=values)

    def _decode(self, payload: tuple, count: int, out: np.ndarray) -> None:
        values, idx = self._parts(payload)
        out.fill(0)
        out[idx] = values

    def indices_values(self, payload: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, values)`` of a payload (indices sorted, distinct)."""
        values, idx = self._parts(payload)
        return idx, values


class TopKCodec(_SparseCodec):
    """The ``k = ceil(ratio * count)`` elements of largest magnitude (``np.argpartition``,
    deterministic for a given input), sent as values and sorted int32 indices."""

    kind = "topk"

    def _select(self, x: np.ndarray, k: int) -> np.ndarray:
        if k == x.size:
            return np.arange(x.size)
        return np.argpartition(np.abs(x), x.size - k)[x.size - k:]


class RandomKCodec(_SparseCodec):
    """``k = ceil(ratio * count)`` elements chosen uniformly without replacement.

    The indices come from ``numpy.random.default_rng([seed, step])`` where ``step`` counts
    this codec's :meth:`encode` calls: ranks that build the codec with the same ``seed``
    and encode the same sequence of tensors choose the **same indices** at every step (the
    shared-seed variant: the sum of all ranks' payloads stays k-sparse). Give each rank its
    own seed for independent choices. The payload carries the indices either way, so
    decoding never depends on the generator.
    """

    kind = "randomk"

    def __init__(self, ratio: float, seed: int = 0) -> None:
        super().__init__(ratio)
        self.seed = int(seed)
        self.step = 0

    def _select(self, x: np.ndarray, k: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.step])
        if k == x.size:
            return np.arange(x.size)
        return rng.choice(x.size, size=k, replace=False)

    def encode(self, x: np.ndarray, out: tuple | None = None) -> tuple:
        try:
            return super().encode(x, out)
        finally:
            self.step += 1

    def state_dict(self) -> dict:
        """``{"step": the number of encodings so far}``."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state, ("step",))
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"codec state: step must be an int >= 0, not {step!r}")
        self.step = int(step)


#: Codec names :func:`get_codec` accepts (``topk``/``randomk`` take ``:ratio``).
CODECS = {
    "none": NoneCodec,
    "fp16": FP16Codec,
    "bf16": BF16Codec,
    "int8": Int8Codec,
    "onebit": OneBitCodec,
    "topk": TopKCodec,
    "randomk": RandomKCodec,
}


def get_codec(spec: Any, argname: str = "compression") -> Codec:
    """Return the codec for ``spec``.

    Args:
        spec: a :class:`Codec` (returned as is), ``None`` (``"none"``), or a name:
            ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"`` (``"int8:512"`` sets the chunk),
            ``"onebit"`` (``"onebit:512"``), ``"topk:RATIO"``, ``"randomk:RATIO"`` (RATIO in
            (0, 1], e.g. ``"topk:0.01"``).
        argname: the argument's name, for error messages.
    Raises:
        TypeError: ``spec`` is neither a codec nor a string.
        ValueError: unknown name, a ratio outside (0, 1], or a malformed parameter.
    """
    if spec is None:
        return NoneCodec()
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"{argname} must be a codec name or a Codec, not {type(spec).__name__}")
    name, _, param = spec.strip().lower().partition(":")
    if name not in CODECS:
        raise ValueError(f"unknown {argname}={spec!r}; choose from "
                         f"{', '.join(sorted(CODECS))} (topk/randomk as 'topk:0.01')")
    cls = CODECS[name]
    if name in ("topk", "randomk"):
        if not param:
            raise ValueError(f"{argname}={spec!r} needs a ratio, e.g. '{name}:0.01'")
        try:
            ratio = float(param)
        except ValueError:
            raise ValueError(f"{argname}={spec!r}: ratio {param!r} is not a number") from None
        if not (0.0 < ratio <= 1.0):
            raise ValueError(f"{argname}={spec!r}: {name} ratio must be in (0, 1], got {ratio:g}")
        return cls(ratio)
    if name in ("int8", "onebit") and param:
        opts = param.split(":")
        kwargs: dict[str, Any] = {}
        for opt in opts:
            if opt.isdigit():
                kwargs["chunk"] = int(opt)
            elif opt == "stochastic" and name == "int8":
                kwargs["stochastic"] = True
            else:
                raise ValueError(f"{argname}={spec!r}: unknown option {opt!r}")
        return cls(**kwargs)
    if param:
        raise ValueError(f"{argname}={spec!r}: {name} takes no parameter")
    return cls()
