"""The co-located layout: every rank is a worker *and* the server of its own shards.

With ``ParameterServer(..., num_servers="colocated")`` there are no server processes. The
placement is the usual one with as many servers as ranks (small tensors whole on rank
``crc32(name) % size``, large ones split in ``size`` contiguous ranges), and rank ``r``
keeps the value and optimizer state of the shards placed on "server" ``r``. A shard's
server part runs inside its owner's own calls, so every operation is **collective** over
the parameter server's communicator (every rank calls ``push_pull`` at the same step, as
with an all-reduce):

1. *control*: a small non-blocking all-gather of ``(op, clock, error)``: every rank learns
   what the others are doing, which ranks have closed, and whether any rank's arguments
   were bad (then every rank raises the same :class:`PSError` and nothing is sent);
2. *push* = reduce-scatter to the owners: each contributing rank ``Isend``\\ s each shard's
   slice of its gradient to the owner; the owner ``Irecv``\\ s into scratch buffers
   allocated once, sums the contributions **node by node, in rank order inside a node**
   (:mod:`mpicoll.ps.node_order`; bit-identical to a single-process reference and to the
   separate-server layout), divides by the number of contributing workers, and applies the server-side optimizer to its shard;
3. *pull* = all-gather of the updated shards: the owner ``Isend``\\ s the shard straight from
   its value array, every other rank receives into the caller's ``out`` arrays (receives are
   posted at the start of ``push_pull``, before the gradients go out, unless ``out`` shares
   memory with the gradients).

Each rank so sends and receives ``2 (n-1)/n`` of the tensor's bytes, like a ring
all-reduce, and all messages of a phase are posted at once. Only **bsp** is supported: the
server part of a rank runs only while that rank is inside a call, so nobody can answer a
pull or apply a push on arrival while its owner computes (asp/ssp need the separate layout).

With ``compression=`` the data step is :meth:`~mpicoll.ps.colocated_coded.CodedExchange._coded_step`
(encoded gradients to the owners, encoded pulls back; see :mod:`mpicoll.ps.colocated_coded`).

Device arrays (:mod:`mpicoll.ps.device`): a rank's gradients are copied to host memory
before the control step, its pulls land in host staging arrays copied into its device
arrays at the end of the step; the shards it owns stay in host memory. A rank that mixes
device and host arrays reports a bad argument in the control step, so every rank raises.

A rank that finishes early calls ``close()``; it then keeps serving its shards (taking part
in the others' operations without contributing gradients) until every rank has closed, so
``close()`` returns only when all ranks have closed. Early finish therefore works as in the
separate layout: a round counts only the ranks that have not closed.
"""
from __future__ import annotations

import os
from typing import Any, Generator, Iterator

import numpy as np
from mpi4py import MPI

from ..compression import Codec
from . import protocol as P
from .protocol import CollOp
from .checkpoint import write_codec_file, write_server_file
from .colocated_coded import CodedExchange
from .errors import PSError
from .node_order import fold_sum, grouped_order, total_weight
from .placement import Placement, Shard
from .server import ShardState
from .stepped import CollectiveGroup

__all__ = ["CollOp", "ColocatedEngine"]

Steps = Generator[list, None, Any]


def _raw(arr: np.ndarray) -> Any:
    """``view(lo, hi)``: the buffer spec of elements ``[lo, hi)`` of flat ``arr`` as bytes."""
    raw, size = arr.view(np.uint8), arr.itemsize
    return lambda lo, hi: [raw[lo * size:hi * size], MPI.BYTE]


_NO_CONTRIBUTION = (CollOp.IDLE, CollOp.CLOSE)


class ColocatedEngine(CodedExchange, CollectiveGroup):
    """The worker and server parts of one rank in the co-located layout.

    Args:
        comm: the parameter server's private communicator (every rank takes part).
        placement: the layout, with ``num_servers == comm.Get_size()``.
        optimizer: server-side optimizer name.
        hyper: hyperparameters (complete).
        average: divide the aggregated gradient by the number of contributing ranks.
        chunk_bytes: largest data message.
        max_sleep: longest pause while a closed rank waits for the next step.
        keep_aggregate: ``False`` (``sum`` only): a push_pull writes each owned shard's
            aggregate straight into the caller's ``out`` and does not keep it.
        codec: compress pushes and pulls with it (``None``: uncompressed).
        feedback: error feedback of the codec (pushes, ``sum`` pulls).
        node_of: each rank's node index: contributions are summed node by node
            (:mod:`mpicoll.ps.node_order`; ``None``: in rank order).
        weights: how many workers each rank's contribution holds (a node leader's under
            local aggregation; ``None``: one each); ``average`` divides by them.
    """

    def __init__(self, comm: MPI.Comm, placement: Placement, optimizer: str,
                 hyper: dict[str, float], average: bool, chunk_bytes: int,
                 max_sleep: float, keep_aggregate: bool = True,
                 codec: Codec | None = None, feedback: bool = True,
                 node_of: list[int] | None = None, weights: list[int] | None = None) -> None:
        self._setup_group(comm)
        self.node_of = node_of
        self.weights = weights
        self._groupings: dict[tuple[int, ...], tuple[list[int], list[int], int]] = {}
        self._tmp: dict[tuple[int, int], np.ndarray] = {}      # ident -> a node's sum
        self.placement = placement
        self.average = average
        self.chunk_bytes = int(chunk_bytes)
        self.max_sleep = max_sleep
        self.keep_aggregate = keep_aggregate
        #: the last push_pull did not keep the aggregates (keep_aggregate=False): every
        #: rank that took part knows it, so pull()/save() refuse identically everywhere
        self.aggregate_dropped = False
        self.ranks = list(range(self.size))
        self.states: dict[tuple[int, int], ShardState] = {
            sh.ident: ShardState(sh, optimizer, hyper, self.ranks)
            for sh in placement.shards_on(self.rank)}
        #: every shard in the order all ranks post their messages
        self.order: list[Shard] = placement.all_shards
        self.active = [True] * self.size
        #: every rank's clock at the last control step (checkpoints record them)
        self.clocks = [0] * self.size
        self.closed = False
        #: block in MPI's Waitall (spins) only when every rank has a core of its own
        self.spin = self.size <= (os.cpu_count() or 1)
        self._scratch: dict[tuple[int, int], np.ndarray] = {}   # (ident, src) -> buffer
        self._acc: dict[tuple[int, int], np.ndarray] = {}       # ident -> aggregate
        self._coded_bufs: dict[tuple[Any, ...], np.ndarray] = {}   # bytes per shard, peer
        self.counters = dict.fromkeys(P.SERVER_COUNTERS, 0)
        self.worker_counters = dict.fromkeys(P.WORKER_COUNTERS, 0)
        self._setup_coders(codec, feedback, pull_deltas=optimizer != "sum", pushes=True)

    def wait(self, reqs: list[MPI.Request], busy: bool = False) -> None:
        """Complete ``reqs``: MPI's Waitall when each rank has a core (and no failure
        watch), else polling that yields the core (large shared-memory messages need both
        sides to drive them)."""
        if self.spin and not self.closed and self.watch is None:
            MPI.Request.Waitall(reqs)
        elif reqs:
            super().wait(reqs, busy=not self.closed)

    # ------------------------------------------------------------------ control step
    def _control(self, op: int, error: str | None) -> Steps:
        """All-gather ``(op, clock, error flag)`` and check the control table; return the
        ranks that contribute to this step (as the generator's value).

        Raises:
            PSError: (on every rank) ranks disagree on the operation or clock, or a rank's
                arguments were bad.
        """
        yield from super()._control(op, error)
        table = self._ctrl_in
        self.clocks = [int(c) for c in table[:, 1]]
        ops = [CollOp(int(o)) for o in table[:, 0]]
        busy = [r for r in self.ranks if ops[r] not in _NO_CONTRIBUTION]
        kinds = {ops[r] for r in busy}
        closing = [r for r in self.ranks if ops[r] == CollOp.CLOSE]
        for r in closing:
            self.active[r] = False
        self.forget_pullers(closing)
        if len(kinds) > 1:
            what = ", ".join(f"rank {r}: {ops[r].name.lower()}" for r in busy)
            raise PSError(f"colocated parameter server: every rank must make the same call "
                          f"at the same step ({what})")
        clocks = {int(table[r, 1]) for r in busy if ops[r] in (CollOp.PUSH, CollOp.PUSH_PULL)}
        if len(clocks) > 1:
            raise PSError(f"colocated parameter server: ranks push at different clocks "
                          f"{sorted(clocks)}")
        bad = [r for r in busy if table[r, 2]]
        if bad:
            self.counters["errors"] += 1
            self._refuse_bad_arguments(f"colocated parameter server: rank(s) {bad}", error,
                                       "ranks")
        return busy

    # ------------------------------------------------------------------ data steps
    def _segments(self, sh: Shard) -> list[tuple[int, int]]:
        """Element ranges ``[lo, hi)`` of a shard, each one message (``chunk_bytes`` at
        most); every rank derives the same ones."""
        step = max(1, self.chunk_bytes // sh.spec.dtype.itemsize)
        return [(lo, min(lo + step, sh.count)) for lo in range(0, sh.count, step)]

    def _scratch_for(self, sh: Shard, src: int) -> np.ndarray:
        return P.scratch(self._scratch, (sh.ident, src), sh.count, sh.spec.dtype)

    def _post_with_owners(self, flat: dict[str, np.ndarray], send: bool) -> list[MPI.Request]:
        """The segments of every shard this rank does not own: sends of this rank's
        gradient ``flat`` to their owners (``send``), or receives of the owners' values
        straight into ``out`` (``flat``)."""
        post, tag, counter = (self.comm.Isend, P.TAG_SCATTER, "bytes_sent") if send else \
            (self.comm.Irecv, P.TAG_GATHER, "bytes_received")
        reqs: list[MPI.Request] = []
        for sh in self.order:
            if sh.server != self.rank and sh.count:
                view = _raw(flat[sh.spec.name][sh.lo:sh.hi])
                reqs += [post(view(lo, hi), sh.server, tag) for lo, hi in self._segments(sh)]
                P.count_bytes(self.worker_counters, counter, sh.nbytes, sh.nbytes)
        return reqs

    def _push_steps(self, grads_flat: dict[str, np.ndarray], contributors: list[int],
                    pullers: list[int], out_flat: dict[str, np.ndarray] | None,
                    into_out: bool = False) -> Iterator[list]:
        """Reduce-scatter the gradients to the owners; there, segment by segment, sum the
        contributions in rank order, apply the optimizer and (when ``pullers``) start
        sending the new values, so segment ``k`` is reduced while ``k + 1`` arrives.

        ``into_out`` (``sum`` with keep_aggregate=False, ``out`` not overlapping the
        gradients): reduce straight into ``out`` and send from there, keeping nothing.
        Yields request lists to wait on; returns the sends (to complete before the step
        ends).
        """
        recvs = self._post_scatter_recvs(contributors)     # receives first, then the sends
        sends = self._post_with_owners(grads_flat, True) if self.rank in contributors else []
        others = [r for r in pullers if r != self.rank]
        for state in self.states.values():
            sh = state.shard
            parts = [grads_flat[sh.spec.name][sh.lo:sh.hi] if src == self.rank
                     else self._scratch_for(sh, src) for src in contributors]
            sends += yield from self._update_shard(state, parts, contributors, others, recvs,
                                                   out_flat, into_out)
            self._count_update(sh, contributors, len(pullers), len(others))
        return sends

    def _post_scatter_recvs(self, contributors: list[int]
                            ) -> dict[tuple[tuple[int, int], int], list[MPI.Request]]:
        """Receives of the other contributors' gradient segments of every owned shard,
        into scratch buffers; keyed by (shard ident, segment index)."""
        recvs: dict[tuple[tuple[int, int], int], list[MPI.Request]] = {}
        for state in self.states.values():
            sh = state.shard
            for src in contributors:
                if src != self.rank and sh.count:
                    view = _raw(self._scratch_for(sh, src))
                    for k, (lo, hi) in enumerate(self._segments(sh)):
                        recvs.setdefault((sh.ident, k), []).append(
                            self.comm.Irecv(view(lo, hi), src, P.TAG_SCATTER))
        return recvs

    def _update_shard(self, state: ShardState, parts: list[np.ndarray],
                      contributors: list[int], others: list[int],
                      recvs: dict[tuple[tuple[int, int], int], list[MPI.Request]],
                      out_flat: dict[str, np.ndarray] | None, into_out: bool
                      ) -> Iterator[list]:
        """One owned shard, segment by segment: wait for its gradients (``parts``, in the
        order of ``contributors``; ``recvs`` fill them), reduce, apply the optimizer, start
        sending the new value to ``others`` and copy it into ``out``.
        Yields request lists to wait on; returns the value sends."""
        sh = state.shard
        adopt = state.opt.name == "sum"
        state.opt.begin_update()
        out = None if out_flat is None else out_flat[sh.spec.name][sh.lo:sh.hi]
        direct = into_out and adopt and out is not None
        acc = out if direct else P.scratch(self._acc, sh.ident, sh.count, sh.spec.dtype)
        value = acc if adopt else state.param
        raw = _raw(value)
        sends: list[MPI.Request] = []
        for k, (lo, hi) in enumerate(self._segments(sh)):
            if recvs.get((sh.ident, k)):
                yield recvs[(sh.ident, k)]
            self._reduce(acc[lo:hi], [p[lo:hi] for p in parts], contributors, sh, lo, hi)
            if not adopt:
                state.opt.apply_part(state.param[lo:hi], acc[lo:hi], lo, hi)
            sends += [self.comm.Isend(raw(lo, hi), dst, P.TAG_GATHER) for dst in others]
            if out is not None and not direct:
                np.copyto(out[lo:hi], value[lo:hi])
        if adopt and not direct:
            # the value becomes the aggregate: swap buffers instead of copying (no send
            # of the old value is in flight: each operation completes before the next)
            state.param, self._acc[sh.ident] = acc, state.param
        state.version += 1
        return sends

    def _count_update(self, sh: Shard, contributors: list[int], pullers: int,
                      others: int) -> None:
        """Server counters of one applied update of an owned shard."""
        received = sh.nbytes * (len(contributors) - (self.rank in contributors))
        self.counters["updates"] += 1
        self.counters["pushes"] += len(contributors)
        P.count_bytes(self.counters, "bytes_in", received, received)
        if others:
            self.counters["pulls"] += pullers
            P.count_bytes(self.counters, "bytes_out", sh.nbytes * others, sh.nbytes * others)

    def _grouping(self, contributors: list[int]) -> tuple[list[int], list[int], int]:
        """(positions of ``contributors`` node by node, parts per node, workers they hold),
        derived once per set of contributors."""
        key = tuple(contributors)
        found = self._groupings.get(key)
        if found is None:
            order, sizes = grouped_order(contributors, self.node_of)
            pos = {r: i for i, r in enumerate(contributors)}
            found = self._groupings[key] = ([pos[r] for r in order], sizes,
                                            total_weight(contributors, self.weights))
        return found

    def _reduce(self, acc: np.ndarray, parts: list[np.ndarray], contributors: list[int],
                sh: Shard, lo: int = 0, hi: int | None = None) -> None:
        """``acc`` = the contributions (``parts``, in the order of ``contributors``) summed
        node by node (:mod:`mpicoll.ps.node_order`), divided by the workers they hold
        (average); ``[lo, hi)``: the segment of shard ``sh`` they are."""
        order, sizes, count = self._grouping(contributors)
        tmp = None
        if any(n > 1 for n in sizes[1:]):
            tmp = P.scratch(self._tmp, sh.ident, sh.count, sh.spec.dtype)[lo:hi]
        fold_sum(acc, [parts[i] for i in order], sizes, tmp)
        if self.average and count > 1:
            np.divide(acc, count, out=acc)

    def _send_shards(self, pullers: list[int], out_flat: dict[str, np.ndarray] | None
                     ) -> list[MPI.Request]:
        """Pull without push: send each owned shard to every other puller and copy it into
        this rank's own ``out`` when pulling."""
        me = self.rank
        sends = []
        for state in self.states.values():
            sh = state.shard
            if out_flat is not None:
                np.copyto(out_flat[sh.spec.name][sh.lo:sh.hi], state.param)
            raw = _raw(state.param)
            for dst in pullers:
                if dst != me and sh.count:
                    sends += [self.comm.Isend(raw(lo, hi), dst, P.TAG_GATHER)
                              for lo, hi in self._segments(sh)]
                    P.count_bytes(self.counters, "bytes_out", sh.nbytes, sh.nbytes)
            self.counters["pulls"] += len(pullers)
        return sends

    # ------------------------------------------------------------------ operations
    def step(self, op: CollOp, grads: dict[str, Any] | None = None,
             out: dict[str, Any] | None = None) -> Steps:
        """One collective push, pull or push_pull (a generator of request lists to wait on).

        Gradients are always checked here (``push(check=False)`` included): once the bytes
        are sent there is no server left to reject them.
        Returns (as the generator's value): the pulled dict, or ``None`` for a push.
        """
        call = self._prepare(op, grads, out, self.placement.specs)
        busy = yield from self._control(op, call.error)
        yield from self._data(busy, call.grads, call.result)
        self._advance(call, self.worker_counters)
        return call.finish()

    def _check_call(self, op: int) -> None:
        """A pull needs the aggregates kept (see ``keep_aggregate``)."""
        if op == CollOp.PULL:
            self.check_aggregate_kept("pull()")

    def _data(self, busy: list[int], grads: dict[str, Any] | None,
              result: dict[str, np.ndarray] | None) -> Steps:
        """The data part of a step, for the ranks in ``busy`` (this rank may be one of
        them, or a closed rank that only serves its shards; never empty)."""
        kind = CollOp(int(self._ctrl_in[busy[0], 0]))
        pushing = kind in (CollOp.PUSH, CollOp.PUSH_PULL)
        pulling = kind in (CollOp.PULL, CollOp.PUSH_PULL)
        out_flat = None if result is None else {n: a.reshape(-1) for n, a in result.items()}
        grads_flat = {} if grads is None else {n: np.ascontiguousarray(grads[n]).reshape(-1)
                                               for n in self.placement.specs}
        if self.rank in busy and pushing:
            self.aggregate_dropped = pulling and not self.keep_aggregate
        if self.codec is not None:
            yield from self._coded_step(busy, pushing, pulling, grads_flat, out_flat)
            return
        if out_flat is not None and any(np.shares_memory(out_flat[n], g)
                                        for n, g in grads_flat.items()):
            # out overwrites the gradients being sent: receive only after they are sent
            yield (yield from self._push_steps(grads_flat, busy, [], None))
            pushing = False
        gather_recvs = [] if out_flat is None else self._post_with_owners(out_flat, False)
        sends: list[MPI.Request] = []
        if pushing:
            sends = yield from self._push_steps(grads_flat, busy, busy if pulling else [],
                                                out_flat, not self.keep_aggregate)
        elif pulling:
            sends = self._send_shards(busy, out_flat)
        yield gather_recvs + sends

    def close(self) -> Steps:
        """Announce that this rank is done, then serve until every rank has closed."""
        busy = yield from self._control_quietly(CollOp.CLOSE)   # (marks this rank inactive)
        self.closed = True
        yield from self._data_for_others(busy)
        while any(self.active):
            busy = yield from self._control_quietly(CollOp.IDLE)
            yield from self._data_for_others(busy)

    def _control_quietly(self, op: CollOp) -> Steps:
        """:meth:`_control` on a closing or closed rank: the ranks that contribute to the
        step, none when the active ranks raise (a closed rank has nothing to report)."""
        try:
            return (yield from self._control(op, None))
        except PSError:
            return []

    def _data_for_others(self, busy: list[int]) -> Steps:
        """A closed rank's part of the step the active ranks in ``busy`` are taking."""
        if not busy:
            return
        kind = CollOp(int(self._ctrl_in[busy[0], 0]))
        if kind == CollOp.STATS:
            self.comm.allgather(self.server_stats())
        elif kind == CollOp.SAVE:
            yield from self.save_steps(None)
        else:
            yield from self._data(busy, None, None)

    def check_aggregate_kept(self, what: str) -> None:
        """Raise unless the owners still hold the values (see ``keep_aggregate``).

        Raises:
            PSError: the last push_pull did not keep the aggregates.
        """
        if self.aggregate_dropped:
            raise PSError(f"{what}: with keep_aggregate=False the last push_pull's aggregate "
                          f"was returned in out and not kept; push again first")

    # ------------------------------------------------------------------ stats, save
    def server_stats(self) -> dict:
        """This rank's server counters (the shape :meth:`Server.stats` returns)."""
        return {"server": self.rank, "rank": self.rank, "shards": len(self.states),
                "bytes_stored": sum(s.shard.nbytes for s in self.states.values()),
                **self.counters, "staleness_max": 0, "staleness_mean": 0.0,
                "staleness_count": self.counters["pulls"],
                "staleness_hist": [self.counters["pulls"]] + [0] * (P.STALENESS_BINS - 1),
                "active_workers": sum(self.active), "late_pushes_dropped": 0,
                "short_rounds": 0}

    def stats_steps(self) -> Steps:
        """Collective: every rank's server counters."""
        yield from self._control(CollOp.STATS, None)
        return self.comm.allgather(self.server_stats())

    def save_steps(self, request: tuple[str, str] | None, manifest: Any = None) -> Steps:
        """Collective checkpoint: each rank writes its shards, then the first saving rank
        calls ``manifest(path, id, clocks)`` (the commit point) if every rank wrote.

        Args:
            request: ``(path, id)`` on saving (active) ranks, ``None`` on closed ones.
            manifest: the commit function, on saving ranks.
        Returns:
            Every rank's error (``None`` where it wrote), as the generator's value.
        """
        if request is not None:
            yield from self._control(CollOp.SAVE, None)
        root = next(r for r in self.ranks if self._ctrl_in[r, 0] == CollOp.SAVE)
        path, ckpt_id = self.comm.bcast(request, root=root)
        for state in self.states.values():
            state.clocks = dict(enumerate(self.clocks))
        error = None
        try:
            write_server_file(path, ckpt_id, self.rank, list(self.states.values()))
            if self.codec is not None:
                write_codec_file(path, ckpt_id, self.rank, self.codec_state())
        except OSError as exc:
            error = f"rank {self.rank}: writing the checkpoint failed: {exc}"
        errors = [e for e in self.comm.allgather(error) if e]
        if not errors and self.rank == root:
            manifest(path, ckpt_id, list(self.clocks))
        yield [self.comm.Ibarrier()]
        return errors
