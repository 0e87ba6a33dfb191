"""Error feedback: what compression dropped this step is added back next step.

For a lossy codec ``C`` with error feedback, a rank compresses ``y = x + e`` (its input plus
the residual it kept from the previous step) and keeps ``e' = y - decode(C(y))`` for the
next one; nothing is lost, only delayed, so biased codecs (sign, top-k) still converge
(1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019).

The residual belongs to whoever owns the tensor: an :class:`ErrorFeedback` holds one
residual per key (a parameter name, an index...), and is passed to every call that
compresses that tensor. :func:`tensor_feedback` is the default used when the caller passes
no object: a residual attached to the input array itself (held by a weak reference and
dropped when the array is freed).

Residuals live beside their tensors: a device tensor's residual is a device array of the
same module (CuPy), and compensation, encoding and the residual update all run there
(:mod:`~mpicoll.compression.namespace`).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Hashable

import numpy as np

from . import namespace
from .codecs import Codec

__all__ = ["ErrorFeedback", "tensor_feedback"]


class ErrorFeedback:
    """Residuals of lossy compression, one per tensor key.

    >>> fb = ErrorFeedback()
    >>> payload = fb.encode(get_codec("onebit"), grad, key="layer1.weight")  # doctest: +SKIP

    The collectives use :meth:`compensate` (``x + residual``) before compressing and
    :meth:`store` with what was not sent after.
    """

    def __init__(self) -> None:
        self._residuals: dict[Hashable, Any] = {}

    def residual(self, key: Hashable = None) -> np.ndarray | None:
        """The stored residual of ``key`` (``None`` if there is none yet)."""
        return self._residuals.get(key)

    def check(self, key: Hashable, x: np.ndarray) -> np.ndarray | None:
        """Raise ``ValueError`` if the residual stored for ``key`` does not fit ``x``;
        return it (``None`` if there is none yet)."""
        res = self._residuals.get(key)
        if res is not None and (res.size != x.size or res.dtype != x.dtype):
            raise ValueError(f"feedback: the residual stored for key={key!r} has {res.size} "
                             f"{res.dtype} elements but the tensor has {x.size} {x.dtype}; "
                             f"use one key per tensor (key=...) or reset(key)")
        if res is not None and namespace.array_module(res) is not namespace.array_module(x):
            raise ValueError(f"feedback: the residual stored for key={key!r} is "
                             f"{namespace.side(res)} but the tensor is {namespace.side(x)}; "
                             f"use one key per tensor (key=...) or reset(key)")
        return res

    def compensate(self, key: Hashable, x: np.ndarray, out: np.ndarray | None = None
                   ) -> np.ndarray:
        """Return ``x + residual(key)`` (a new array, or ``out``); ``x`` itself is unchanged.

        Raises:
            ValueError: the stored residual does not match ``x``'s size and dtype.
        """
        res = self.check(key, x)
        xp = namespace.array_module(x)
        if out is None:
            out = xp.empty(x.size, dtype=x.dtype)
        if res is None:
            xp.copyto(out, x.reshape(-1))
        else:
            xp.add(x.reshape(-1), res, out=out)
        return out

    def buffer(self, key: Hashable, x: np.ndarray) -> np.ndarray:
        """The residual array of ``key`` to overwrite in place (allocated on first use)."""
        res = self.check(key, x)
        if res is None:
            res = self._residuals[key] = namespace.array_module(x).zeros(x.size, dtype=x.dtype)
        return res

    def store(self, key: Hashable, residual: np.ndarray) -> None:
        """Keep ``residual`` (flat; host or device) for ``key``, replacing what was there."""
        if namespace.array_module(residual) is np:
            residual = np.asarray(residual)
        self._residuals[key] = residual.reshape(-1)

    def encode(self, codec: Codec, x: np.ndarray, key: Hashable = None) -> tuple:
        """Compress ``x + residual(key)`` with ``codec``; keep what was not sent.

        Returns:
            The payload (``codec.encode`` of the compensated input).
        """
        flat = namespace.as_module_array(x, namespace.array_module(x)).reshape(-1)
        y = self.compensate(key, flat)
        payload = codec.encode(y)
        sent = codec.decode(payload, y.size, y.dtype)
        namespace.array_module(y).subtract(y, sent, out=y)
        self._residuals[key] = y
        return payload

    def reset(self, key: Hashable = ...) -> None:
        """Forget the residual of ``key`` (of every key when called without one)."""
        if key is ...:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def keys(self) -> list:
        """The keys holding a residual."""
        return list(self._residuals)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)

    def __repr__(self) -> str:
        return f"<ErrorFeedback: {len(self)} residuals>"


class _TensorFeedback(ErrorFeedback):
    """Residuals keyed by the input array object, dropped when that array is freed."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._refs: dict[int, Any] = {}

    def key_for(self, array: np.ndarray) -> int:
        """The key of ``array``: its ``id``, valid while a weak reference to it lives."""
        k = id(array)
        with self._lock:
            ref = self._refs.get(k)
            if ref is None or ref() is not array:
                self._residuals.pop(k, None)  # a dead array's id reused
                self._refs[k] = weakref.ref(array, lambda _r, k=k: self._forget(k))
        return k

    def _forget(self, k: int) -> None:
        with self._lock:
            self._refs.pop(k, None)
            self._residuals.pop(k, None)


_TENSOR_FEEDBACK = _TensorFeedback()


def tensor_feedback() -> _TensorFeedback:
    """The default residual store: one residual per input array object (weakly held)."""
    return _TENSOR_FEEDBACK
