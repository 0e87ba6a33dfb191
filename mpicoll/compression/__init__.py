"""Gradient compression: codecs, error feedback and compressed collectives (all-reduce,
reduce-scatter, all-gather).

>>> import numpy as np
>>> from mpicoll import compression
>>> g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
>>> out = compression.allreduce(g, op="average", compression="int8")   # any world size
>>> compression.last_stats().bytes_sent                               # doctest: +SKIP

Codecs (:mod:`~mpicoll.compression.codecs`): ``none``, ``fp16``, ``bf16``, ``int8``,
``onebit``, ``onebit:two``, ``topk:RATIO``, ``randomk:RATIO`` (:func:`get_codec`), and ``"auto"`` (:class:`Auto`: the codec a time model predicts
fastest, chosen alike on every rank). Error feedback
(:class:`ErrorFeedback`) is on by default for lossy codecs (off by default in the
all-gather, whose typical data are parameters). See docs/compression.md.
"""
from __future__ import annotations

from ..runtime import failures
from .allgather import allgather
from .allreduce import allreduce
from .auto import Auto
from .codecs import (CODECS, BF16Codec, Codec, FP16Codec, Int8Codec, NoneCodec, OneBitCodec,
                     RandomKCodec, TopKCodec, TwoScaleOneBitCodec, get_codec, new_payload)
from .feedback import ErrorFeedback, tensor_feedback
from .int4 import Int4Codec
from .reduce_scatter import reduce_scatter
from .stats import AllreduceStats, CollectiveStats, last_stats

__all__ = ["allreduce", "reduce_scatter", "allgather", "last_stats", "AllreduceStats",
           "CollectiveStats", "get_codec", "new_payload", "Codec",
           "NoneCodec", "FP16Codec", "BF16Codec", "Int8Codec", "OneBitCodec",
           "TwoScaleOneBitCodec", "TopKCodec", "RandomKCodec", "Int4Codec", "CODECS",
           "ErrorFeedback",
           "tensor_feedback", "Auto"]

#: int4 builds on codecs.py's chunked codec, so it is registered here, not in CODECS' literal
CODECS["int4"] = Int4Codec

if failures.ENABLED:  # ULFM on: a process failure raises ProcessFailedError (mpicoll.runtime)
    allreduce = failures.guard(allreduce)
    reduce_scatter = failures.guard(reduce_scatter)
    allgather = failures.guard(allgather)

