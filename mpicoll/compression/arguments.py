"""Arguments of the compressed collectives: validation shared by all of them (their
buffers through :mod:`mpicoll.validation`, as every collective's), and the agreement step
that makes one rank's bad arguments an error on every rank.

Every check here runs before any message is sent, so bad arguments given to every rank
never hang; with ``check=True`` (:func:`agreed`) a rank whose arguments were bad raises its
own error and every other rank :class:`mpicoll.RemoteError`, and ranks that disagree on
the count, dtype, op, codec, segment size or resolved layout all raise
:class:`mpicoll.MismatchError` (:func:`mpicoll.checked.agree`).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

import numpy as np
from mpi4py import MPI

from .. import buffers
from ..checked import agree
from ..context import CommContext
from ..gpu import arrays as device_arrays
from . import namespace
from .namespace import side
from .auto import codec_from_spec
from .codecs import Codec
from .feedback import ErrorFeedback, tensor_feedback

__all__ = ["OPS", "DEFAULT_SEGMENT_BYTES", "named_codec", "resolve_op", "segment_size",
           "array_view", "side", "check_side", "feedback_store", "agreed", "compensated"]

#: Largest segment of the uncompressed input per message (bytes).
DEFAULT_SEGMENT_BYTES = 4 << 20

#: Values of ``op=`` (``average``: sum, then one division by the world size).
OPS = ("sum", "average")

#: Codecs built from names, one per name and process: stateful codecs (randomk's step,
#: stochastic int8's generator) then advance from call to call, identically on every rank
#: that makes the same sequence of calls.
_named_codecs: dict[str, Codec] = {}


def named_codec(spec: Any) -> Codec:
    """The codec of ``compression=``: one object per name and process, or the codec given
    (``"auto"`` and ``"auto:..."``: an :class:`~.auto.Auto`, resolved per call).

    Raises:
        ValueError, TypeError: an unknown name or a bad ratio (:func:`get_codec`).
    """
    if isinstance(spec, str):
        codec = _named_codecs.get(spec)
        if codec is None:
            codec = _named_codecs[spec] = codec_from_spec(spec)
        return codec
    return codec_from_spec(spec)


def resolve_op(op: Any, collective: str) -> str:
    """``"sum"`` or ``"average"`` from ``op`` (``MPI.SUM`` is ``"sum"``).

    Raises:
        TypeError: not a string.
        ValueError: another name.
    """
    if op is MPI.SUM:
        return "sum"
    if not isinstance(op, str):
        raise TypeError(f"op must be 'sum' or 'average', not {type(op).__name__}")
    if op not in OPS:
        raise ValueError(f"unknown op={op!r}; the compressed {collective} supports "
                         f"'sum' and 'average'")
    return op


def segment_size(segment_bytes: Any) -> int:
    """``segment_bytes`` checked (``None``: :data:`DEFAULT_SEGMENT_BYTES`).

    Raises:
        TypeError: not an int.
        ValueError: not positive.
    """
    if segment_bytes is None:
        return DEFAULT_SEGMENT_BYTES
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, (int, np.integer)):
        raise TypeError(f"segment_bytes must be an int, not {type(segment_bytes).__name__}")
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
    return int(segment_bytes)


def array_view(a: Any, argname: str, writable: bool = False) -> Any:
    """The flat view of buffer ``a`` in its array module (``buffers.flat_view``): numpy,
    CuPy, or a registered module (:mod:`.namespace`); other device objects
    (``__cuda_array_interface__``, CUDA DLPack) become zero-copy CuPy views (synchronised
    with their producer stream).

    Raises:
        TypeError: not an array.
        ValueError: not contiguous, or read-only when ``writable``.
    """
    if not isinstance(a, np.ndarray) and not buffers.is_array(a) and device_arrays.is_device(a):
        a = namespace.as_module_array(a, namespace.array_module(a))
    return buffers.flat_view(a, argname, writable=writable)


def check_side(out: Any, x: Any) -> None:
    """Raise ``TypeError`` unless ``recvbuf`` view ``out`` is on ``x``'s side (the host, or
    the same device module): the compressed collectives' ``check_pair`` for
    :mod:`mpicoll.validation`, which checks the rest (dtype, size, overlap)."""
    if namespace.array_module(out) is not namespace.array_module(x):
        raise TypeError(f"recvbuf is {side(out)} but sendbuf is {side(x)}; pass both on "
                        f"the same side")


def feedback_store(codec: Codec, feedback: Any, key: Hashable, owner: Any, x: np.ndarray,
                   default: bool | None = None) -> tuple[ErrorFeedback | None, Hashable]:
    """Where this call's residual lives: ``(store, key)``, or ``(None, None)`` when off.

    Args:
        feedback: ``None`` (``default``: whether the codec is lossy when ``default`` is
            ``None``), a bool, or an :class:`ErrorFeedback` (on, under ``key``).
        owner: the array object whose residual the default store keeps.
        default: what ``feedback=None`` means (``None``: on for lossy codecs).
    Raises:
        TypeError: ``feedback`` is not ``None``, a bool or an ErrorFeedback.
        ValueError: the residual stored under the key does not match ``x`` (checked here,
            before any message, so the error cannot strand the other ranks).
    """
    if not (feedback is None or isinstance(feedback, (bool, ErrorFeedback))):
        raise TypeError(f"feedback must be None, True, False or an ErrorFeedback, "
                        f"not {type(feedback).__name__}")
    if feedback is None:
        feedback = codec.lossy if default is None else default
    if isinstance(feedback, ErrorFeedback):
        store, fb_key = feedback, key
    elif feedback:
        store = tensor_feedback()
        fb_key = store.key_for(owner)
    else:
        return None, None
    store.check(fb_key, x)
    return store, fb_key


def agreed(ctx: CommContext, check: bool, collective: str,
           validate: Callable[[], tuple[Any, dict]]) -> Any:
    """Run ``validate()`` (returns ``(arguments, agreement fields)``) and, with ``check``,
    the agreement step; return the arguments.

    Raises:
        TypeError, ValueError: this rank's own argument error (with or without ``check``).
        mpicoll.RemoteError, mpicoll.MismatchError: with ``check``, another rank's bad
            arguments, or ranks that disagree on the fields.
    """
    try:
        args, fields = validate()
    except (TypeError, ValueError) as exc:
        if not check:
            raise
        agree(ctx, exc, collective=collective)  # raises on every rank
        raise  # (not reached)
    if check:
        agree(ctx, None, collective=collective, **fields)
    return args


def compensated(store: ErrorFeedback | None, fb_key: Hashable, x: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """``(y, res)``: the vector to compress and the residual to fill (``None`` when error
    feedback is off, then ``y`` is ``x``).

    With feedback, ``y = x + old residual`` is computed in the residual's own storage: the
    schedules read each element of ``y`` before they overwrite it with the new residual,
    so no extra vector is needed.
    """
    if store is None:
        return x, None
    res = store.buffer(fb_key, x)
    namespace.array_module(x).add(res, x, out=res)
    return res, res
