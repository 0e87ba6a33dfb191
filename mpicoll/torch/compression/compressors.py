"""Gradient compression: Horovod's two-method compressors and mpicoll's codecs.

Horovod's interface: ``compress(tensor) -> (tensor, ctx)`` runs before the all-reduce,
``decompress(tensor, ctx) -> tensor`` after it; the compressed tensors are summed as they
are. ``Compression.none`` and ``Compression.fp16`` (float16 on the wire, cast back after)
work that way, and so does any user-defined :class:`Compressor`.

``Compression.bf16``, ``.int8``, ``.onebit``, ``.topk(ratio)``, ``.randomk(ratio)`` and
``.auto`` (a codec chosen per reduction: :mod:`mpicoll.compression.auto`) are
:class:`CodecCompressor` objects wrapping an :mod:`mpicoll.compression` codec: their
payloads (scales and int8 values, packed sign bits, index/value pairs) cannot be summed as
they are, so ``DistributedOptimizer`` reduces them with
:func:`mpicoll.compression.allreduce` (dense codecs: a ring that decodes, adds and
re-encodes; sparse codecs: an all-gather of the pairs), with error feedback per parameter
kept by the optimizer (:mod:`mpicoll.torch.compression.gradients`), and so do ``hvd.allreduce`` and
``hvd.grouped_allreduce`` (:mod:`mpicoll.torch.compression.allreduce`; error feedback only with
a caller-held ``feedback=``). Their ``compress``/``decompress`` raise ``TypeError``: the
other collectives (``hvd.reducescatter`` ...) do not take them.

Every compressor has a ``codec`` attribute: the :class:`mpicoll.compression.Codec` it
stands for (``None`` for ``Compression.none`` and user-defined compressors), so other
back ends (the parameter server) can map compressors to codecs.
"""
from __future__ import annotations

from typing import Any

import torch

from ...compression import Codec, RandomKCodec, TopKCodec, get_codec
from ...compression.auto import codec_from_spec

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "CodecCompressor",
           "Compression", "codec_of"]


class Compressor:
    """Interface: a pair of static methods.

    Attributes:
        codec: the :class:`mpicoll.compression.Codec` this compressor stands for, or
            ``None`` (user-defined compressors need not set it).
    """

    codec: Codec | None = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the received tensor in its original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating tensors as float16; other dtypes unchanged (summed as float16)."""

    codec = get_codec("fp16")

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype is not torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is not None and tensor.dtype is not ctx:
            return tensor.to(ctx)
        return tensor


#: torch dtypes the codecs encode (mpicoll.compression takes float32 and float64).
CODEC_DTYPES = (torch.float32, torch.float64)


class CodecCompressor(Compressor):
    """A compressor made of an :mod:`mpicoll.compression` codec, with error feedback.

    ``DistributedOptimizer`` reduces each fused gradient buffer with
    :func:`mpicoll.compression.allreduce` and keeps one residual per parameter
    (``optimizer.error_feedback``); ``hvd.allreduce`` and ``hvd.grouped_allreduce`` reduce
    each tensor so, with error feedback only in a caller-held ``feedback=`` object.

    Args:
        codec: a codec or a codec name (``"int8"``, ``"int8:512:stochastic"``,
            ``"onebit"``, ``"topk:0.01"``...; see :func:`mpicoll.compression.get_codec`),
            or ``"auto"`` / :class:`mpicoll.compression.Auto`: each reduction uses the
            candidate codec a time model predicts fastest for its size, the same on every
            rank (docs/compression.md, *Automatic choice*).
        feedback: keep what compression dropped and add it to the next step's gradient
            (default: on for lossy codecs, which is every codec but ``none``).
        momentum: (``DistributedOptimizer`` only) ``0.0`` (default): each rank compresses
            its gradient. ``beta`` in
            (0, 1): each rank compresses its *local momentum* ``m = beta m + g`` (error
            feedback then keeps what compression dropped of ``m``), the ranks' momenta are
            reduced to ``M``, and the optimizer receives ``M - beta M_prev`` (``M_prev``:
            the previous step's reduced momentum), which an ``SGD(momentum=beta)`` turns
            back into ``M``. Uncompressed this is exactly the reduced gradient, for any
            optimizer; compressed, the error no longer passes through the optimizer's
            momentum (which amplifies it ``1 / (1 - beta)`` times). Set it to the wrapped
            SGD's momentum for ``onebit`` (see docs/compression.md, *Training with
            compression*).
        warmup: (``DistributedOptimizer`` only) the number of optimizer steps (reductions:
            ``step()``/``synchronize()`` calls, not backward passes) that run uncompressed
            before compression starts, as 1-bit Adam's warm-up stage (default 0). Those
            steps reduce the flat gradient buffers through the engine's all-reduce exactly
            as ``Compression.none`` does (the same bits); with ``momentum`` the local and
            the reduced momentum are kept through them, so the first compressed step
            continues the same momentum. Error feedback starts at the first compressed
            step. The step count is part of ``compression_state_dict()``.
    Raises:
        ValueError: unknown codec name, ratio outside (0, 1], momentum outside [0, 1),
            a negative warm-up.
        TypeError: ``codec`` neither a name nor a codec, ``feedback`` not a bool,
            ``momentum`` not a number, ``warmup`` not an int.
    """

    def __init__(self, codec: Codec | str, feedback: bool | None = None,
                 momentum: float = 0.0, warmup: int = 0) -> None:
        self.codec = codec_from_spec(codec, "compression")
        if feedback is not None and not isinstance(feedback, bool):
            raise TypeError(f"feedback must be True, False or None, not "
                            f"{type(feedback).__name__}")
        self.feedback = self.codec.lossy if feedback is None else feedback
        self.momentum = _check_momentum(momentum)
        self.warmup = _check_warmup(warmup)

    def with_momentum(self, momentum: float) -> CodecCompressor:
        """A compressor of the same codec, feedback and warm-up that compresses the ranks'
        local momentum ``m = momentum m + g`` (see the class's ``momentum`` argument)."""
        return CodecCompressor(self.codec, self.feedback, momentum, self.warmup)

    def with_warmup(self, steps: int) -> CodecCompressor:
        """A compressor of the same codec, feedback and momentum whose first ``steps``
        optimizer steps run uncompressed (see the class's ``warmup`` argument)."""
        return CodecCompressor(self.codec, self.feedback, self.momentum, steps)

    def optimizer_only(self) -> list[str]:
        """The options only ``DistributedOptimizer`` honours (it keeps the state they
        need): ``"momentum 0.9"``, ``"warm-up of 23 steps"``; empty for none. Other users of
        the compressor (``hvd.allreduce``, the parameter server) refuse a compressor that
        has any."""
        return ([f"momentum {self.momentum:g}"] if self.momentum else []) + \
            ([f"warm-up of {self.warmup} steps"] if self.warmup else [])

    @property
    def name(self) -> str:
        """The codec's name (``"int8"``, ``"topk:0.01"``...)."""
        return self.codec.name

    def check_dtype(self, dtype: torch.dtype, what: str) -> None:
        """Raise ``TypeError`` (naming ``what``) unless the codec encodes ``dtype``."""
        if dtype not in CODEC_DTYPES:
            raise TypeError(f"{what} has dtype {dtype}; compression={self.name!r} needs "
                            f"float32 or float64 tensors (use Compression.none or "
                            f"Compression.fp16 for other dtypes)")

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Refused: payloads of this codec cannot be summed as tensors.

        Raises:
            TypeError: always (use it with ``DistributedOptimizer``, ``hvd.allreduce``,
                ``hvd.grouped_allreduce``, or :func:`mpicoll.compression.allreduce` on
                numpy arrays).
        """
        raise self._not_summable()

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Refused, as :meth:`compress`."""
        raise self._not_summable()

    def _not_summable(self) -> TypeError:
        return TypeError(f"Compression {self.name!r} cannot be summed in compressed form, "
                         f"so it works only with DistributedOptimizer(compression=...), "
                         f"hvd.allreduce and hvd.grouped_allreduce (or "
                         f"mpicoll.compression.allreduce on numpy arrays); the other "
                         f"collectives take Compression.none, Compression.fp16 or a "
                         f"compress/decompress compressor")

    def __repr__(self) -> str:
        return (f"<Compression {self.name}{'' if self.feedback else ' (no error feedback)'}"
                f"{''.join(', ' + option for option in self.optimizer_only())}>")


def _check_momentum(momentum: Any) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum must be a number in [0, 1), not {type(momentum).__name__}")
    beta = float(momentum)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return beta


def _check_warmup(warmup: Any) -> int:
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup must be an int (optimizer steps), not "
                        f"{type(warmup).__name__}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0 optimizer steps, got {warmup}")
    return warmup


class Compression:
    """The available compressors.

    ``none`` and ``fp16`` are Horovod's; ``bf16``, ``int8`` (one float32 scale per chunk of
    256), ``onebit`` (signs and one scale per chunk) and the constructors ``topk(ratio)``,
    ``randomk(ratio, seed=0)`` and ``from_codec(spec)`` give :class:`CodecCompressor`
    objects for ``DistributedOptimizer``, with error feedback on by default;
    ``Compression.onebit.with_momentum(0.9)`` (and ``momentum=`` on the constructors)
    compresses the ranks' local momentum instead of their gradients;
    ``.with_warmup(steps)`` (and ``warmup=`` on the constructors) runs the first ``steps``
    optimizer steps uncompressed. ``auto`` (and ``from_codec("auto:none,int8")``,
    ``from_codec(mpicoll.compression.Auto(...))``) picks a codec per reduction where a time
    model predicts it pays.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = CodecCompressor("bf16")
    int8 = CodecCompressor("int8")
    onebit = CodecCompressor("onebit")
    #: ``compression="auto"``: per fused run, the codec among ``none``, ``bf16``,
    #: ``int8`` and ``topk:0.01`` the time model predicts fastest (error feedback on).
    auto = CodecCompressor("auto")

    @staticmethod
    def topk(ratio: float, feedback: bool = True, momentum: float = 0.0,
             warmup: int = 0) -> CodecCompressor:
        """The ``ceil(ratio * count)`` largest-magnitude elements of each fused buffer.

        Raises:
            ValueError: ``ratio`` outside (0, 1]. TypeError: not a number.
        """
        return CodecCompressor(TopKCodec(ratio), feedback, momentum, warmup)

    @staticmethod
    def randomk(ratio: float, seed: int = 0, feedback: bool = True,
                momentum: float = 0.0, warmup: int = 0) -> CodecCompressor:
        """``ceil(ratio * count)`` elements chosen at random (the same on every rank that
        uses the same ``seed``: see :class:`mpicoll.compression.RandomKCodec`).

        Raises:
            ValueError: ``ratio`` outside (0, 1]. TypeError: not a number.
        """
        return CodecCompressor(RandomKCodec(ratio, seed), feedback, momentum, warmup)

    @staticmethod
    def from_codec(spec: Codec | str, feedback: bool | None = None,
                   momentum: float = 0.0, warmup: int = 0) -> CodecCompressor:
        """Any codec by name (``"int8:512:stochastic"``, ``"onebit:1024"``...) or object."""
        return CodecCompressor(spec, feedback, momentum, warmup)


def codec_of(compression: Any) -> Codec | None:
    """The codec ``compression`` stands for (``None``: a Horovod-style compressor without
    one, such as ``Compression.none`` or a user-defined class)."""
    codec = getattr(compression, "codec", None)
    return codec if isinstance(codec, Codec) else None
