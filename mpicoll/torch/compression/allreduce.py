"""``hvd.allreduce`` and ``hvd.grouped_allreduce`` with a codec compressor
(``Compression.int8``, ``.bf16``, ``.onebit``, ``.topk(r)``, ``.randomk(r)``).

Their payloads cannot be summed as tensors, so these calls do not go through the engine's
fused all-reduce: each tensor is reduced by one :func:`mpicoll.compression.allreduce` on
the calling thread, over the communicator of the engine's ranks
(:meth:`~mpicoll.torch.engine.core.Engine.side_comm`), after two agreement steps that make every
failure an error on every rank:

1. :func:`~mpicoll.torch.compression.agreement.check_presence`: one tiny engine all-reduce named like
   the call (``name``, or the next ``allreduce.noname.<n>``), whose layout names the codec,
   the scaling factors and the shapes. Ranks whose calls differ raise ``MismatchError``;
   a rank that called ``hvd.join()`` makes the others raise ``CollectiveError``.
2. :func:`mpicoll.checked.agree` on the communicator: a rank whose arguments were bad
   (a dtype the codec cannot encode, an op other than Average/Sum, a residual that does
   not fit) raises its own ``TypeError``/``ValueError``, the others
   ``mpicoll.RemoteError``; ranks with different counts, dtypes or ops ``MismatchError``.

Scaling: ``prescale_factor`` multiplies the input before compression (so residuals are in
prescaled units); Average divides the sum by the number of ranks (of the process set);
``postscale_factor`` multiplies the result (with Average, sum times ``postscale / n``).

Error feedback has no owner in a plain call, so there is none unless the caller passes an
:class:`mpicoll.compression.ErrorFeedback` (``feedback=``) and keeps it: the residual of the
tensor is kept there under the key ``name`` (member ``i`` of a group: ``(name, i)``).
Compressors made with ``feedback=False`` and the lossless ``none`` codec never keep one.

Gradient: the same compressed all-reduce (codec, op, scaling) of the incoming gradients,
without error feedback, named ``<name>.grad``; as in Horovod, where ``Compression.fp16``
casts are differentiable and its backward all-reduce travels in float16 too.

Calls run one at a time per process (several threads reducing with codecs at once would
mix their messages on the shared communicator).
"""
from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from ... import compression as codecs
from ...compression.arguments import agreed
from ...context import get_context
from .agreement import check_presence
from .compressors import CodecCompressor
from ..engine.dtypes import numpy_view
from ..ops import Average, ReduceOp, Sum, resolve_reduce_op
from ..process_sets import backward_in_scope, forward_in_scope

__all__ = ["codec_allreduce", "CodecAllreduceFn"]


def codec_allreduce(tensors: Sequence[Any], name: str, keys: Sequence[Hashable],
                    compressor: CodecCompressor, average: Any, op: Any, prescale_factor: Any,
                    postscale_factor: Any, feedback: Any) -> tuple:
    """Reduce ``tensors`` with ``compressor``'s codec (differentiable), in the process set
    in scope; return the reduced tensors (new ones, identical on every rank).

    Args:
        tensors: CPU float32/float64 tensors (one, or a group's members).
        name: the request's resolved name (matched across ranks).
        keys: each tensor's residual key in ``feedback``.
        compressor: the codec compressor.
        average, op: as for :func:`~mpicoll.torch.allreduce` (Average or Sum).
        prescale_factor, postscale_factor: scaling before and after the reduction.
        feedback: ``None``/``False`` (no error feedback) or an
            :class:`mpicoll.compression.ErrorFeedback` that keeps the residuals.
    Raises:
        TypeError, ValueError: this rank's bad arguments (after the agreement, so the
            other ranks raise ``mpicoll.RemoteError`` instead of waiting).
        mpicoll.MismatchError: ranks disagree (codec, shapes, dtypes, op, scaling).
        mpicoll.CollectiveError: a rank has joined, or the engine stopped.
    """
    return CodecAllreduceFn.apply(name, compressor, (average, op), prescale_factor,
                                  postscale_factor, feedback, tuple(keys), *tensors)


class CodecAllreduceFn(torch.autograd.Function):
    """Differentiable compressed all-reduce: the gradient is the same compressed all-reduce
    (without error feedback) of the incoming gradients."""

    @staticmethod
    @forward_in_scope
    def forward(ctx: Any, name: str, compressor: CodecCompressor, op: tuple, prescale: Any,
                postscale: Any, feedback: Any, keys: tuple, *tensors: Any) -> tuple:
        outputs, resolved = _reduce(name, compressor, op, prescale, postscale, feedback, keys,
                                    tensors)
        ctx.args = (name, compressor, resolved, prescale, postscale)
        return outputs

    @staticmethod
    @backward_in_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        name, compressor, op, prescale, postscale = ctx.args
        reduced, _ = _reduce(f"{name}.grad", compressor, (None, op), prescale, postscale,
                             None, (None,) * len(grads), [g.contiguous() for g in grads])
        return (None,) * 7 + reduced


def _reduce(name: str, compressor: CodecCompressor, op: tuple, prescale: Any, postscale: Any,
            feedback: Any, keys: tuple, tensors: Sequence[Any]) -> tuple[tuple, ReduceOp]:
    """Check (with every rank), then reduce; return the outputs and the resolved op."""
    codec = compressor.codec
    what = f"allreduce {name!r} (compression={codec.name!r})"
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
              for t in tensors]
    eng = check_presence(name, f"compression={codec.name} prescale={_shown(prescale)} "
                               f"postscale={_shown(postscale)} shapes={shapes}", what)
    comm = eng.side_comm()

    def validate() -> tuple[tuple, dict]:
        resolved = resolve_reduce_op(*op, adasum=True)
        if int(resolved) not in (int(Average), int(Sum)):
            raise ValueError(f"compression={codec.name!r} reduces with op=Average or op=Sum, "
                             f"not {resolved!r}")
        if compressor.optimizer_only():
            raise ValueError(f"{compressor!r}: {' and '.join(compressor.optimizer_only())} "
                             f"need state that only DistributedOptimizer keeps (the local "
                             f"momentum, the step count); use the compressor without them "
                             f"here")
        pre, post = _factor(prescale, "prescale_factor"), _factor(postscale, "postscale_factor")
        store = _store(feedback, compressor)
        arrays = [_input(t, f"tensor {i}" if len(tensors) > 1 else "tensor", compressor,
                         store, k) for i, (t, k) in enumerate(zip(tensors, keys, strict=True))]
        average = int(resolved) == int(Average)
        opname = "average" if average and post == 1.0 else "sum"
        return ((resolved, pre, post, store, arrays, average, opname),
                {"count": sum(a.size for a in arrays), "op": opname, "algorithm": codec.name,
                 "dtype": ",".join(str(a.dtype) for a in arrays)})

    resolved, pre, post, store, arrays, average, opname = agreed(get_context(comm), True,
                                                                 what, validate)
    if average and opname == "sum":
        post = post / comm.Get_size()            # Average with a postscale: one multiply
    outputs = []
    for tensor, x, key in zip(tensors, arrays, keys, strict=True):
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        result = numpy_view(out)
        if pre != 1.0:
            x = np.multiply(x, pre, dtype=x.dtype)
        codecs.allreduce(x, result, op=opname, comm=comm, compression=codec,
                         feedback=False if store is None else store, key=key, check=False)
        if post != 1.0:
            np.multiply(result, post, out=result)
        outputs.append(out)
    return tuple(outputs), resolved


def _factor(value: Any, argname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argname} must be a number, not {type(value).__name__}")
    return float(value)


def _shown(value: Any) -> str:
    """A scaling factor as the layout shows it (``1`` and ``1.0`` alike)."""
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return repr(value)


def _store(feedback: Any, compressor: CodecCompressor) -> codecs.ErrorFeedback | None:
    """The residual store of this call (``None``: no error feedback)."""
    if feedback is None or feedback is False:
        return None
    if not isinstance(feedback, codecs.ErrorFeedback):
        raise TypeError(f"feedback must be None or an mpicoll.compression.ErrorFeedback "
                        f"(kept by the caller across calls), not {type(feedback).__name__}")
    return feedback if compressor.feedback else None


def _input(tensor: Any, what: str, compressor: CodecCompressor,
           store: codecs.ErrorFeedback | None, key: Hashable) -> np.ndarray:
    """``tensor``'s values as a flat numpy array (read, never written), checked."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    compressor.check_dtype(tensor.dtype, what)
    if tensor.layout is not torch.strided or tensor.device.type != "cpu":
        raise TypeError(f"{what} is a {tensor.layout} tensor on {tensor.device}; "
                        f"compression={compressor.name!r} reduces dense CPU tensors")
    x = numpy_view(tensor.detach().contiguous())
    if store is not None:
        store.check(key, x)
    return x
