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
from .compressed import PushEncoder
from .device import DevicePull, call_side, device_views, first_device, host_arrays
from .errors import PSError
from .node_order import fold_sum, grouped_order, total_weight
from .placement import Placement, Shard
from .server import ShardState
from .stepped import SteppedOwner
from .worker import pull_destination

__all__ = ["CollOp", "ColocatedEngine"]

TAG_SCATTER, TAG_GATHER = P.TAG_SCATTER, P.TAG_GATHER

Steps = Generator[list, None, Any]


def _raw(arr: np.ndarray) -> Any:
    """``view(lo, hi)``: the buffer spec of elements ``[lo, hi)`` of flat ``arr`` as bytes."""
    raw, size = arr.view(np.uint8), arr.itemsize
    return lambda lo, hi: [raw[lo * size:hi * size], MPI.BYTE]


_NO_CONTRIBUTION = (CollOp.IDLE, CollOp.CLOSE)


class ColocatedEngine(CodedExchange, SteppedOwner):
    """The worker and server parts of one rank in the co-located layout.

    Args:
        comm: the parameter server's private communicator (every rank takes part).
        placement: the layout, with ``num_servers == comm.Get_size()``.
        optimizer: server-side optimizer name.
        hyper: hyperparameters (complete).
        average: divide the aggregated gradient by the number of contributing ranks.
        chunk_bytes: largest data message.
        max_sleep: longest pause while a closed rank waits for the next step.
        check_arrays: the worker-side validation (raises :class:`PSError`).
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
                 max_sleep: float, check_arrays: Any, keep_aggregate: bool = True,
                 codec: Codec | None = None, feedback: bool = True,
                 node_of: list[int] | None = None, weights: list[int] | None = None) -> None:
        self.comm = comm
        self.node_of = node_of
        self.weights = weights
        self._groupings: dict[tuple[int, ...], tuple[list[int], list[int], int]] = {}
        self._tmp: dict[tuple[int, int], np.ndarray] = {}      # ident -> a node's sum
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.placement = placement
        self.average = average
        self.chunk_bytes = int(chunk_bytes)
        self.max_sleep = max_sleep
        self.check_arrays = check_arrays
        self.keep_aggregate = keep_aggregate
        #: the last push_pull did not keep the aggregates (keep_aggregate=False): every
        #: rank that took part knows it, so pull()/save() refuse identically everywhere
        self.aggregate_dropped = False
        self.ranks = list(range(self.size))
        self.states: dict[tuple[int, int], ShardState] = {
            sh.ident: ShardState(sh, optimizer, hyper, self.ranks)
            for sh in placement.shards_on(self.rank)}
        #: every shard in the order all ranks post their messages
        self.order: list[Shard] = [sh for name in sorted(placement.specs)
                                   for sh in placement.shards[name]]
        self.active = [True] * self.size
        self.clock = 0
        #: every rank's clock at the last control step (checkpoints record them)
        self.clocks = [0] * self.size
        self.closed = False
        #: block in MPI's Waitall (spins) only when every rank has a core of its own
        self.spin = self.size <= (os.cpu_count() or 1)
        self._ctrl_out = np.zeros(3, dtype=np.int64)
        self._ctrl_in = np.zeros((self.size, 3), dtype=np.int64)
        self._scratch: dict[tuple[int, int], np.ndarray] = {}   # (ident, src) -> buffer
        self._acc: dict[tuple[int, int], np.ndarray] = {}       # ident -> aggregate
        self.counters = {"pushes": 0, "pulls": 0, "updates": 0, "bytes_in": 0, "bytes_out": 0,
                         "errors": 0, "bytes_in_uncompressed": 0, "bytes_out_uncompressed": 0}
        self.worker_counters = {"pushes": 0, "pulls": 0, "bytes_sent": 0, "bytes_received": 0,
                                "bytes_sent_uncompressed": 0, "bytes_received_uncompressed": 0}
        self.codec = codec
        self.feedback = feedback
        self.push_encoder = None if codec is None else PushEncoder(codec, feedback)
        self._pull_deltas = optimizer != "sum"
        self._coded_init()

    def wait(self, reqs: list[MPI.Request], busy: bool = False) -> None:
        """Complete ``reqs``: MPI's Waitall when each rank has a core (and no failure
        watch), else polling that yields the core (large shared-memory messages need both
        sides to drive them)."""
        if self.spin and not self.closed and self.watch is None:
            MPI.Request.Waitall(reqs)
        elif reqs:
            super().wait(reqs, busy=not self.closed)

    # ------------------------------------------------------------------ control step
    def _control(self, op: CollOp, error: str | None) -> Iterator[list]:
        """All-gather (op, clock, error flag); leaves the table in ``self._ctrl_in``."""
        self._ctrl_out[:] = (int(op), self.clock, 1 if error else 0)
        yield [self.comm.Iallgather([self._ctrl_out, MPI.INT64_T],
                                    [self._ctrl_in, MPI.INT64_T])]

    def _agree(self, op: CollOp, error: str | None) -> list[int]:
        """Check the control table; return the ranks that contribute to this step.

        Raises:
            PSError: (on every rank) ranks disagree on the operation or clock, or a rank's
                arguments were bad.
        """
        table = self._ctrl_in
        self.clocks = [int(c) for c in table[:, 1]]
        ops = [CollOp(int(o)) for o in table[:, 0]]
        busy = [r for r in self.ranks if ops[r] not in _NO_CONTRIBUTION]
        kinds = {ops[r] for r in busy}
        for r in self.ranks:
            if ops[r] == CollOp.CLOSE:
                self.active[r] = False
        if self.codec is not None:
            self.forget_pullers([r for r in self.ranks if ops[r] == CollOp.CLOSE])
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
            mine = f": {error}" if error else " (see the error on those ranks)"
            raise PSError(f"colocated parameter server: rank(s) {bad} passed bad "
                          f"arguments, nothing was sent{mine}", [error] if error else [])
        return busy

    # ------------------------------------------------------------------ data steps
    def _segments(self, sh: Shard) -> list[tuple[int, int]]:
        """Element ranges ``[lo, hi)`` of a shard, each one message (``chunk_bytes`` at
        most); every rank derives the same ones."""
        step = max(1, self.chunk_bytes // sh.spec.dtype.itemsize)
        return [(lo, min(lo + step, sh.count)) for lo in range(0, sh.count, step)]

    def _scratch_for(self, sh: Shard, src: int) -> np.ndarray:
        buf = self._scratch.get((sh.ident, src))
        if buf is None:
            buf = self._scratch[(sh.ident, src)] = np.empty(sh.count, dtype=sh.spec.dtype)
        return buf

    def _acc_for(self, sh: Shard) -> np.ndarray:
        acc = self._acc.get(sh.ident)
        if acc is None:
            acc = self._acc[sh.ident] = np.empty(sh.count, dtype=sh.spec.dtype)
        return acc

    def _post_gather_recvs(self, out_flat: dict[str, np.ndarray]) -> list[MPI.Request]:
        """Receives of every shard this rank does not own, straight into ``out``."""
        reqs = []
        for sh in self.order:
            if sh.server != self.rank and sh.count:
                view = _raw(out_flat[sh.spec.name][sh.lo:sh.hi])
                for lo, hi in self._segments(sh):
                    reqs.append(self.comm.Irecv(view(lo, hi), sh.server, TAG_GATHER))
                self.worker_counters["bytes_received"] += sh.nbytes
                self.worker_counters["bytes_received_uncompressed"] += sh.nbytes
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
        sends = self._post_scatter_sends(grads_flat) if self.rank in contributors else []
        others = [r for r in pullers if r != self.rank]
        for state in self.states.values():
            sends += yield from self._update_shard(state, grads_flat, contributors, others,
                                                   recvs, out_flat, into_out)
            self._count_update(state.shard, contributors, len(pullers), len(others))
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
                            self.comm.Irecv(view(lo, hi), src, TAG_SCATTER))
        return recvs

    def _post_scatter_sends(self, grads_flat: dict[str, np.ndarray]) -> list[MPI.Request]:
        """Sends of this rank's gradient segments of every shard to their owners."""
        sends: list[MPI.Request] = []
        for sh in self.order:
            if sh.server != self.rank and sh.count:
                view = _raw(grads_flat[sh.spec.name][sh.lo:sh.hi])
                sends += [self.comm.Isend(view(lo, hi), sh.server, TAG_SCATTER)
                          for lo, hi in self._segments(sh)]
                self.worker_counters["bytes_sent"] += sh.nbytes
                self.worker_counters["bytes_sent_uncompressed"] += sh.nbytes
        return sends

    def _update_shard(self, state: ShardState, grads_flat: dict[str, np.ndarray],
                      contributors: list[int], others: list[int],
                      recvs: dict[tuple[tuple[int, int], int], list[MPI.Request]],
                      out_flat: dict[str, np.ndarray] | None, into_out: bool
                      ) -> Iterator[list]:
        """One owned shard, segment by segment: wait for its gradients, reduce, apply the
        optimizer, start sending the new value to ``others`` and copy it into ``out``.
        Yields request lists to wait on; returns the value sends."""
        sh = state.shard
        parts = [grads_flat[sh.spec.name][sh.lo:sh.hi] if src == self.rank
                 else self._scratch_for(sh, src) for src in contributors]
        adopt = state.opt.name == "sum"
        state.opt.begin_update()
        out = None if out_flat is None else out_flat[sh.spec.name][sh.lo:sh.hi]
        direct = into_out and adopt and out is not None
        acc = out if direct else self._acc_for(sh)
        value = acc if adopt else state.param
        raw = _raw(value)
        sends: list[MPI.Request] = []
        for k, (lo, hi) in enumerate(self._segments(sh)):
            if recvs.get((sh.ident, k)):
                yield recvs[(sh.ident, k)]
            self._reduce(acc[lo:hi], [p[lo:hi] for p in parts], contributors, sh, lo, hi)
            if not adopt:
                state.opt.apply_part(state.param[lo:hi], acc[lo:hi], lo, hi)
            sends += [self.comm.Isend(raw(lo, hi), dst, TAG_GATHER) for dst in others]
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
        me_contributes = self.rank in contributors
        self.counters["updates"] += 1
        self.counters["pushes"] += len(contributors)
        self.counters["bytes_in"] += sh.nbytes * (len(contributors) - me_contributes)
        self.counters["bytes_in_uncompressed"] += sh.nbytes * (len(contributors) - me_contributes)
        if others:
            self.counters["pulls"] += pullers
            self.counters["bytes_out"] += sh.nbytes * others
            self.counters["bytes_out_uncompressed"] += sh.nbytes * others

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
            full = self._tmp.get(sh.ident)
            if full is None:
                full = self._tmp[sh.ident] = np.empty(sh.count, dtype=sh.spec.dtype)
            tmp = full[lo:hi if hi is not None else sh.count]
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
                    sends += [self.comm.Isend(raw(lo, hi), dst, TAG_GATHER)
                              for lo, hi in self._segments(sh)]
                    self.counters["bytes_out"] += sh.nbytes
                    self.counters["bytes_out_uncompressed"] += sh.nbytes
            self.counters["pulls"] += len(pullers)
        return sends

    # ------------------------------------------------------------------ operations
    def _flat_grads(self, grads: dict[str, Any]) -> dict[str, np.ndarray]:
        out = {}
        for name in self.placement.specs:
            arr = np.asarray(grads[name])
            if not arr.flags.c_contiguous:
                arr = arr.copy(order="C")
            out[name] = arr.reshape(-1)
        return out

    def _out_arrays(self, out: dict[str, Any] | None) -> dict[str, np.ndarray]:
        return {name: pull_destination(spec, out) for name, spec in self.placement.specs.items()}

    def step(self, op: CollOp, grads: dict[str, Any] | None = None,
             out: dict[str, Any] | None = None) -> Steps:
        """One collective push, pull or push_pull (a generator of request lists to wait on).

        Gradients are always checked here (``push(check=False)`` included): once the bytes
        are sent there is no server left to reject them.
        Returns (as the generator's value): the pulled dict, or ``None`` for a push.
        """
        pushing = op in (CollOp.PUSH, CollOp.PUSH_PULL)
        pulling = op in (CollOp.PULL, CollOp.PUSH_PULL)
        error, result, device_pull = None, None, None
        try:
            device = call_side(grads=grads if pushing else None, out=out if pulling else None)
            if op == CollOp.PULL:
                self.check_aggregate_kept("pull()")
            if pushing:
                self.check_arrays(device_views(grads) if device else grads, complete=True,
                                  what="gradient")
            if pulling and device:
                device_pull = DevicePull(out, first_device(grads if pushing else None, out))
                result = {name: device_pull.destination(name, spec)
                          for name, spec in self.placement.specs.items()}
            elif pulling:
                result = self._out_arrays(out)
            if pushing and device:
                grads = host_arrays(grads)
        except PSError as exc:
            error = str(exc)
        yield from self._control(op, error)
        busy = self._agree(op, error)
        if device_pull is None:
            return (yield from self._data(busy, grads if pushing else None, result))
        yield from self._data(busy, grads if pushing else None,
                              {name: pair[0] for name, pair in result.items()})
        device_pull.finish()
        return {name: pair[1] for name, pair in result.items()}

    def _data(self, busy: list[int], grads: dict[str, Any] | None,
              result: dict[str, np.ndarray] | None) -> Steps:
        """The data part of a step, for the ranks in ``busy`` (this rank may be one of
        them, or a closed rank that only serves its shards)."""
        if not busy:
            return None
        kind = CollOp(int(self._ctrl_in[busy[0], 0]))
        pushing = kind in (CollOp.PUSH, CollOp.PUSH_PULL)
        pulling = kind in (CollOp.PULL, CollOp.PUSH_PULL)
        out_flat = None if result is None else {n: a.reshape(-1) for n, a in result.items()}
        grads_flat = self._flat_grads(grads) if grads is not None else {}
        if self.rank in busy and pushing:
            self.aggregate_dropped = pulling and not self.keep_aggregate
        if self.codec is not None:
            yield from self._coded_step(busy, pushing, pulling, grads_flat, out_flat)
            return self._finish_step(busy, kind, pulling, result)
        if out_flat is not None and any(np.shares_memory(out_flat[n], g)
                                        for n, g in grads_flat.items()):
            # out overwrites the gradients being sent: receive only after they are sent
            yield (yield from self._push_steps(grads_flat, busy, [], None))
            pushing = False
        gather_recvs = [] if out_flat is None else self._post_gather_recvs(out_flat)
        sends: list[MPI.Request] = []
        if pushing:
            sends = yield from self._push_steps(grads_flat, busy, busy if pulling else [],
                                                out_flat, not self.keep_aggregate)
        elif pulling:
            sends = self._send_shards(busy, out_flat)
        yield gather_recvs + sends
        return self._finish_step(busy, kind, pulling, result)

    def _finish_step(self, busy: list[int], kind: CollOp, pulling: bool,
                     result: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        """Advance this rank's clock and worker counters after a data step."""
        if self.rank in busy:
            if kind in (CollOp.PUSH, CollOp.PUSH_PULL):
                self.clock += 1
                self.worker_counters["pushes"] += 1
            if pulling:
                self.worker_counters["pulls"] += 1
        return result

    def close(self) -> Steps:
        """Announce that this rank is done, then serve until every rank has closed."""
        yield from self._control(CollOp.CLOSE, None)
        self._agree_quietly()
        self.closed = True
        self.active[self.rank] = False
        yield from self._data_for_others()
        while any(self.active):
            yield from self._control(CollOp.IDLE, None)
            self._agree_quietly()
            yield from self._data_for_others()

    def _agree_quietly(self) -> None:
        try:
            self._agree(CollOp.IDLE, None)
        except PSError:
            pass   # the active ranks raise it; a closed rank has nothing to report

    def _data_for_others(self) -> Steps:
        """A closed rank's part of the step the active ranks are taking."""
        ops = [CollOp(int(o)) for o in self._ctrl_in[:, 0]]
        busy = [r for r in self.ranks if ops[r] not in _NO_CONTRIBUTION]
        if not busy or bool(self._ctrl_in[busy, 2].any()) or \
                len({ops[r] for r in busy}) > 1:
            return
        kind = ops[busy[0]]
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
        self._agree(CollOp.STATS, None)
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
            self._agree(CollOp.SAVE, None)
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
