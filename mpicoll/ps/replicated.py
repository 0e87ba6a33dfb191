"""A server rank with replicas (``ParameterServer(..., replicas=1)``): primary and backup.

Each server rank holds several *slots* (:mod:`mpicoll.ps.replicas`), one
:class:`~mpicoll.ps.server.Server` each: the slot it is the **primary** of (it answers the
workers) and the slot it is the **backup** of (it replays what the primary forwards and
answers nobody). One loop serves them all:

- a worker's request (``TAG_REQUEST``) goes to the slot it names (a shard's slot, or the
  ``SHARD`` field of a control request). A primary that changes state (push, init, close)
  first forwards the request, payload copied, to the slot's backup (``TAG_FORWARD``, header
  and payload in one message, the worker's rank in ``AUX``), applies it, and holds the reply;
- the backup replays forwarded requests in arrival order (MPI keeps one sender's messages
  in order), so it applies the same operations in the same order on the same values and
  holds the same bits; it answers each with ``TAG_FORWARD_ACK``;
- the primary sends the held replies in forwarding order as the acknowledgements come
  (one queue per slot): **a worker's push is acknowledged only once both hold it**. Pulls
  are answered by the primary at once.

Failures (ULFM, :class:`~mpicoll.ps.failures.FailureWatch`): every rank applies the same
:meth:`~mpicoll.ps.replicas.Routing.fail`. A backup whose primary died becomes the primary:
it first closes the workers known dead, then copies the slot's whole state to the slot's
new backup, if a spare server rank is left (``Op.REPLICATE`` on ``TAG_FORWARD``, so it
arrives before any later forward). A primary whose backup died sends the replies it held
once the new backup holds the copy (at once when there is no spare: the slot goes on
unreplicated). Workers re-send their unanswered requests to the new primary; one it
already holds (the old primary forwarded it before dying) is acknowledged without being
applied again (:meth:`Server._duplicate`). A dead worker is closed by each primary, and
the close forwarded like any other, so rounds go on without it.
"""
from __future__ import annotations

import collections
import logging
import pickle
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import protocol as P
from .failures import guarded
from .placement import Placement
from .replicas import Routing
from .server import Server

__all__ = ["ReplicatedServer"]

log = logging.getLogger("mpicoll.ps.replicated")


class ReplicatedServer:
    """The request loop of one server rank holding primary and backup slots.

    Args:
        comm: the parameter server's private communicator.
        placement: the layout (slots are its server indices).
        routing: who holds which slot (the same on every rank).
        workers: ranks of the workers.
        make_server: a new :class:`Server` for a slot (its shards, not yet initialized).
        max_sleep: longest idle pause, in seconds.
        watch: the failure watch (``None`` without ULFM).
    """

    def __init__(self, comm: MPI.Comm, placement: Placement, routing: Routing,
                 workers: list[int], make_server: Callable[[int], Server],
                 max_sleep: float, watch: Any = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.placement = placement
        self.routing = routing
        self.workers = list(workers)
        self.make_server = make_server
        self.max_sleep = max_sleep
        self.watch = watch
        self.queues: dict[int, collections.deque[list[Callable[[], None]]]] = {}
        self.groups: dict[int, Server] = {slot: self._role(slot, make_server(slot))
                                          for slot in routing.slots_of(self.rank)}
        self._status = MPI.Status()
        self._hdr = np.empty(P.HEADER_LEN, dtype=np.int64)
        self._backoff = P.Backoff(max_sleep=max_sleep)
        self._forward_msg = np.empty(0, np.uint8)
        self.failovers: list[dict] = []

    # ------------------------------------------------------------------ roles
    def _role(self, slot: int, server: Server) -> Server:
        primary = self.routing.primary(slot) == self.rank
        server.silent = not primary
        server.replicator = self if primary else None
        server.watch = self.watch
        self.queues.setdefault(slot, collections.deque())
        return server

    @property
    def states(self) -> dict:
        """Every shard this rank holds (primary and backup slots)."""
        return {i: st for g in self.groups.values() for i, st in g.states.items()}

    @property
    def index(self) -> int:
        """The slot this rank serves first (its own, unless it failed over)."""
        return next((s for s, g in sorted(self.groups.items()) if not g.silent), -1)

    def primary_groups(self) -> list[Server]:
        """The slots this rank answers."""
        return [g for _, g in sorted(self.groups.items()) if not g.silent]

    # ------------------------------------------------------------------ replication
    def forward(self, slot: int, origin: int, h: np.ndarray, payload: np.ndarray | None) -> None:
        """Send request ``h`` of worker ``origin`` (payload copied) to ``slot``'s backup
        and open its entry in the slot's acknowledgement queue."""
        backup = self.routing.backup(slot)
        if backup is None:
            return
        fh = h.copy()
        fh[P.AUX] = origin
        if int(fh[P.OP]) not in (P.Op.PUSH, P.Op.INIT):
            fh[P.SHARD] = slot
        raw = None if payload is None or not payload.size else payload.view(np.uint8)
        self._send_to(slot, backup, fh, raw)
        self.queues[slot].append([])

    def _send_to(self, slot: int, dest: int, h: np.ndarray, raw: np.ndarray | None) -> None:
        """Send header ``h`` and payload bytes ``raw`` (copied) as one message: the
        receiver gets both or, if this rank dies, neither (it never waits for half)."""
        h[P.NBYTES] = 0 if raw is None else raw.nbytes
        msg = np.empty(P.HEADER_LEN * 8 + int(h[P.NBYTES]), dtype=np.uint8)
        msg[:P.HEADER_LEN * 8] = h.view(np.uint8)
        if raw is not None:
            msg[P.HEADER_LEN * 8:] = raw
        # if the backup died the watch reports it, and the state copy replaces this
        self._isend(slot, dest, [msg, MPI.BYTE], P.TAG_FORWARD, msg)

    def _isend(self, slot: int, dest: int, buf: list, tag: int, keep: Any) -> None:
        """Send ``buf`` to ``dest``, completed (``keep`` kept alive) in ``slot``'s loop;
        nothing if ``dest`` died (the failure watch reports it)."""
        try:
            req = self.comm.Isend(buf, dest, tag)
        except MPI.Exception as exc:
            if self.watch is None or not self.watch.is_failure(exc):
                raise
            return
        self.groups[slot].track_send(dest, [req], keep)

    def defer(self, slot: int, reply: Callable[[], None]) -> None:
        """Send ``reply`` once the backup holds everything forwarded so far for ``slot``."""
        queue = self.queues[slot]
        if queue:
            queue[-1].append(reply)
        else:
            reply()

    def _acked(self, src: int, h: np.ndarray) -> None:
        slot = int(h[P.SHARD])
        queue = self.queues.get(slot)
        if not queue or self.routing.backup(slot) != src:
            log.debug("rank %d: stray acknowledgement from %d for slot %d", self.rank, src, slot)
            return
        for reply in queue.popleft():
            reply()

    def _snapshot(self, slot: int) -> bytes:
        group = self.groups[slot]
        states = {ident: (st.param, st.opt, st.version, dict(st.clocks),
                          {r: dict(g) for r, g in st.rounds.items()})
                  for ident, st in group.states.items()}
        return pickle.dumps({"states": states, "active": sorted(group.active),
                             "closed": sorted(group.closed)}, protocol=pickle.HIGHEST_PROTOCOL)

    def _install(self, slot: int, blob: bytes) -> None:
        """Become ``slot``'s backup from the primary's copy of its state."""
        snap = pickle.loads(blob)   # noqa: S301  (from a server rank of this very job)
        group = self.make_server(slot)
        for ident, (param, opt, version, clocks, rounds) in snap["states"].items():
            st = group.states[ident]
            st.param, st.opt, st.version = param, opt, version
            st.clocks, st.rounds = clocks, rounds
        group.active = set(snap["active"])
        group.closed = set(snap["closed"])
        self.groups[slot] = self._role(slot, group)

    def _copy_to_backup(self, slot: int) -> None:
        backup = self.routing.backup(slot)
        blob = np.frombuffer(self._snapshot(slot), dtype=np.uint8)
        self._send_to(slot, backup, P.new_header(P.Op.REPLICATE, shard=slot), blob)

    # ------------------------------------------------------------------ loop
    def _group_for(self, h: np.ndarray, control: bool) -> tuple[int, Server | None]:
        if control:
            slot = int(h[P.SHARD])
        else:
            sh = self.placement.by_ident.get((int(h[P.KEY]), int(h[P.SHARD])))
            slot = sh.server if sh is not None else self.index
        return slot, self.groups.get(slot)

    def _request(self, src: int, h: np.ndarray) -> None:
        heard = [r for r in range(self.routing.num_servers)
                 if int(h[P.AUX]) >> r & 1 and r not in self.routing.dead]
        if heard and self.watch is not None:
            # the worker knows of dead servers this rank's MPI has not reported yet (Open
            # MPI tells a rank that never talks to the dead one late, or only when it
            # next talks to it): ULFM reports only real failures, so take its word
            self.watch.known |= set(heard)
            self.on_failure(heard)
        if int(h[P.OP]) == P.Op.NOTICE:
            return
        control = int(h[P.OP]) in (P.Op.CLOSE, P.Op.STATS, P.Op.SAVE)
        slot, group = self._group_for(h, control)
        if group is None or group.silent:
            anyone = next(iter(self.groups.values()))
            anyone.silent, was = False, anyone.silent
            try:
                anyone._error(src, h, P.Status.BAD_REQUEST,
                              f"slot {slot} is served by rank {self.routing.primary(slot)} "
                              f"(holders {self.routing.holders}, failed server ranks known "
                              f"here {sorted(self.routing.dead)})")
            finally:
                anyone.silent = was
            return
        group._dispatch(src, h)

    def _forwarded(self, src: int, h: np.ndarray) -> None:
        op = int(h[P.OP])
        data = self._forward_msg[P.HEADER_LEN * 8:]
        if op == P.Op.REPLICATE:
            slot = int(h[P.SHARD])
            self._install(slot, data.tobytes())
        else:
            slot, group = self._group_for(h, op == P.Op.CLOSE)
            origin = int(h[P.AUX])
            group.payload_from = data
            try:
                group._dispatch(origin, h)
            finally:
                group.payload_from = None
        ack = P.new_header(op, shard=slot)
        self._isend(slot, src, [ack, MPI.INT64_T], P.TAG_FORWARD_ACK, ack)

    def _step(self) -> None:
        comm, status, hdr = self.comm, self._status, self._hdr
        got = False
        for tag, handler in ((P.TAG_FORWARD_ACK, self._acked), (P.TAG_FORWARD, self._forwarded),
                             (P.TAG_REQUEST, self._request)):
            if comm.Iprobe(MPI.ANY_SOURCE, tag, status):
                src = status.Get_source()
                if tag == P.TAG_FORWARD:     # header and payload in one message
                    msg = self._forward_msg = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                    comm.Recv([msg, MPI.BYTE], src, tag)
                    handler(src, msg[:P.HEADER_LEN * 8].view(np.int64).copy())
                else:
                    comm.Recv([hdr, MPI.INT64_T], src, tag)
                    handler(src, hdr.copy())
                got = True
        for g in self.groups.values():
            got = g._reap(force=True) or got
        if got:
            self._backoff.reset()
        else:
            self._backoff.pause(busy=any(g._sending for g in self.groups.values()))

    def _run(self, until: Callable[[], bool]) -> None:
        while not until():
            guarded(self.watch, self._step, self.on_failure)

    def _settled(self) -> bool:
        return not any(self.queues.values())

    def serve(self) -> None:
        """Serve until every worker has closed (or died) in every slot held here, and
        every backup holds what was forwarded to it."""
        self._run(lambda: self._settled() and not any(g.active for g in self.groups.values()))
        for g in self.groups.values():
            g.finish_sends()

    def receive_initial_values(self, source: int) -> None:
        """Serve until every shard held here (primary and backup) has its initial value
        and the backups hold them (the constructor's INIT step)."""
        self._run(lambda: self._settled() and all(
            st.param is not None for st in self.states.values()))

    # ------------------------------------------------------------------ failures
    def on_failure(self, failed: list[int]) -> None:
        """Failed ranks (ULFM): fail over the slots, copy state to new backups, close dead
        workers."""
        dead = set(failed)
        for g in self.groups.values():
            g.forget_dead(dead)
        changes = self.routing.fail(dead)
        if self.routing.lost():
            self.watch.fatal()
        for slot, (before, after) in sorted(changes.items()):
            group = self.groups.get(slot)
            if self.rank not in after or group is None:
                continue          # not ours, or a new backup here: the copy will come
            if after[0] != self.rank:
                continue          # still the backup
            promoted = before[0] != self.rank
            group = self._role(slot, group)
            if promoted:           # the old primary may not have forwarded these closes
                group.replicator = None
                for w in sorted(self.watch.known & group.active):
                    group._close(w, P.new_header(P.Op.CLOSE, shard=slot), reply=False)
                group.replicator = self
            held = [r for entry in self.queues[slot] for r in entry]
            self.queues[slot].clear()
            if len(after) > 1 and (promoted or before[1:] != after[1:]):
                self._copy_to_backup(slot)
                self.queues[slot].append(held)
            else:
                for reply in held:
                    reply()
            self.failovers.append({"slot": slot, "before": before, "after": after})
            log.warning("rank %d: slot %d now held by %s (was %s)", self.rank, slot, after,
                        before)
        for w in sorted(r for r in dead if r in self.workers):
            for g in self.primary_groups():
                if w in g.active:
                    g._close(w, P.new_header(P.Op.CLOSE, shard=g.index), reply=False)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """The counters of the first slot this rank serves."""
        groups = self.primary_groups() or list(self.groups.values())
        return groups[0].stats() if groups else {}
