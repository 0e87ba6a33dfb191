"""Reductions as objects.

An :class:`Op` combines two chunks elementwise into a third (``out = a (op) b``; ``out`` may
be ``a`` or ``b``), through the array module of the arrays it is given (numpy here, CuPy
for device arrays), so algorithms never call numpy directly. ``average`` is ``sum`` during
the collective and one scaling at the end (:meth:`Op.finalize`).

:meth:`Op.combine` is the one local reduction step every algorithm calls, so any object
with that method can be passed as ``op`` (for example one that decodes a compressed
payload) without touching any algorithm.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from . import buffers

__all__ = ["Op", "OPS", "resolve_op", "scaled_sum", "SUM", "PROD", "MIN", "MAX", "AVERAGE",
           "BAND", "BOR", "BXOR"]

_KIND_NAMES = {"b": "bool", "i": "signed integer", "u": "unsigned integer",
               "f": "floating", "c": "complex"}


@dataclass(frozen=True, eq=False)
class Op:
    """One reduction operation.

    Attributes:
        name: the canonical name (``"sum"``, ``"average"``, ...).
        ufunc: name of the array-module ufunc that combines two chunks.
        kinds: numpy dtype kinds the op applies to (``"iufc"`` ...).
        mpi_op: the predefined MPI op with the same meaning during the collective.
        averages: whether the result is divided by the number of ranks at the end.
    """

    name: str
    ufunc: str
    kinds: str
    mpi_op: MPI.Op
    averages: bool = False

    def check_dtype(self, dtype: Any, argname: str = "op") -> None:
        """Raise ``TypeError`` if this op does not apply to ``dtype``."""
        kind = getattr(dtype, "kind", None)
        if kind not in self.kinds:
            allowed = ", ".join(_KIND_NAMES[k] for k in self.kinds)
            raise TypeError(f"{argname}={self.name!r} does not apply to dtype {dtype} "
                            f"(it applies to {allowed} types)")

    def combine(self, a: Any, b: Any, out: Any) -> None:
        """Store ``a (op) b`` elementwise into ``out`` (which may alias ``a`` or ``b``)."""
        getattr(buffers.array_module(out), self.ufunc)(a, b, out=out)

    def finalize(self, result: Any, nranks: int) -> None:
        """Apply the end-of-collective step in place (division by ``nranks`` for average).

        Integer averages use floor division; floating and complex ones true division.
        """
        if not self.averages or nranks == 1:
            return
        xp = buffers.array_module(result)
        if result.dtype.kind in "iu":
            xp.floor_divide(result, nranks, out=result)
        else:
            xp.true_divide(result, result.dtype.type(nranks), out=result)


@dataclass(frozen=True, eq=False)
class _ScaledSum(Op):
    """A sum whose result is multiplied by ``factor`` (:func:`scaled_sum`)."""

    factor: float = 1.0

    def finalize(self, result: Any, nranks: int) -> None:
        """Multiply ``result`` by ``factor`` in place, in its own dtype (once per element:
        the algorithms that scale shards call it on this rank's shard only)."""
        xp = buffers.array_module(result)
        xp.multiply(result, result.dtype.type(self.factor), out=result)


@functools.lru_cache(maxsize=64)
def scaled_sum(factor: float) -> Op:
    """A floating-point sum multiplied by ``factor`` at the end, on each rank's shard.

    Horovod's ``Average`` (``factor = postscale / size``) and ``postscale_factor`` as one
    op: the algorithms that apply ``finalize`` per shard (ring, Rabenseifner,
    hierarchical, shm) scale 1/n of the buffer on each rank instead of a pass over all
    of it afterwards. ``x * factor`` in the buffer's dtype (not ``x / size``: the
    rounding Horovod's scaling gives). Applied only when the communicator has more than
    one rank. The same object for the same factor, so calls with it are cached.
    """
    return _ScaledSum("scaled_sum", "add", "fc", MPI.SUM, averages=True, factor=float(factor))


@dataclass(frozen=True, eq=False)
class _Product(Op):
    """``prod``: numpy's multiply of one complex element gives other bits when ``out`` is
    one of its operands (numpy 2.4, in about half the cases), so that product goes through
    a temporary: every rank gets the bits of the loop longer vectors use, whichever of
    its buffers the algorithm reduces into."""

    def combine(self, a: Any, b: Any, out: Any) -> None:  # noqa: D102 (Op's)
        if out.size == 1 and out.dtype.kind == "c":
            out[...] = buffers.array_module(out).multiply(a, b)
        else:
            super().combine(a, b, out)


SUM = Op("sum", "add", "iufc", MPI.SUM)
PROD = _Product("prod", "multiply", "iufc", MPI.PROD)
MIN = Op("min", "minimum", "iuf", MPI.MIN)
MAX = Op("max", "maximum", "iuf", MPI.MAX)
AVERAGE = Op("average", "add", "iufc", MPI.SUM, averages=True)
BAND = Op("band", "bitwise_and", "iub", MPI.BAND)
BOR = Op("bor", "bitwise_or", "iub", MPI.BOR)
BXOR = Op("bxor", "bitwise_xor", "iub", MPI.BXOR)

#: Every op by canonical name.
OPS: dict[str, Op] = {op.name: op for op in (SUM, PROD, MIN, MAX, AVERAGE, BAND, BOR, BXOR)}
_ALIASES = {"mean": "average", "avg": "average", "product": "prod", "minimum": "min",
            "maximum": "max"}


def resolve_op(op: Any, argname: str = "op") -> Op:
    """Return the :class:`Op` for a name, an mpi4py predefined op, or an :class:`Op`.

    Raises:
        ValueError: unknown name, or an MPI op mpicoll does not implement (user-defined
            ops, MINLOC/MAXLOC, logical ops, ...).
        TypeError: anything else.
    """
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        key = op.strip().lower()
        key = _ALIASES.get(key, key)
        if key in OPS:
            return OPS[key]
        raise ValueError(f"unknown {argname}={op!r}; choose one of {sorted(OPS)}")
    if isinstance(op, MPI.Op):
        for ours in OPS.values():  # (SUM before AVERAGE, whose MPI op is MPI.SUM too)
            if op == ours.mpi_op:
                return ours
        raise ValueError(f"{argname}: this MPI op is not one mpicoll implements "
                         f"(supported: SUM, PROD, MIN, MAX, BAND, BOR, BXOR)")
    raise TypeError(f"{argname} must be a name such as 'sum', an mpi4py op such as MPI.SUM, "
                    f"or an mpicoll.Op, not {type(op).__name__}")
