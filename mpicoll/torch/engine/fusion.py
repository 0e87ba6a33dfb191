"""Fusion: group completed all-reduce requests into buckets that reduce as one message.

Requests fuse when they reduce in the same dtype (bfloat16 reduces as float32) with the
same op and scaling factors; a bucket holds at most ``threshold`` bytes (a single larger
tensor gets a bucket of its own). The input order (the negotiated order) is kept inside
each bucket, and buckets come in the order their first request appeared, so every rank
builds the same buckets.
"""
from __future__ import annotations

from math import prod
from typing import Sequence

from .dtypes import from_name, reduce_dtype
from .negotiation import Meta, Response

__all__ = ["numel", "plan_buckets", "fusion_key", "plan_runs"]


def numel(meta: Meta) -> int:
    """Number of elements of the tensor ``meta`` describes."""
    return int(prod(meta.shape))


def fusion_key(meta: Meta) -> tuple:
    """Requests with equal keys may share a bucket."""
    return (reduce_dtype(from_name(meta.dtype)), meta.op, meta.prescale, meta.postscale)


def plan_buckets(responses: Sequence[Response], threshold: int) -> list[list[Response]]:
    """Split all-reduce ``responses`` into buckets of at most ``threshold`` bytes."""
    groups: dict[tuple, list[list[Response]]] = {}
    sizes: dict[tuple, int] = {}
    for response in responses:
        meta = next(iter(response.metas.values()))
        key = fusion_key(meta)
        nbytes = numel(meta) * key[0].itemsize
        buckets = groups.setdefault(key, [[]])
        if buckets[-1] and sizes[key] + nbytes > threshold:
            buckets.append([])
            sizes[key] = 0
        buckets[-1].append(response)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [bucket for buckets in groups.values() for bucket in buckets]


def plan_runs(nbytes: Sequence[int], threshold: int) -> list[range]:
    """Split consecutive tensors of ``nbytes`` bytes each into runs (index ranges) of at
    most ``threshold`` bytes, in order; a larger tensor gets a run of its own and
    ``threshold == 0`` gives one run per tensor (fusion off).

    Used for DistributedOptimizer's flat gradient buffers under a codec compressor: each
    run is one contiguous slice of the buffer, reduced by one compressed all-reduce.
    """
    runs: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(nbytes):
        if i > start and (threshold == 0 or size + n > threshold):
            runs.append(range(start, i))
            start, size = i, 0
        size += n
    if len(nbytes) > start:
        runs.append(range(start, len(nbytes)))
    return runs
