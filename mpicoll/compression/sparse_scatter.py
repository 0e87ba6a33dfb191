"""The compressed reduce-scatter for sparse codecs: each rank sends each other rank only
(index, value) pairs of that rank's block.

Rank ``q`` encodes every block ``b != q`` of its compensated input on its own (``k_b =
ceil(ratio * len(block b))`` pairs, a size every rank knows, so no counts are exchanged)
and sends the payload straight to rank ``b`` (tag :data:`TAG_SPARSE_RS`); it encodes an
empty vector in place of its own block, so a stateful codec (random-k's step) encodes block
``b`` at the same step on every rank: with a shared seed every rank picks the same indices
of a block. The owner adds the pairs into zeros in rank order, its own block's values
exact at its own turn (as the dense ring keeps its own contribution exact). Its residual:
for every other block what its encoding dropped, zero on its own block.

Why not the dense schedule: a ring that decodes, adds and re-encodes would re-select
``k`` pairs from a partial sum at every hop; why not the sparse all-reduce's all-gather:
every rank would receive every rank's pairs of every block, ``n`` times what it needs.
"""
from __future__ import annotations

from typing import Any, Container

import numpy as np
from mpi4py import MPI

from .. import buffers, waiting
from ..partition import block_bounds
from .codecs import Codec, layout_nbytes, payload_views
from . import namespace
from .ring import Sent, add_pairs, encode_to_host, keep_residual

__all__ = ["sparse_reduce_scatter", "TAG_SPARSE_RS"]

TAG_SPARSE_RS = 105  #: (index, value) pairs of one block, sent to its owner


def sparse_reduce_scatter(ctx: Any, codec: Codec, y: np.ndarray, res: np.ndarray | None,
                          out: np.ndarray, peers: Container[int]) -> tuple[Sent, Sent]:
    """This rank's block of the sum of every rank's ``y`` into ``out`` (which must not
    share memory with ``y``); ``res``: this rank's new residual, or ``None``.

    Args:
        peers: the ranks on this rank's node (to split the bytes sent).
    Returns:
        ``(intra-node, inter-node)``: what this rank sent (``dense``: an uncompressed ring
        reduce-scatter, every block but this rank's).
    """
    n, rank = ctx.size, ctx.rank
    bb = block_bounds(y.size, n)
    layouts = [codec.layout(bb[b + 1] - bb[b], y.dtype) for b in range(n)]
    nbytes = [layout_nbytes(lay) for lay in layouts]
    mine = nbytes[rank]
    # one area: the payloads this rank sends (block b at its offset), then those it receives
    offs = np.cumsum([0] + [nbytes[b] if b != rank else 0 for b in range(n)])
    area = np.empty(int(offs[-1]) + (n - 1) * mine, dtype=np.uint8)

    def inbox(q: int) -> np.ndarray:
        o = int(offs[-1]) + (q - (q > rank)) * mine
        return area[o:o + mine]

    rreqs = {q: ctx.p2p.Irecv(buffers.msg(inbox(q)), q, TAG_SPARSE_RS)
             for q in range(n) if q != rank}
    sreqs: list[MPI.Request] = []
    sent = {True: [0, 0], False: [0, 0]}  # on this node?: [bytes, messages]
    for b in range(n):
        lo, hi = bb[b], bb[b + 1]
        if b == rank:
            codec.encode(y[:0])  # keep the codec's step in line with the other ranks
            continue
        region = area[offs[b]:offs[b + 1]]
        payload = encode_to_host(codec, y[lo:hi], layouts[b], region)
        sreqs.append(ctx.p2p.Isend(buffers.msg(region), b, TAG_SPARSE_RS))
        tally = sent[b in peers]
        tally[0] += region.size
        tally[1] += 1
        keep_residual(codec, payload, y[lo:hi], res, lo)
    lo, hi = bb[rank], bb[rank + 1]
    out.fill(0)
    for q in range(n):
        if q == rank:
            namespace.array_module(y).add(out, y[lo:hi], out=out)
            continue
        waiting.wait(rreqs[q])
        add_pairs(codec, payload_views(layouts[rank], inbox(q)), out)
    if res is not None:
        res[lo:hi] = 0
    waiting.waitall(sreqs)
    dense = (y.size - (hi - lo)) * y.dtype.itemsize  # (counted with the inter-node part)
    return Sent(*sent[True], 0), Sent(*sent[False], dense)
