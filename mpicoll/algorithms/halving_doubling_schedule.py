"""Recursive halving / doubling schedules over a :class:`~mpicoll.partition.Fold`.

Non-power-of-two groups are folded first (MPICH's and Open MPI's scheme): the first
``2 * rem`` ranks pair up, the even one hands its data to the odd one and waits for the
result at the end. The ``p`` remaining participants run the power-of-two schedule on
*groups*: participant ``j`` is responsible for elements ``gb[j]:gb[j + 1]``.

Every combine puts the lower participant's operand first, so each result is computed in
the same order wherever it is computed.
"""
from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from .. import waiting
from ..buffers import msg
from ..partition import Fold

__all__ = ["fold_in", "fold_out", "halving_reduce_scatter", "doubling_allgather",
           "doubling_allreduce"]

TAG_FOLD = 21
TAG_HALVE = 22
TAG_DOUBLE = 23


def fold_in(p2p: MPI.Comm, fold: Fold, src: Any, acc: Any, scratch: Any, op: Any) -> Any:
    """Fold step before the power-of-two schedule.

    An even folded rank sends ``src``; its odd partner receives into ``scratch`` and stores
    ``partner (op) src`` into ``acc``. Returns the array holding this rank's current data
    (``acc`` on an odd folded rank, ``src`` otherwise).
    """
    if not fold.folded:
        return src
    if fold.newrank < 0:
        waiting.send(p2p, msg(src), fold.partner, TAG_FOLD)
        return src
    tmp = scratch[:src.size]
    waiting.recv(p2p, msg(tmp), fold.partner, TAG_FOLD)
    op.combine(tmp, src, acc)
    return acc


def fold_out(p2p: MPI.Comm, fold: Fold, buf: Any) -> None:
    """Fold step after the schedule: the odd rank sends ``buf`` back to its even partner."""
    if not fold.folded:
        return
    if fold.newrank < 0:
        waiting.recv(p2p, msg(buf), fold.partner, TAG_FOLD)
    else:
        waiting.send(p2p, msg(buf), fold.partner, TAG_FOLD)


def halving_reduce_scatter(p2p: MPI.Comm, fold: Fold, cur: Any, dst: Any,
                           gb: Sequence[int], scratch: Any, op: Any) -> Any:
    """Recursive halving among participants: ``dst[gb[me]:gb[me + 1]]`` ends reduced.

    Args:
        cur: this participant's data (its contribution, or ``dst`` after a fold).
        dst: full-length array for partial results.
        gb: ``p + 1`` group offsets.
        scratch: receive buffer at least half the vector long.
    Returns:
        The array that now holds this participant's data (``dst``, or ``cur`` if p == 1).
    """
    me = fold.newrank
    lo, hi = 0, fold.p
    mask = fold.p >> 1
    while mask:
        partner = me ^ mask
        mid = (lo + hi) // 2
        (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
        a, b = gb[klo], gb[khi]
        tmp = scratch[:b - a]
        peer = fold.real(partner)
        waiting.sendrecv(p2p, msg(cur[gb[glo]:gb[ghi]]), peer, TAG_HALVE, msg(tmp), peer, TAG_HALVE)
        if me < partner:
            op.combine(cur[a:b], tmp, dst[a:b])
        else:
            op.combine(tmp, cur[a:b], dst[a:b])
        cur = dst
        lo, hi = klo, khi
        mask >>= 1
    return cur


def doubling_allgather(p2p: MPI.Comm, fold: Fold, buf: Any, gb: Sequence[int]) -> None:
    """Recursive doubling all-gather among participants, in place in ``buf``.

    On entry participant ``me`` holds ``buf[gb[me]:gb[me + 1]]``; on return all groups.
    """
    me = fold.newrank
    mask = 1
    while mask < fold.p:
        partner = me ^ mask
        mine = me & ~(mask - 1)
        theirs = partner & ~(mask - 1)
        peer = fold.real(partner)
        waiting.sendrecv(p2p, msg(buf[gb[mine]:gb[mine + mask]]), peer, TAG_DOUBLE,
                         msg(buf[gb[theirs]:gb[theirs + mask]]), peer, TAG_DOUBLE)
        mask <<= 1


def doubling_allreduce(p2p: MPI.Comm, fold: Fold, cur: Any, dst: Any, scratch: Any,
                       op: Any) -> Any:
    """Recursive doubling with whole-vector exchanges among participants.

    Returns the array holding the result (``dst``, or ``cur`` if p == 1).
    """
    me = fold.newrank
    mask = 1
    while mask < fold.p:
        partner = me ^ mask
        peer = fold.real(partner)
        waiting.sendrecv(p2p, msg(cur), peer, TAG_DOUBLE, msg(scratch), peer, TAG_DOUBLE)
        if me < partner:
            op.combine(cur, scratch, dst)
        else:
            op.combine(scratch, cur, dst)
        cur = dst
        mask <<= 1
    return cur
