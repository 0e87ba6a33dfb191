"""Gradient codecs: what a float vector becomes on the wire, and back.

Every codec turns a flat float32/float64 vector of ``count`` elements into a *payload*: a
tuple of contiguous numpy arrays whose dtypes and lengths depend only on ``count`` and the
input dtype (:meth:`Codec.layout`), so a receiver can allocate its buffer before the message
arrives. The parts of a payload are laid out back to back in one ``uint8`` buffer, largest
item size first (so every part is aligned without padding); :func:`new_payload` allocates
it and the whole buffer is what travels (``Codec.wire_bytes(count)`` bytes).

==============  =====================================================  ==========================
codec           payload (in wire order)                                bytes for ``count`` floats
==============  =====================================================  ==========================
``none``        the values in the input dtype                          ``count * itemsize``
``fp16``        ``float16[count]``                                     ``2 count``
``bf16``        ``uint16[count]``: upper half of float32, RNE          ``2 count``
``int8``        ``float32[nchunks]`` scales, ``int8[count]``           ``count + 4 ceil(count/C)``
``onebit``      ``float32[nchunks]`` scales, ``uint8[ceil(count/8)]``  ``ceil(count/8) + 4 ceil(count/C)``
``onebit:two``  ``float32[2 nchunks]``, ``uint8[ceil(count/8)]``         ``ceil(count/8) + 8 ceil(count/C)``
``topk:r``      values ``dtype[k]``, indices ``int32[k]`` (sorted)     ``k (itemsize + 4)``
``randomk:r``   values ``dtype[k]``, indices ``int32[k]`` (sorted)     ``k (itemsize + 4)``
==============  =====================================================  ==========================

``C`` is the chunk size (``chunk=``, default 256 elements); ``k = ceil(r * count)`` (at least
1 when ``count > 0``); indices are ``int64`` past 2**31 - 1 elements.

Every kernel is vectorised and runs in the array module of its input
(:mod:`~mpicoll.compression.namespace`): numpy on the host, working through the vector in
blocks of whole chunks (``BLOCK_ELEMENTS``) so that temporaries stay in cache; CuPy on a
device array, the whole vector at once, with bit for bit the same payload and decoded
values (every step is elementwise IEEE arithmetic, integer bit operations or an ordered
reduction that both modules compute alike):

- ``onebit``'s chunk means sum ``|x|`` by pairwise halving (:func:`pairwise_row_sums`),
  not with ``sum()``, whose order differs between numpy and CuPy (``onebit:two`` sums
  each sign group so, and counts its elements in integers);
- ``int8:stochastic`` draws its uniforms from a counter-based hash
  (:mod:`~mpicoll.compression.counter_rng`) keyed by ``(seed, encoding number)`` and the
  element index, not from a ``numpy.random.Generator``;
- ``topk`` keeps the ``k`` largest magnitudes, ties broken towards the lower index (NaN
  counts as infinite), which both modules compute the same way;
- ``randomk``'s indices do not depend on the data: they are drawn with numpy on the host,
  as before, and only the ``k`` indices are copied to the device.

A payload lives where it was encoded. :meth:`Codec.encode` of a device vector into host
``out`` parts encodes on the device and copies only the payload to the host;
:meth:`Codec.decode` of host parts into a device ``out`` copies only the payload to the
device (:meth:`Codec.to_host_payload` and :meth:`Codec.decode_into` do the same for a
payload held as one byte buffer, the form that travels over MPI).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from . import namespace
from .counter_rng import stream_key, uniform

__all__ = ["Codec", "NoneCodec", "FP16Codec", "BF16Codec", "Int8Codec", "OneBitCodec",
           "TwoScaleOneBitCodec", "TopKCodec", "RandomKCodec", "CODECS", "get_codec", "new_payload",
           "payload_views", "layout_nbytes", "check_float_dtype", "BLOCK_ELEMENTS",
           "pairwise_row_sums"]

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


def new_payload(codec: "Codec", count: int, dtype: Any = np.float32,
                like: Any = None) -> tuple[Any, tuple]:
    """Allocate one payload buffer for ``count`` elements: ``(raw uint8 buffer, parts)``,
    in host memory, or in the module (and device) of array ``like`` when given."""
    layout = codec.layout(count, dtype)
    xp = namespace.array_module(like)
    raw = xp.empty(layout_nbytes(layout), dtype=np.uint8)
    return raw, payload_views(layout, raw)


def pairwise_row_sums(xp: Any, rows: Any) -> Any:
    """Sums of the rows of 2-D float array ``rows`` (which it overwrites), in a fixed
    pairwise order: the right half of the columns is added onto the left half (an odd
    last column onto the first) until one column is left; returned as a view of it.

    Every step is an elementwise addition, so numpy and CuPy give the same bits (their
    ``sum()`` reductions add in different orders). Rows of at most
    :data:`NARROW_ROWS` columns are first copied column-major, so that every step adds
    contiguous vectors instead of many short row pieces (the same additions, the same
    bits).
    """
    width = rows.shape[1]
    if width == 0:
        return xp.zeros(rows.shape[0], dtype=rows.dtype)
    # column j of rows is cols[j] (a column-major copy, or a view)
    cols = xp.ascontiguousarray(rows.T) if 1 < width <= NARROW_ROWS else rows.T
    while width > 1:
        half = width // 2
        xp.add(cols[:half], cols[half:2 * half], out=cols[:half])
        if width % 2:
            xp.add(cols[:1], cols[width - 1:width], out=cols[:1])
        width = half
    return cols[0]


#: Widest rows :func:`pairwise_row_sums` sums column-major (numpy, 2^17 elements, one
#: process: 8x faster at 8 columns, 2.8x at 32, 2x at 64, no faster at 128).
NARROW_ROWS = 64


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

    def encode(self, x: Any, out: tuple | None = None) -> tuple:
        """Encode the flat vector ``x``, in the array module of ``x`` (numpy, CuPy).

        Args:
            x: flat contiguous float32/float64 array (host or device).
            out: payload parts to write (from :func:`new_payload`); allocated beside ``x``
                if ``None``. Parts on the host for a device ``x``: the payload is encoded
                on the device and only it is copied to ``out``.
        Returns:
            The payload: a tuple of contiguous arrays (``out`` when given).
        """
        xp = namespace.array_module(x)
        x = namespace.as_module_array(x, xp)   # a torch tensor: its numpy/CuPy view
        dt = self.check_dtype(x.dtype, "x")
        # host parts for device x: encoded on the device, then copied into them
        host = bool(out) and namespace.array_module(out[0]) is not xp
        parts = new_payload(self, x.size, dt, like=x)[1] if out is None or host else out
        with np.errstate(invalid="ignore"):  # an integer codec's chunk holding NaN or inf:
            self._encode(xp, x, parts)  # levels cast from NaN; the scale NaN decodes it
        if not host:
            return parts
        for dst, src in zip(out, parts):
            namespace.to_host(src, out=dst)
        return tuple(out)

    def decode(self, payload: Sequence[Any], count: int, dtype: Any = np.float32,
               out: Any = None) -> Any:
        """Decode a payload of ``count`` elements into a flat array of ``dtype``.

        Runs in the array module of ``out`` (of the payload when ``out`` is ``None``). A
        host payload decoded into a device ``out`` is first copied to the device.

        Args:
            payload: the parts, as :meth:`encode` returned them (or received).
            out: flat array of ``count`` elements of ``dtype`` to write; allocated beside
                the payload if ``None``.
        """
        dt = self.check_dtype(dtype, "dtype")
        payload = tuple(payload)
        like = out if out is not None else (payload[0] if payload else None)
        xp = namespace.array_module(like)
        if out is None:
            out = xp.empty(count, dtype=dt)
        payload = tuple(namespace.to_side(p, out) for p in payload)
        self._decode(xp, payload, count, out)
        return out

    def to_host_payload(self, raw: Any, out: np.ndarray | None = None) -> np.ndarray:
        """The payload byte buffer ``raw`` (from :func:`new_payload`) in host memory, to
        send over an MPI library that is not CUDA-aware: a device buffer is copied (only
        :meth:`wire_bytes` bytes cross), a host one returned as is (or copied into
        ``out``)."""
        return namespace.to_host(raw, out=out)

    def decode_into(self, raw: Any, count: int, out: Any) -> Any:
        """Decode the payload bytes ``raw`` (as received: one uint8 buffer, host or
        device) of ``count`` elements into flat array ``out`` (host or device; a host
        payload is copied to ``out``'s device first, only the payload crosses).

        Raises:
            ValueError: ``raw`` does not hold :meth:`wire_bytes` bytes.
        """
        layout = self.layout(count, out.dtype)
        if raw.size != layout_nbytes(layout):
            raise ValueError(f"payload of {raw.size} bytes for {count} {out.dtype} elements "
                             f"of compression={self.name!r} ({layout_nbytes(layout)} bytes)")
        raw = namespace.to_side(raw, out)
        return self.decode(payload_views(layout, raw), count, out.dtype, out=out)

    def roundtrip(self, x: Any) -> Any:
        """``decode(encode(x))``: what a receiver would get for ``x``."""
        return self.decode(self.encode(x), x.size, x.dtype)

    def state_dict(self) -> dict:
        """The state that decides this codec's next encodings (random-k's step, stochastic
        int8's generator), for checkpoints: plain ints and strings. Empty for codecs whose
        encoding depends on the input alone."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (for a codec of the same name): the
        value of each of its keys is the number of encodings so far (``step``).

        Raises:
            ValueError: ``state`` does not belong to a codec like this one.
        """
        keys = sorted(self.state_dict())
        if not isinstance(state, dict) or set(state) != set(keys):
            raise ValueError(f"codec state {state!r} does not belong to compression="
                             f"{self.name!r} (expected the keys {keys})")
        for key in keys:
            self.step = _check_step(state[key])

    # implementations: ``xp`` is the array module of the arrays ---------------------------
    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        xp.copyto(out[0], x, casting="unsafe")   # (a payload of the values, cast)

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        xp.copyto(out, payload[0], casting="unsafe")   # (a payload of the values, cast)

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class NoneCodec(Codec):
    """No compression: the values as they are (lossless)."""

    name = "none"
    lossy = False

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return ((np.dtype(dtype), int(count)),)


class FP16Codec(Codec):
    """IEEE half precision (``astype(float16)``: round to nearest even, overflow to inf)."""

    name = "fp16"

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return ((np.dtype(np.float16), int(count)),)

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        if x.dtype == np.float64 and xp is not np:
            x = _round_to_odd_float32(xp, x)
        super()._encode(xp, x, out)


def _round_to_odd_float32(xp: Any, x: Any) -> Any:
    """float64 ``x`` rounded to float32 *to odd* (toward zero, the last bit set when
    inexact). Rounding that to float16 (nearest even) is exactly numpy's direct
    float64 -> float16 cast, whatever the device library does for double -> half
    (a plain cast through float32 would round twice)."""
    f = x.astype(np.float32)
    away = xp.abs(f.astype(np.float64)) > xp.abs(x)
    f = xp.where(away, xp.nextafter(f, np.float32(0.0)), f)
    inexact = (f.astype(np.float64) != x).astype(np.uint32)
    bits = f.view(np.uint32)
    xp.bitwise_or(bits, inexact, out=bits)
    return f


class BF16Codec(Codec):
    """bfloat16: the upper 16 bits of float32, rounded to nearest even; NaN stays NaN.

    float64 input is first rounded to float32 (double rounding, as a cast chain would).
    """

    name = "bf16"

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return ((np.dtype(np.uint16), int(count)),)

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        dst = out[0]
        step = namespace.block_elements(xp, BLOCK_ELEMENTS) or max(x.size, 1)
        t = xp.empty(min(step, x.size), dtype=np.uint32)
        for lo in range(0, x.size, step):
            xb = x[lo:lo + step]
            x32 = xb if xb.dtype == np.float32 else xb.astype(np.float32)
            b = x32.view(np.uint32)
            tb = t[:b.size]
            xp.right_shift(b, np.uint32(16), out=tb)
            xp.bitwise_and(tb, np.uint32(1), out=tb)
            xp.add(tb, np.uint32(0x7FFF), out=tb)
            xp.add(tb, b, out=tb)
            xp.right_shift(tb, np.uint32(16), out=tb)
            xp.copyto(dst[lo:lo + step], tb, casting="unsafe")
        nan = xp.isnan(x)
        if nan.any():  # rounding could carry a NaN's low mantissa bits into infinity
            b = x[nan].astype(np.float32).view(np.uint32)
            dst[nan] = (b >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        src = payload[0]
        if out.dtype == np.float32:
            o = out.view(np.uint32)
            xp.copyto(o, src)
            xp.left_shift(o, np.uint32(16), out=o)
            return
        step = namespace.block_elements(xp, BLOCK_ELEMENTS) or max(count, 1)
        t = xp.empty(min(step, count), dtype=np.uint32)
        for lo in range(0, count, step):
            tb = t[:min(step, count - lo)]
            xp.copyto(tb, src[lo:lo + step])
            xp.left_shift(tb, np.uint32(16), out=tb)
            xp.copyto(out[lo:lo + step], tb.view(np.float32))


class _ChunkedCodec(Codec):
    """Shared parts of the codecs with one float32 scale per chunk of ``chunk`` elements."""

    def __init__(self, chunk: int = 256) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
            raise TypeError(f"chunk must be an int, not {type(chunk).__name__}")
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.chunk = int(chunk)

    def nchunks(self, count: int) -> int:
        """Number of chunks (and scales) for ``count`` elements."""
        return -(-int(count) // self.chunk)

    def _block_size(self, xp: Any, count: int) -> int:
        """Elements per inner block in module ``xp``: whole chunks, at least one; on a
        device the whole vector."""
        step = namespace.block_elements(xp, BLOCK_ELEMENTS)
        if step is None:
            return max(1, self.nchunks(count)) * self.chunk
        return max(1, step // self.chunk) * self.chunk

    def _blocks(self, xp: Any, count: int):
        """(lo, hi, first chunk) of each inner block; blocks hold whole chunks."""
        block = self._block_size(xp, count)
        for lo in range(0, count, block):
            yield lo, min(count, lo + block), lo // self.chunk

    def _rows(self, a: Any) -> tuple[Any, Any]:
        """``a`` split into full chunks (2-D) and the partial tail chunk (1-D, maybe empty)."""
        full = a.size // self.chunk * self.chunk
        return a[:full].reshape(-1, self.chunk), a[full:]

    def _encode_blocks(self, xp: Any, x: Any, *dtypes: Any):
        """``(lo, first chunk, block of x, scratch...)`` per inner block: one scratch array
        of each of ``dtypes`` (as long as the block)."""
        block = min(self._block_size(xp, x.size), x.size)
        scratch = [xp.empty(block, dtype=dt) for dt in dtypes]
        for lo, hi, k0 in self._blocks(xp, x.size):
            yield (lo, k0, x[lo:hi], *(s[:hi - lo] for s in scratch))

    def _per_chunk(self, xp: Any, a: Any, reduce: Callable[[Any], Any]) -> Any:
        """One value per chunk of block ``a`` (whole chunks, then maybe a shorter one):
        ``reduce`` of 2-D rows, one value per row, of the full chunks, then of the shorter
        chunk as one row."""
        full, tail = self._rows(a)
        values = [reduce(rows) for rows in (full, tail.reshape(1, -1)) if rows.size]
        return values[0] if len(values) == 1 else xp.concatenate(values)

    def _to_levels(self, xp: Any, xb: Any, scales: Any, levels: int, out: Any) -> None:
        """The scales of an integer codec with levels ``-levels .. levels`` for block
        ``xb`` (whole chunks, then maybe a shorter last one), and ``xb`` in units of them.

        Chunk ``k``'s scale ``s = max|x| / levels`` (in ``xb``'s dtype) is stored in
        ``scales[k]`` as float32, and ``out`` (as long as ``xb``, of its dtype) gets the
        chunk's ``x * (1/s)``, ``1/s`` computed in float32: values in
        ``[-levels, levels]`` up to float rounding, for the caller to round to integers.
        """
        full, tail = self._rows(xb)
        nfull = full.shape[0]
        amax = self._per_chunk(xp, xb, lambda r: xp.maximum(r.max(axis=1), -r.min(axis=1)))
        sc = scales[:amax.size]
        xp.divide(amax, xb.dtype.type(levels), out=amax)
        xp.copyto(sc, amax, casting="unsafe")
        # A chunk whose scale is zero or denormal (1/scale would overflow) is sent as
        # zeros with the scale +0.0 exactly: numpy and CuPy disagree on the sign of
        # max(0.0, -0.0), and the wire bits must not depend on the array module. A chunk
        # holding NaN or an infinity gets the scale NaN: it decodes to NaN, as a NaN or
        # infinity stays one through the float codecs (never zeros, never a flipped sign).
        finite = xp.isfinite(sc)
        positive = (sc >= np.float32(np.finfo(np.float32).tiny)) & finite
        xp.copyto(sc, np.float32(0.0), where=finite & ~positive)
        xp.copyto(sc, np.float32(np.nan), where=~finite)
        inv = xp.divide(np.float32(1.0), xp.where(positive, sc, np.float32(1.0)))
        inv = xp.where(positive, inv, np.float32(0.0)).astype(xb.dtype)
        tfull, ttail = self._rows(out)
        if nfull:
            xp.multiply(full, inv[:nfull, None], out=tfull)
        if tail.size:
            xp.multiply(tail, inv[nfull:], out=ttail)

    def _scaled(self, xp: Any, values: tuple[Any, Any], scales: Any, out: Any) -> None:
        """Chunk ``k`` of flat ``out`` = chunk ``k`` of ``values`` (:meth:`_rows`: the full
        chunks, then the tail) times ``scales[k]``, computed in float32 (``scales``'
        dtype), then stored in ``out``'s dtype: the same bits whichever module and output
        dtype."""
        nfull = values[0].shape[0]
        for v, sc, o in zip(values, (scales[:nfull, None], scales[nfull:nfull + 1]),
                            self._rows(out)):
            if not v.size:
                continue
            if o.dtype == np.float32:
                xp.multiply(v, sc, out=o)
            else:
                xp.copyto(o, xp.multiply(v, sc))


#: The largest magnitude of an int8 level (levels -127 .. 127).
LEVELS_INT8 = 127


class Int8Codec(_ChunkedCodec):
    """int8 with one float32 scale per chunk: ``q = round(x * (1/s))``, ``s = max|x| / 127``.

    Deterministic rounding (to nearest even) errs by at most ``s/2`` per element; stochastic
    rounding (``stochastic=True``: ``q = floor(x/s + u)``, ``u`` uniform in [0, 1) from
    :func:`~mpicoll.compression.counter_rng.uniform`, keyed by ``seed``, the number of
    encodings so far and the element index: the same numbers on the host and on a device)
    is unbiased and errs by less than ``s``. Up to float rounding in ``x / s`` in both
    cases. A chunk of zeros has scale 0. ``1/s`` is computed in float32.
    """

    def __init__(self, chunk: int = 256, stochastic: bool = False, seed: int = 0) -> None:
        super().__init__(chunk)
        self.stochastic = bool(stochastic)
        self.seed = int(seed)
        self.step = 0
        self.name = "int8" + (f":{self.chunk}" if self.chunk != 256 else "") + \
            (":stochastic" if self.stochastic else "")

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return _ordered([(np.float32, self.nchunks(count)), (np.int8, count)])

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        scales, q = out
        key = stream_key(self.seed, self.step) if self.stochastic else 0
        if self.stochastic:
            self.step += 1
        for lo, k0, xb, tb in self._encode_blocks(xp, x, x.dtype):
            self._to_levels(xp, xb, scales[k0:], LEVELS_INT8, tb)
            if self.stochastic:
                xp.add(tb, uniform(xp, key, lo, tb.size, tb.dtype), out=tb)
                xp.floor(tb, out=tb)
                xp.clip(tb, -LEVELS_INT8, LEVELS_INT8, out=tb)
            else:
                xp.rint(tb, out=tb)
            xp.copyto(q[lo:lo + xb.size], tb, casting="unsafe")

    def state_dict(self) -> dict:
        """Stochastic rounding: ``{"rng_step": the number of encodings so far}`` (the
        key of the next encoding's random numbers)."""
        return {"rng_step": self.step} if self.stochastic else {}

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        scales, q = payload
        for lo, hi, k0 in self._blocks(xp, count):
            self._scaled(xp, self._rows(q[lo:hi]), scales[k0:], out[lo:hi])


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"codec state: step must be an int >= 0, not {step!r}")
    return int(step)


#: Row ``b`` holds the 8 bits of packed byte ``b``, big-endian (True: a set bit).
_BIT_TABLE = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.bool_)

#: Row ``b`` holds the 8 signs (+1 for a clear bit, -1 for a set bit) of packed byte ``b``.
_SIGN_TABLE = (1.0 - 2.0 * _BIT_TABLE).astype(np.float32)


class OneBitCodec(_ChunkedCodec):
    """1-bit: the sign of each element (``packbits``, big-endian bit order; a set bit
    means negative, so ``+0`` is positive and ``-0`` negative) and one float32 scale per
    chunk, the mean of ``|x|`` over the chunk (1-bit SGD / 1-bit Adam; the sum in the
    pairwise order of :func:`pairwise_row_sums`, times ``1/chunk``, or divided by the
    length of a shorter last chunk). Decodes to ``±scale``. For training with momentum
    SGD compress the momentum rather than the gradient
    (``Compression.onebit.with_momentum(beta)``; docs/compression.md, *Training with
    compression*): with error feedback on gradients and momentum applied after the
    reduction the example's training diverged.

    ``chunk`` must be a multiple of 8 so chunks start on byte boundaries.
    """

    def __init__(self, chunk: int = 256) -> None:
        super().__init__(chunk)
        if self.chunk % 8:
            raise ValueError(f"chunk must be a multiple of 8 for onebit, got {chunk}")
        self.name = "onebit" + (f":{self.chunk}" if self.chunk != 256 else "")

    #: float32 values per chunk on the wire (one scale here).
    values_per_chunk = 1

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        return _ordered([(np.float32, self.values_per_chunk * self.nchunks(count)),
                         (np.uint8, -(-int(count) // 8))])

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        scales, bits = out
        for lo, k0, xb, tb, nb in self._encode_blocks(xp, x, x.dtype, np.bool_):
            xp.abs(xb, out=tb)
            sums = self._per_chunk(xp, tb, lambda r: pairwise_row_sums(xp, r))
            nfull = xb.size // self.chunk
            xp.multiply(sums[:nfull], x.dtype.type(1.0 / self.chunk), out=sums[:nfull])
            if nfull < sums.size:   # the shorter last chunk
                xp.divide(sums[nfull:], x.dtype.type(xb.size - nfull * self.chunk),
                          out=sums[nfull:])
            xp.copyto(scales[k0:k0 + sums.size], sums, casting="unsafe")
            _pack_signs(xp, xb, nb, bits, lo)

    def _unpacked(self, xp: Any, bits: Any, count: int, name: str, table: np.ndarray):
        """``(lo, hi, first chunk, rows of the bits' table values)`` per inner block:
        the table's row of each packed byte (signs or sign bits), one per element."""
        table = namespace.constant(xp, name, table)
        block = min(self._block_size(xp, count), count)
        tmp = xp.empty((block + 7) // 8 * 8, dtype=table.dtype)
        for lo, hi, k0 in self._blocks(xp, count):
            nbytes = (hi - lo + 7) // 8
            t2 = tmp[:nbytes * 8].reshape(nbytes, 8)
            xp.take(table, bits[lo // 8:lo // 8 + nbytes], axis=0, out=t2)
            yield lo, hi, k0, self._rows(tmp[:hi - lo])

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        scales, bits = payload
        for lo, hi, k0, rows in self._unpacked(xp, bits, count, "onebit.signs", _SIGN_TABLE):
            self._scaled(xp, rows, scales[k0:], out[lo:hi])


def _pack_signs(xp: Any, xb: Any, neg: Any, bits: Any, lo: int) -> None:
    """Set ``neg`` to the sign bits of block ``xb`` (which starts at element ``lo``, a
    multiple of 8) and pack them into ``bits`` (big-endian; a set bit is negative)."""
    xp.signbit(xb, out=neg)
    bits[lo // 8:(lo + xb.size + 7) // 8] = xp.packbits(neg)


class TwoScaleOneBitCodec(OneBitCodec):
    """1-bit with two values per chunk (1-bit SGD, Seide et al. 2014): the sign bits as
    :class:`OneBitCodec` sends them, and per chunk the mean of its non-negative elements
    (sign bit clear) and the mean of its negative elements (sign bit set, ``-0``
    included). Each element decodes to the mean of its own sign group: for a given sign
    pattern the values that minimise the chunk's squared error, so the residual error
    feedback keeps is smaller than with one mean of ``|x|`` (which is the same only when
    both groups have the same mean magnitude). A group without elements has the value 0
    (``-0`` for the negative group, so a chunk's ``-0`` elements decode to ``-0``).

    Wire format: ``float32[2 nchunks]`` (chunk ``k``'s non-negative mean at ``2k``, its
    negative mean, a value <= 0, at ``2k + 1``), then the packed signs
    ``uint8[ceil(count/8)]``: ``ceil(count/8) + 8 ceil(count/C)`` bytes. Each group's
    sum is taken in the pairwise order of :func:`pairwise_row_sums` (the other group's
    elements as zeros) in the input dtype, divided by the group's element count, then
    rounded to float32, so numpy and CuPy give the same bits. Name: ``onebit:two``
    (``onebit:C:two`` for chunks of ``C``).
    """

    def __init__(self, chunk: int = 256) -> None:
        super().__init__(chunk)
        self.name += ":two"

    values_per_chunk = 2

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        scales, bits = out
        for lo, k0, xb, tb, nb in self._encode_blocks(xp, x, x.dtype, np.bool_):
            _pack_signs(xp, xb, nb, bits, lo)
            sc = scales[2 * k0:2 * (k0 + self.nchunks(xb.size))].reshape(-1, 2)
            for group in (0, 1):               # 0: non-negative, 1: negative elements
                if group:
                    xp.logical_not(nb, out=nb)
                # this group's elements per chunk (nb flags the other): exact in any order
                counts = self._per_chunk(xp, nb, lambda r: r.shape[1] - xp.count_nonzero(r, axis=1))
                xp.copyto(tb, xb)              # the other group's elements as zeros of
                xp.copyto(tb, x.dtype.type(-0.0 if group else 0.0), where=nb)  # this sign
                sums = self._per_chunk(xp, tb, lambda r: pairwise_row_sums(xp, r))
                xp.divide(sums, xp.maximum(counts, 1).astype(x.dtype), out=sums)
                xp.copyto(sc[:, group], sums, casting="unsafe")

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        scales, bits = payload
        for lo, hi, k0, (nf, nt) in self._unpacked(xp, bits, count, "onebit.bits",
                                                   _BIT_TABLE):
            of, ot = self._rows(out[lo:hi])
            nfull = nf.shape[0]
            sc = scales[2 * k0:2 * (k0 + nfull + (1 if nt.size else 0))].reshape(-1, 2)
            if nfull:
                _two_valued(xp, nf, sc[:nfull], of)
            if nt.size:
                _two_valued(xp, nt.reshape(1, -1), sc[nfull:], ot.reshape(1, -1))


def _two_valued(xp: Any, negative: Any, values: Any, out: Any) -> None:
    """Row ``i`` of 2-D ``out`` = ``values[i, 1]`` where ``negative``, else ``values[i, 0]``."""
    xp.copyto(out, values[:, 0:1], casting="same_kind")
    xp.copyto(out, values[:, 1:2], casting="same_kind", where=negative)


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
        return min(count, max(1, math.ceil(self.ratio * count - 1e-9)))

    @staticmethod
    def index_dtype(count: int) -> np.dtype:
        return np.dtype(np.int32) if count <= np.iinfo(np.int32).max else np.dtype(np.int64)

    def layout(self, count: int, dtype: Any = np.float32) -> Layout:
        k = self.k(count)
        return _ordered([(np.dtype(dtype), k), (self.index_dtype(count), k)])

    def _select(self, xp: Any, x: Any, k: int) -> Any:
        """The ``k`` indices to send, sorted, as an array of module ``xp``."""
        raise NotImplementedError

    def _encode(self, xp: Any, x: Any, out: tuple) -> None:
        idx, values = self.indices_values(out)
        k = idx.size
        if k == 0:
            return
        sel = self._select(xp, x, k)
        xp.copyto(idx, sel, casting="unsafe")
        xp.take(x, sel, out=values)

    def _decode(self, xp: Any, payload: tuple, count: int, out: Any) -> None:
        idx, values = self.indices_values(payload)
        out.fill(0)
        out[idx] = values

    def indices_values(self, payload: tuple) -> tuple[Any, Any]:
        """``(indices, values)`` of a payload (indices sorted, distinct), whatever their
        wire order."""
        a, b = payload
        return (b, a) if a.dtype.kind == "f" else (a, b)


class TopKCodec(_SparseCodec):
    """The ``k = ceil(ratio * count)`` elements of largest magnitude, sent as values and
    sorted int32 indices. Ties at the ``k``-th largest magnitude go to the lower indices
    and NaN counts as infinite, so the choice is a function of the input alone, the same
    with numpy and CuPy (a partition finds the ``k``-th largest magnitude ``t``; every
    element above ``t`` is kept, then the first elements equal to ``t``)."""

    kind = "topk"

    def _select(self, xp: Any, x: Any, k: int) -> Any:
        n = x.size
        if k == n:
            return xp.arange(n)
        mag = xp.abs(x)
        nan = xp.isnan(mag)
        if nan.any():
            mag[nan] = xp.inf
        t = xp.partition(mag, n - k)[n - k:n - k + 1]
        above = xp.flatnonzero(mag > t)
        ties = xp.flatnonzero(mag == t)[:k - int(above.size)]
        sel = xp.concatenate([above, ties])
        sel.sort()
        return sel


class RandomKCodec(_SparseCodec):
    """``k = ceil(ratio * count)`` elements chosen uniformly without replacement.

    The indices come from ``numpy.random.default_rng([seed, step])`` where ``step`` counts
    this codec's :meth:`encode` calls: ranks that build the codec with the same ``seed``
    and encode the same sequence of tensors choose the **same indices** at every step (the
    shared-seed variant: the sum of all ranks' payloads stays k-sparse). Give each rank its
    own seed for independent choices. The payload carries the indices either way, so
    decoding never depends on the generator. The indices do not depend on the data: for a
    device vector they are drawn on the host and copied to the device (``k`` integers).
    """

    kind = "randomk"

    def __init__(self, ratio: float, seed: int = 0) -> None:
        super().__init__(ratio)
        self.seed = int(seed)
        self.step = 0

    def _select(self, xp: Any, x: Any, k: int) -> Any:
        if k == x.size:
            return xp.arange(x.size)
        rng = np.random.default_rng([self.seed, self.step])
        sel = rng.choice(x.size, size=k, replace=False)
        sel.sort()
        return namespace.to_device(sel, x)

    def encode(self, x: Any, out: tuple | None = None) -> tuple:
        try:
            return super().encode(x, out)
        finally:
            self.step += 1

    def state_dict(self) -> dict:
        """``{"step": the number of encodings so far}``."""
        return {"step": self.step}


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
            ``"int4"`` (``"int4:512"``; registered by :mod:`mpicoll.compression`),
            ``"onebit"`` (``"onebit:512"``; ``"onebit:two"``, ``"onebit:512:two"``: two
            values per chunk, :class:`TwoScaleOneBitCodec`), ``"topk:RATIO"``,
            ``"randomk:RATIO"`` (RATIO in
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
    if name in ("int8", "int4", "onebit") and param:
        opts = param.split(":")
        kwargs: dict[str, Any] = {}
        for opt in opts:
            if opt.isdigit():
                kwargs["chunk"] = int(opt)
            elif opt == "stochastic" and name == "int8":
                kwargs["stochastic"] = True
            elif opt == "two" and name == "onebit":
                cls = TwoScaleOneBitCodec
            else:
                raise ValueError(f"{argname}={spec!r}: unknown option {opt!r}")
        return cls(**kwargs)
    if param:
        raise ValueError(f"{argname}={spec!r}: {name} takes no parameter")
    return cls()
