"""The server loop: receive requests from any worker, keep shards, apply updates.

One :class:`Server` per server rank. It polls for request headers with ``Iprobe`` and a
:class:`~mpicoll.ps.protocol.Backoff` (so an idle server sleeps instead of spinning on the
shared cores), serves each request in arrival order, defers pulls that the consistency model
does not allow yet, and returns from :meth:`Server.serve` once every worker has closed.

Consistency, per shard (a worker's *clock* is the number of pushes it has made):

- ``bsp``: pushes of round ``r`` are buffered per worker; once every active (not closed)
  worker has pushed round ``r`` they are summed node by node, in worker-rank order inside
  a node (:mod:`mpicoll.ps.node_order`; reproducible), divided by the number of
  contributing workers when averaging, and applied as one update. A pull at clock
  ``c`` waits until ``c`` rounds have been applied. With ``b`` backup workers a round closes
  as soon as all but ``b`` of the active workers have pushed it (the average of the pushes
  it holds then); a push that comes for a round already closed is received, dropped and
  counted (``late_pushes_dropped``), and its reply says so (``AUX`` = 1).
- ``asp``: each push is applied on arrival (divided by the number of workers when
  averaging); pulls are answered at once.
- ``ssp`` with bound ``s``: pushes as ``asp``; a pull at clock ``c`` waits until every
  active worker's clock is at least ``c - s``.

The staleness of each answered pull (the puller's clock minus the slowest active worker's
clock) is recorded and sent back in the reply's ``AUX`` field.

With a codec (``compression=``) pushes arrive encoded and are decoded on receipt (the
aggregation above then runs on the decoded gradients); pulls are answered with the
compressed change since the worker's last pull, or with the compressed aggregate under
``optimizer="sum"`` (:class:`~mpicoll.ps.compressed.PullEncoder`, server-side error
feedback). The shard's value itself always stays exact (what checkpoints hold).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..compression import Codec
from ..runtime import failures
from . import protocol as P
from .checkpoint import write_codec_file, write_server_file
from .compressed import Coders
from .failures import guarded
from .node_order import fold_sum, grouped_order, total_weight
from .optimizers import ShardOptimizer, make_optimizer
from .placement import Placement, Shard

__all__ = ["ShardState", "Server"]

log = logging.getLogger("mpicoll.ps.server")


class ShardState:
    """Everything a server keeps for one shard."""

    def __init__(self, shard: Shard, optimizer: str, hyper: dict[str, float],
                 workers: list[int]) -> None:
        self.shard = shard
        self.optimizer_name = optimizer
        self.hyper = hyper
        self.param: np.ndarray | None = None
        self.opt: ShardOptimizer | None = None
        self.version = 0                                    # updates (rounds) applied
        self.clocks = {w: 0 for w in workers}               # pushes received per worker
        self.rounds: dict[int, dict[int, np.ndarray]] = {}  # bsp: round -> worker -> grad
        self.deferred: list[tuple[int, np.ndarray]] = []    # (worker, request header)
        self.inflight: list[MPI.Request] = []               # replies still reading param

    def initialize(self, values: np.ndarray | None = None) -> None:
        """Allocate the value (and optimizer state); copy ``values`` if given."""
        sh = self.shard
        self.param = np.empty(sh.count, dtype=sh.spec.dtype)
        if values is not None:
            np.copyto(self.param, values)
        self.opt = make_optimizer(self.optimizer_name, sh.count, sh.spec.dtype, self.hyper)


class Server(Coders):
    """The request loop of one server rank.

    Args:
        comm: the parameter server's private communicator.
        placement: the layout (every rank has the same).
        server: this server's index (= its rank).
        workers: ranks of the workers.
        consistency: ``"bsp"``, ``"asp"`` or ``"ssp"``.
        staleness: the ``ssp`` bound.
        optimizer: name in :data:`mpicoll.ps.optimizers.OPTIMIZERS`.
        hyper: hyperparameters (complete).
        average: divide aggregated gradients by the number of contributing workers
            (``bsp``) or by the number of workers (``asp``/``ssp``).
        chunk_bytes: payload chunk size.
        max_sleep: longest idle pause, in seconds.
        backup_workers: ``bsp``: a round closes once all but this many active workers have
            pushed it; later pushes for it are dropped (0: every active worker).
        codec: pushes arrive and pulls leave compressed with it (``None``: uncompressed).
        feedback: keep the residual of ``optimizer="sum"`` pulls (error feedback).
        node_of: each worker's node index: a round is summed node by node
            (:mod:`mpicoll.ps.node_order`; ``None``: in worker-rank order).
        weights: how many workers each worker rank's push holds (a node leader's under
            local aggregation: its node's; ``None``: one each); ``average`` divides by them.
    """

    def __init__(self, comm: MPI.Comm, placement: Placement, server: int, workers: list[int],
                 consistency: str, staleness: int, optimizer: str, hyper: dict[str, float],
                 average: bool, chunk_bytes: int, max_sleep: float = 1e-3,
                 backup_workers: int = 0, codec: Codec | None = None,
                 feedback: bool = True, node_of: dict[int, int] | None = None,
                 weights: dict[int, int] | None = None) -> None:
        self.comm = comm
        self.node_of = node_of
        self.weights = weights
        #: workers all pushes stand for (asp/ssp divide every push by it when averaging)
        self.total_weight = total_weight(workers, weights)
        self.placement = placement
        self.index = server
        self.active = set(workers)
        self.consistency = consistency
        self.staleness = int(staleness)
        self.average = average
        self.chunk_bytes = chunk_bytes
        self.max_sleep = max_sleep
        self.backup_workers = int(backup_workers)
        self.states: dict[tuple[int, int], ShardState] = {
            sh.ident: ShardState(sh, optimizer, hyper, workers)
            for sh in placement.shards_on(server)}
        self._setup_coders(codec, feedback, pull_deltas=optimizer != "sum", pushes=False)
        self._coded_in: dict[tuple[int, int], np.ndarray] = {}   # a shard's push payload
        self.counters = dict.fromkeys(P.SERVER_COUNTERS + (
            "late_pushes_dropped", "short_rounds", "staleness_max", "staleness_sum",
            "staleness_count"), 0)
        self.staleness_hist = np.zeros(P.STALENESS_BINS, dtype=np.int64)
        self._sending: list[tuple[int, list[MPI.Request], Any]] = []   # (dest, sends, keep)
        self._pool: dict[tuple[int, int], list[np.ndarray]] = {}
        self._scratch: dict[tuple[tuple[int, int], int], np.ndarray] = {}
        self._saves: dict[int, tuple[np.ndarray, str]] = {}
        #: replicas (mpicoll.ps.replicated): forwards state changes to the backup and
        #: holds the acknowledgements until it has them (None: unreplicated)
        self.replicator: Any = None
        #: a backup replays forwarded requests and answers nobody
        self.silent = False
        self.closed: set[int] = set()
        #: the current request's payload when it came with the request (a forwarded
        #: request is one message: header and payload); None: it follows from the sender
        self.payload_from: np.ndarray | None = None
        #: failures under ULFM (a FailureWatch; None: not watched)
        self.watch: Any = None

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Serve requests until every worker has closed."""
        self._serve(lambda _: not self.active)
        self.finish_sends()
        log.debug("server %d done: %s", self.index, self.counters)

    def receive_initial_values(self, source: int) -> None:
        """Take every shard's initial value from worker ``source`` (its INIT requests, one
        per shard stored here); called by the collective constructor, before :meth:`serve`.

        Requests are served as in :meth:`serve` (checked, answered; a rejected one is
        answered with the reason and still counts), so this returns once ``source`` has
        sent as many requests as this server stores shards.
        """
        self._serve(lambda served: served == len(self.states), source)

    def _serve(self, until: Callable[[int], bool], source: int = MPI.ANY_SOURCE) -> None:
        """Serve requests from ``source`` until ``until(requests served)``; under ULFM
        (``replicas=0``) any failure is fatal."""
        backoff = P.Backoff(max_sleep=self.max_sleep)
        status, header = MPI.Status(), np.empty(P.HEADER_LEN, dtype=np.int64)
        served = 0

        def step() -> None:
            nonlocal served
            if self.comm.Iprobe(source, P.TAG_REQUEST, status):
                src = status.Get_source()
                self.comm.Recv([header, MPI.INT64_T], src, P.TAG_REQUEST)
                served += 1
                self._dispatch(src, header.copy())
                backoff.reset()
            else:
                if self._reap(force=True):
                    backoff.reset()
                backoff.pause(busy=bool(self._sending))

        while not until(served):
            guarded(self.watch, step)

    def finish_sends(self) -> None:
        """Complete every reply still being sent."""
        P.wait_all([r for _, reqs, _ in self._sending for r in reqs])
        self._sending.clear()

    def _reap(self, force: bool = False) -> bool:
        """Forget completed reply sends; return whether any completed."""
        if not self._sending or (not force and len(self._sending) < 64):
            return False
        before = len(self._sending)
        self._sending = [entry for entry in self._sending
                         if not MPI.Request.Testall(entry[1])]
        return len(self._sending) < before

    def track_send(self, dest: int, reqs: list[MPI.Request], keep: Any) -> None:
        """Complete ``reqs`` (sends to ``dest``) in the loop, keeping ``keep`` alive."""
        self._sending.append((dest, reqs, keep))

    def forget_dead(self, dead: set[int]) -> None:
        """Failed ranks: never wait for sends to them (their requests are kept, not
        freed: see :func:`mpicoll.runtime.failures.keep_requests`) nor answer their pulls."""
        keep = []
        for dest, reqs, obj in self._sending:
            if dest in dead:
                failures.keep_requests(reqs)
            else:
                keep.append((dest, reqs, obj))
        self._sending = keep
        for state in self.states.values():
            state.deferred = [(w, h) for w, h in state.deferred if w not in dead]

    def _recv_data(self, src: int, buf: np.ndarray) -> None:
        """Receive the current request's payload into ``buf``."""
        if self.payload_from is None:
            P.recv_payload(self.comm, buf, src, P.TAG_REQUEST_DATA, self.chunk_bytes)
        elif buf.size:
            buf.view(np.uint8)[...] = self.payload_from[:buf.nbytes]

    def _drain_data(self, src: int, nbytes: int) -> bytes:
        """Receive and return the current request's payload of ``nbytes`` bytes."""
        if self.payload_from is None:
            return P.drain_payload(self.comm, nbytes, src, P.TAG_REQUEST_DATA,
                                   self.chunk_bytes)
        return self.payload_from[:nbytes].tobytes()

    # ------------------------------------------------------------------ replies
    def _reply(self, dest: int, request: np.ndarray, status: int = 0, payload: Any = None,
               clock: int = 0, aux: int = 0, state: ShardState | None = None,
               coded: bool = False) -> None:
        """Answer ``request``; a ``coded`` payload is the codec's encoding of ``state``'s
        shard; ``state`` (uncompressed) marks a payload that reads the shard's value.
        A backup (:attr:`silent`) answers nobody."""
        if self.silent:
            return
        h = P.new_header(int(request[P.OP]), key=int(request[P.KEY]),
                         shard=int(request[P.SHARD]), seq=int(request[P.SEQ]), status=status,
                         clock=clock, aux=aux, coded=int(coded))
        if isinstance(payload, str):
            payload = np.frombuffer(payload.encode("utf-8"), dtype=np.uint8)
        if payload is not None:
            h[P.COUNT] = state.shard.count if coded else payload.size
            h[P.NBYTES] = payload.nbytes
            self.counters["bytes_out_uncompressed"] += \
                state.shard.nbytes if coded else payload.nbytes
        try:
            reqs = [self.comm.Isend([h, MPI.INT64_T], dest, P.TAG_REPLY)]
            data_reqs = P.send_payload(self.comm, payload, dest, P.TAG_REPLY_DATA,
                                       self.chunk_bytes) \
                if payload is not None and payload.size else []
        except MPI.Exception as exc:
            if self.watch is None or not self.watch.is_failure(exc):
                raise
            return      # the worker died: the failure watch reports it
        if data_reqs:
            reqs += data_reqs
            self.counters["bytes_out"] += payload.nbytes
            if state is not None and not coded:
                state.inflight += data_reqs
        self._sending.append((dest, reqs, (h, payload)))
        self._reap()

    def _ack(self, src: int, h: np.ndarray, **kwargs: Any) -> None:
        """Answer a state-changing request (push, init, close): with a backup, only once
        the backup holds the change too."""
        if self.replicator is None:
            self._reply(src, h, **kwargs)
        else:
            self.replicator.defer(self.index, lambda: self._reply(src, h, **kwargs))

    def _forward(self, src: int, h: np.ndarray, payload: np.ndarray | None = None) -> None:
        """With a backup: send it the request ``src`` made (and its payload, copied)."""
        if self.replicator is not None:
            self.replicator.forward(self.index, src, h, payload)

    def _error(self, src: int, h: np.ndarray, code: int, reason: str) -> None:
        """Drain the request's payload and answer with an error."""
        self._drain_data(src, int(h[P.NBYTES]))
        self.counters["errors"] += 1
        log.info("server %d rejects a request from rank %d: %s", self.index, src, reason)
        self._reply(src, h, status=code, payload=f"server rank {self.comm.Get_rank()}: {reason}")

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, src: int, h: np.ndarray) -> None:
        op = int(h[P.OP])
        if self.replicator is not None and self._duplicate(src, h):
            return
        if src not in self.active:
            self._error(src, h, P.Status.BAD_REQUEST,
                        f"rank {src} is not an active worker (closed, or a server)")
            return
        if op == P.Op.CLOSE:
            self._close(src, h)
        elif op == P.Op.STATS:
            self._reply(src, h, payload=self.stats_vector())
        elif op == P.Op.SAVE:
            self._save_request(src, h)
        else:   # INIT, PUSH or PULL: the other ops (REPLICATE, NOTICE) never come here
            state = self._validate(src, h)
            if state is None:
                return
            if op == P.Op.INIT:
                self._init(src, h, state)
            elif op == P.Op.PUSH:
                self._push(src, h, state)
            else:
                self.counters["pulls"] += 1
                self._answer_or_defer(src, h, state)

    def _duplicate(self, src: int, h: np.ndarray) -> bool:
        """With replicas: whether ``h`` repeats a request this slot already holds (a
        worker re-sends its unacknowledged requests to the new primary after a failover,
        and the old primary may have forwarded them before it died); if so it is
        acknowledged without being applied again."""
        op = int(h[P.OP])
        clock = 0
        if op == P.Op.CLOSE:
            dup = src in self.closed
        elif op in (P.Op.PUSH, P.Op.INIT):
            state = self.states.get((int(h[P.KEY]), int(h[P.SHARD])))
            if state is None or src not in state.clocks:
                return False
            dup = (int(h[P.CLOCK]) < state.clocks[src] if op == P.Op.PUSH
                   else state.param is not None)
            clock = state.version if op == P.Op.PUSH else 0
        else:
            return False
        if dup:
            self._drain_data(src, int(h[P.NBYTES]))
            self._ack(src, h, clock=clock)
        return dup

    def _validate(self, src: int, h: np.ndarray) -> ShardState | None:
        """The shard request ``h`` names, or ``None`` after answering it with the reason
        it cannot be served."""
        ident = (int(h[P.KEY]), int(h[P.SHARD]))
        state = self.states.get(ident)
        if state is None:
            name = next((s.name for s in self.placement.specs.values() if s.key == ident[0]),
                        None)
            problem = (P.Status.UNKNOWN_KEY,
                       f"unknown key (crc32 {ident[0]}): no such parameter" if name is None
                       else f"shard {ident[1]} of {name!r} is not stored on this server")
        else:
            problem = self._problem(src, h, state)
        if problem is not None:
            self._error(src, h, *problem)
            return None
        return state

    def _problem(self, src: int, h: np.ndarray, state: ShardState) -> tuple[int, str] | None:
        """Why request ``h`` from ``src`` does not fit ``state``'s shard: (status, reason),
        or ``None`` if it does."""
        op = int(h[P.OP])
        sh = state.shard
        spec = sh.spec
        dt = P.dtype_of(int(h[P.DTYPE]))
        if dt != spec.dtype:
            return P.Status.BAD_DTYPE, f"{spec.name!r} has dtype {spec.dtype}, request has {dt}"
        if int(h[P.TOTAL]) != spec.size or int(h[P.SHAPE]) != P.shape_code(spec.shape):
            return (P.Status.BAD_SHAPE,
                    f"{spec.name!r} has shape {spec.shape} ({spec.size} elements); the "
                    f"request's tensor has {int(h[P.TOTAL])} elements or another shape")
        coded = op == P.Op.PUSH and self.codec is not None
        if op != P.Op.PULL and int(h[P.CODED]) != coded:
            return (P.Status.BAD_REQUEST,
                    f"{P.Op(op).name.lower()} of {sh.label()}: this server expects "
                    + (f"payloads compressed with {self.codec.name!r}" if coded
                       else "uncompressed values"))
        nbytes = self.codec.wire_bytes(sh.count, spec.dtype) if coded else sh.nbytes
        if op != P.Op.PULL and (int(h[P.COUNT]) != sh.count or int(h[P.OFFSET]) != sh.lo
                                or int(h[P.NBYTES]) != nbytes):
            return (P.Status.BAD_SHAPE,
                    f"shard {sh.label()} needs {sh.count} elements at offset {sh.lo} "
                    f"({nbytes} bytes); got {int(h[P.COUNT])} at {int(h[P.OFFSET])} "
                    f"({int(h[P.NBYTES])} bytes)")
        if op == P.Op.INIT and state.param is not None:
            return P.Status.DUPLICATE_INIT, f"{spec.name!r} is already initialized (duplicate init)"
        if op != P.Op.INIT and state.param is None:
            return (P.Status.NOT_INITIALIZED, f"{spec.name!r} is not initialized yet "
                    f"({P.Op(op).name.lower()} before init)")
        if op == P.Op.PUSH and not self._clock_fits(int(h[P.CLOCK]), state.clocks[src]):
            return (P.Status.BAD_REQUEST,
                    f"push of {sh.label()} at clock {int(h[P.CLOCK])}, but this worker's "
                    f"next clock here is {state.clocks[src]}")
        if op == P.Op.PULL and self._waits_for_itself(state, src, int(h[P.CLOCK])):
            return (P.Status.BAD_REQUEST,
                    (f"pull of {sh.label()} at clock {int(h[P.CLOCK])} cannot be answered: "
                     f"this server has this worker's pushes of it for {state.clocks[src]} "
                     f"clocks only (a push of it was rejected), so the pull would wait "
                     f"forever for this worker's own push"))
        return None

    def _waits_for_itself(self, state: ShardState, src: int, clock: int) -> bool:
        """Whether a pull at ``clock`` from active worker ``src`` waits for a push of
        ``src``'s own that ``state``'s shard never got (rejected, so never to come: its
        pushes and pulls arrive here in order): ``bsp`` without backup workers (the round
        needs ``src``) and ``ssp`` (the bound needs ``src``'s clock) would defer it forever."""
        if self.consistency == "bsp" and not self.backup_workers:
            return state.clocks[src] < clock
        if self.consistency == "ssp":
            return state.clocks[src] < clock - self.staleness
        return False

    def _clock_fits(self, clock: int, expected: int) -> bool:
        """Whether a push at ``clock`` may follow this worker's pushes so far: the next
        clock, or (with backup workers, whose workers skip rounds that closed without
        them) any later one."""
        return clock >= expected if self.backup_workers else clock == expected

    # ------------------------------------------------------------------ operations
    def _init(self, src: int, h: np.ndarray, state: ShardState) -> None:
        state.initialize()
        try:
            self._recv_data(src, state.param)
        except BaseException:
            state.param = None    # the sender died mid-way: not initialized
            raise
        P.count_bytes(self.counters, "bytes_in", state.shard.nbytes, state.shard.nbytes)
        self._forward(src, h, state.param)
        self._ack(src, h)

    def _buffer(self, state: ShardState) -> np.ndarray:
        pool = self._pool.setdefault(state.shard.ident, [])
        return pool.pop() if pool else np.empty(state.shard.count, dtype=state.shard.spec.dtype)

    def _writable_param(self, state: ShardState) -> np.ndarray:
        """The value, safe to modify: copied if a reply still reads the old one."""
        if state.inflight and not MPI.Request.Testall(state.inflight):
            state.param = state.param.copy()   # the old array stays alive in self._sending
        state.inflight = []
        return state.param

    def _receive_gradient(self, src: int, h: np.ndarray, state: ShardState,
                          buf: np.ndarray) -> None:
        """Receive a push's payload into ``buf`` (decoding it when compressed)."""
        sh = state.shard
        nbytes = int(h[P.NBYTES])
        P.count_bytes(self.counters, "bytes_in", nbytes, sh.nbytes)
        if self.codec is None:
            self._recv_data(src, buf)
            return
        raw = P.scratch(self._coded_in, sh.ident, nbytes)
        self._recv_data(src, raw)
        self.codec.decode_into(raw, sh.count, buf)

    def _push(self, src: int, h: np.ndarray, state: ShardState) -> None:
        sh = state.shard
        clock = int(h[P.CLOCK])
        self.counters["pushes"] += 1
        bsp = self.consistency == "bsp"     # bsp buffers each push until its round closes
        buf = self._buffer(state) if bsp else \
            P.scratch(self._scratch, (sh.ident, src), sh.count, sh.spec.dtype)
        self._receive_gradient(src, h, state, buf)
        self._forward(src, h, buf)
        if bsp:
            state.clocks[src] = clock + 1
            late = clock < state.version       # only with backup workers: the round closed
            if late:
                self._pool[sh.ident].append(buf)
                self.counters["late_pushes_dropped"] += 1
            else:
                state.rounds.setdefault(clock, {})[src] = buf
            self._ack(src, h, clock=state.version, aux=int(late))
            self._complete_rounds(state)
        else:
            state.clocks[src] += 1
            if self.average and self.total_weight > 1:
                np.divide(buf, self.total_weight, out=buf)
            state.opt.apply(self._writable_param(state), buf)
            state.version += 1
            self.counters["updates"] += 1
            self._ack(src, h, clock=state.version)
            self._answer_deferred(state)

    def _round_complete(self, grads: dict[int, np.ndarray] | None) -> bool:
        """bsp: whether a round holding pushes ``grads`` closes now: every active worker
        but ``backup_workers`` has pushed it (all of them without backup workers)."""
        if not grads:
            return False
        pushed = sum(1 for w in self.active if w in grads)
        if pushed < len(self.active):
            if pushed < len(self.active) - self.backup_workers:
                return False
            self.counters["short_rounds"] += 1
        return True

    def _complete_rounds(self, state: ShardState) -> None:
        """bsp: apply every round that can close (see :meth:`_round_complete`), in order."""
        start = state.version
        while self._round_complete(grads := state.rounds.get(state.version)):
            del state.rounds[state.version]
            order, sizes = grouped_order(list(grads), self.node_of)
            acc = fold_sum(grads[order[0]], [grads[w] for w in order], sizes)
            count = total_weight(order, self.weights)
            if self.average and count > 1:
                np.divide(acc, count, out=acc)
            pool = self._pool.setdefault(state.shard.ident, [])
            if state.opt.name == "sum":
                # the value becomes the aggregate: adopt the buffer instead of copying it
                state.opt.steps += 1
                old = state.param
                if not state.inflight or MPI.Request.Testall(state.inflight):
                    pool.append(old)       # else it stays alive in self._sending until sent
                state.inflight = []
                state.param = acc
                pool.extend(grads[w] for w in order if grads[w] is not acc)
            else:
                state.opt.apply(self._writable_param(state), acc)
                pool.extend(grads.values())
            state.version += 1
            self.counters["updates"] += 1
        if state.version != start:
            self._answer_deferred(state)

    def _min_clock(self, state: ShardState) -> int:
        return min((state.clocks[w] for w in self.active), default=0)

    def _ready(self, state: ShardState, clock: int) -> bool:
        if self.consistency == "bsp":
            return state.version >= clock
        if self.consistency == "ssp":
            return self._min_clock(state) >= clock - self.staleness
        return True

    def _answer_or_defer(self, src: int, h: np.ndarray, state: ShardState) -> None:
        """Answer pull ``h`` if the consistency model allows it now, else keep it."""
        if self._ready(state, int(h[P.CLOCK])):
            self._answer_pull(src, h, state)
        else:
            state.deferred.append((src, h))

    def _answer_pull(self, src: int, h: np.ndarray, state: ShardState) -> None:
        stale = 0 if self.consistency == "bsp" else \
            max(0, int(h[P.CLOCK]) - self._min_clock(state))
        self.counters["staleness_max"] = max(self.counters["staleness_max"], stale)
        self.counters["staleness_sum"] += stale
        self.counters["staleness_count"] += 1
        self.staleness_hist[min(stale, P.STALENESS_BINS - 1)] += 1
        data, coded = (state.param, False) if self.codec is None else \
            self._pull_encoder(state).payload(src, state.param, state.version)
        # (an uncoded compressed pull, a first one, sends a copy: never the value)
        self._reply(src, h, payload=data, clock=state.version, aux=stale,
                    state=state if coded or data is state.param else None, coded=coded)

    def _answer_deferred(self, state: ShardState) -> None:
        waiting, state.deferred = state.deferred, []
        for src, h in waiting:
            self._answer_or_defer(src, h, state)

    def _close(self, src: int, h: np.ndarray, reply: bool = True) -> None:
        """Worker ``src`` is done (``reply=False``: it died; rounds go on without it)."""
        self._forward(src, h)
        self.active.discard(src)
        self.closed.add(src)
        self._saves.pop(src, None)
        self.forget_pullers([src])
        if reply:
            self._ack(src, h)
        for state in self.states.values():
            if not reply:
                state.deferred = [(w, d) for w, d in state.deferred if w != src]
            if self.consistency == "bsp":
                self._complete_rounds(state)
            self._answer_deferred(state)
        self._maybe_save()

    # ------------------------------------------------------------------ checkpoint
    def _save_request(self, src: int, h: np.ndarray) -> None:
        text = self._drain_data(src, int(h[P.NBYTES])).decode("utf-8")
        self._saves[src] = (h, text)
        self._maybe_save()

    def _maybe_save(self) -> None:
        if not self._saves or any(w not in self._saves for w in self.active):
            return
        saves, self._saves = self._saves, {}
        texts = {t for _, t in saves.values()}
        status, reason = 0, None
        if len(texts) != 1:
            status = P.Status.BAD_REQUEST
            reason = f"workers asked for different checkpoints: {sorted(texts)}"
        elif any(s.rounds for s in self.states.values()):
            status = P.Status.FAILED
            reason = ("a bsp round is incomplete (workers called save at different steps); "
                      "call save at the same step on every worker")
        else:
            directory, ckpt_id = texts.pop().split("\n", 1)
            try:
                write_server_file(directory, ckpt_id, self.index, list(self.states.values()))
                if self.codec is not None:
                    write_codec_file(directory, ckpt_id, self.comm.Get_rank(), self.codec_state())
            except OSError as exc:
                status, reason = P.Status.FAILED, f"writing the checkpoint failed: {exc}"
        if status:
            self.counters["errors"] += len(saves)
            reason = f"server rank {self.comm.Get_rank()}: {reason}"
        for src, (h, _) in sorted(saves.items()):
            self._reply(src, h, status=status, payload=reason)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """This server's counters, stored bytes and staleness seen."""
        return stats_from_vector(self.stats_vector())

    def stats_vector(self) -> np.ndarray:
        """:meth:`stats` as the float64 vector of a STATS reply."""
        s = dict(self.counters, server=self.index, rank=self.comm.Get_rank(),
                 shards=len(self.states), active_workers=len(self.active),
                 bytes_stored=sum(st.shard.nbytes for st in self.states.values()))
        return np.array([s[k] for k in P.STATS_FIELDS] + list(self.staleness_hist),
                        dtype=np.float64)


def stats_from_vector(v: np.ndarray) -> dict:
    """Decode a STATS reply payload into the dict :meth:`Server.stats` returns."""
    n = len(P.STATS_FIELDS)
    d = {k: int(v[i]) for i, k in enumerate(P.STATS_FIELDS)}
    d["staleness_mean"] = d.pop("staleness_sum") / max(1, d["staleness_count"])
    d["staleness_hist"] = [int(x) for x in v[n:n + P.STALENESS_BINS]]
    return d
