"""The engine: negotiation rounds on a private communicator, run by one thread at a time.

User threads (and gradient hooks) only :meth:`Engine.submit` requests and wait on futures.
*Negotiation rounds* on a private duplicate of the user's communicator decide what every
rank runs, in the same order everywhere:

1. a round is due when this rank has a new request, or some request is incomplete anywhere
   (then every rank must keep negotiating); with overlap the engine thread waits at least
   one cycle time since the previous round, so that requests arriving close together are
   negotiated and fused together;
2. all-gather (non-blocking, polled with yields then sleeps so a rank that waits for slower
   ranks leaves the CPU to them) one fixed-size record per rank: payload length, whether the
   rank's user threads are blocked waiting for a result, and the payload itself (the pickled
   :class:`~mpicoll.torch.engine.negotiation.Meta` of each new request, small control data) when it
   fits in :data:`SLOT_BYTES`; only a longer payload costs a second all-gather (``v``). A
   list of requests that repeats a learned round goes as its
   :class:`~mpicoll.torch.engine.negotiation.ResponseCache` id instead (``-id`` in the length
   field); when every rank sends the same id, the learned responses run without unpickling
   or negotiating;
3. feed them to the :class:`~mpicoll.torch.engine.negotiation.Negotiator` (same input, same
   responses on every rank) and run the responses (:mod:`mpicoll.torch.engine.execute`) with
   mpicoll's collectives on the tensors themselves (zero-copy numpy views).

Who runs the rounds: with overlap (a spare core per rank), the engine thread, as soon as
requests arrive. Without overlap, the user thread that waits for a result runs them itself
(holding the round lock, so one thread at a time makes the adapter's MPI calls): handing
the round to the engine thread and the result back costs two thread wake-ups per step,
0.1-0.4 ms each on a loaded 2-core machine. The engine thread then only runs rounds for
requests nobody waits for (after :data:`_MAX_DEFER_SECONDS`, or when ``poll()`` pokes it).
With one rank, requests run at once on the submitting thread (nothing to negotiate).

Shutdown, as in Horovod, is not collective: :meth:`Engine.shutdown` (``hvd.shutdown()``,
and at interpreter exit) puts a ``shutdown`` request in the next round and wakes the other
ranks for it (:mod:`mpicoll.torch.engine.notices`); after that round every rank's engine stops and
what is still pending, or submitted later, fails with an error naming the rank that left.

The stall inspector (rank 0) logs requests that some ranks submitted and others did not.

From :mod:`mpicoll.runtime`: the communicator (``comms.dup``, owner ``"engine"``; the
shutdown notices share it), the thread (a ``Lane`` running the loop as one operation; why
the rounds are not lane operations: docs/torch.md, "The engine's thread") and the failures
(``failures.translate``: a process failure revokes every communicator of the world).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import queue
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from ... import timeline, watchdog
from ...context import get_context
from ...errors import CollectiveError, ProcessFailedError
from ...runtime import comms, failures, progress
from ...runtime import world as runtime_world
from ...runtime.progress import Lane
from . import trace
from ...gpu.slots import HostSlots
from ..device.tensors import TensorDevice, device_of, same_device
from .dtypes import numpy_view
from .execute import run_responses
from .handles import Future
from .negotiation import JOIN, SHUTDOWN, Meta, Negotiator, ResponseCache, shutdown_message
from .notices import Notices
from .settings import Settings

__all__ = ["Engine", "Work"]

log = logging.getLogger("mpicoll.torch.engine.core")
stall_log = logging.getLogger("mpicoll.torch.stall")

#: Payload bytes carried inside the fixed negotiation record (about 40 requests).
SLOT_BYTES = 4096

#: Seconds of testing a pending negotiation (each test followed by ``sched_yield``) before
#: sleeping between tests.
_YIELD_SECONDS = 0.002

#: Numpy views of persistent buffers kept by :meth:`Engine.persistent_view`.
_PERSISTENT_VIEWS = 16

#: Without overlap, the longest the engine waits for the user thread to block after the
#: latest request arrived (bounds the delay for threads that never wait on a handle).
_MAX_DEFER_SECONDS = 0.05

#: How often an idle engine thread looks for another rank's shutdown notice (seconds).
_NOTICE_POLL_SECONDS = 0.05

#: The longest a rank that shuts down waits for the other ranks to take part in its
#: shutdown round (they do within about :data:`_NOTICE_POLL_SECONDS` unless they are gone).
SHUTDOWN_WAIT_SECONDS = 10.0

#: ``MPI_Comm_create_group`` tag of the engines' side communicators (:meth:`Engine.side_comm`).
_SIDE_TAG = 1414


class Work(NamedTuple):
    """One local request: its metadata, the tensors it reads and writes, its future."""

    meta: Meta
    tensor: Any
    output: Any
    future: Future
    #: When it was submitted, while a timeline records (else 0): see :mod:`.trace`.
    since: float = 0.0
    #: Device tensors: the event recorded on the caller's stream at submission, which the
    #: engine's stream waits for before touching them (:mod:`..device.tensors`); ``None`` on the host.
    ready: Any = None


def _stamped(meta: Meta, dev: TensorDevice | None) -> Meta:
    """``meta`` with ``stages`` set when its tensors are on ``dev`` and the engine stages
    them through host memory (every rank then learns it from the negotiated metadata)."""
    return meta._replace(stages=True) if dev is not None and not dev.aware() else meta


def _engine_error(message: str, exc: BaseException | None) -> CollectiveError:
    """The error ``message`` of a request, or wait, that failed because the engine did
    (``exc``): a :class:`~mpicoll.ProcessFailedError` (naming the failed ranks) for a
    process failure, else a :class:`~mpicoll.CollectiveError`."""
    if isinstance(exc, ProcessFailedError):
        error = ProcessFailedError(message, exc.failed_ranks)
        error.__cause__ = exc
        return error
    return CollectiveError(message)


def _decide_overlap(setting: str, local_size: int) -> bool:
    """Overlap when asked to, or (``auto``) when every rank on the node has a spare core."""
    if setting in ("0", "1"):
        return setting == "1"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= local_size * (torch.get_num_threads() + 1)


class Engine:
    """Owner of the adapter's communicator and of the thread that uses it.

    Args:
        comm: the communicator of the engine's ranks.
        settings: fusion threshold, cycle time, algorithm, stall time.
        private: ``comm`` was made for this engine alone (a process set's): the engine runs
            on it and frees it, instead of on a duplicate.
    Attributes:
        comm: private duplicate of the user's communicator (valid once started).
        rank, size, local_rank, local_size, cross_rank, cross_size: the layout.
        settings: fusion threshold, cycle time, algorithm, stall time.
        local: name -> :class:`Work` submitted by this rank and not finished (engine thread).
    """

    def __init__(self, comm: MPI.Intracomm, settings: Settings, private: bool = False) -> None:
        self.settings = settings
        self._user_comm = comm
        self._private = private
        #: Wake-up markers for the engine thread (requests themselves go to _submitted).
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        #: Guards _inflight, _waited, _submitted.
        self._lock = threading.Lock()
        #: Held while a negotiation round runs (engine thread, or a waiting user thread).
        self._round_lock = threading.Lock()
        self._submitted: list[Work] = []
        self._last_submit = self._last_round = -1.0
        self._inflight: set[str] = set()
        self._waited: dict[int, Future] = {}
        #: Set once the engine's loop has ended (and its communicators are released).
        self._stopped = threading.Event()
        self._lane: Lane | None = None
        self._loop_thread: threading.Thread | None = None
        self._side: MPI.Intracomm | None = None
        self._side_lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._fusion: dict[Any, torch.Tensor] = {}
        self._pinned: dict[str, HostSlots] = {}
        self._views: dict[tuple, np.ndarray] = {}
        self.local: dict[str, Work] = {}
        self.stopping = False
        #: rank -> its ``shutdown`` request, once a shutdown round has run.
        self.leaving: dict[int, Meta] | None = None
        self._notices: Notices | None = None
        #: Another rank's shutdown notice arrived: make a round now.
        self._woken = False
        #: While shutting down: when to stop waiting for the other ranks' round.
        self._give_up_at = 0.0
        self.overlap = True
        #: Record each negotiation round on the timeline (``hvd.start_timeline(...,
        #: mark_cycles=True)``); ``rounds`` counts them.
        self.mark_cycles = False
        self.rounds = 0
        #: Called (with the leaving ranks) on the engine thread once another rank's
        #: shutdown has stopped this engine.
        self.on_peer_shutdown: Any = None
        #: A process set's engine: the global ranks of its members (``None``: global).
        self.members: list[int] | None = None
        #: Whether DistributedOptimizer reduces each flat gradient buffer as one request at
        #: ``step()`` (the same on every rank: one rank alone, or no rank overlaps).
        self.bulk_gradients = False
        #: The next number of each kind's unnamed requests (``<kind>.noname.<n>``): see
        #: :meth:`unnamed_name` and :meth:`realign_unnamed`.
        self._unnamed: dict[str, int] = {}
        self._poked = False
        self._inline: Negotiator | None = None
        self._inline_lock = threading.Lock()
        self.comm: Any = None
        self.rank = self.size = self.local_rank = self.local_size = 0
        self.cross_rank = self.cross_size = 0

    # ----------------------------------------------------------------- user side
    def start(self) -> None:
        """Make the communicator and learn the layout (collective over the user's
        communicator, on the calling thread), then start the engine's loop on its lane.

        Raises:
            whatever setting up the communicator raised (collective: on every rank).
        """
        user = self._user_comm
        #: The world generation the engine was built for (:mod:`mpicoll.runtime.world`).
        self.generation = runtime_world.generation()
        self.comm = user if self._private else comms.dup(user, "engine")
        try:
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            topology = get_context(self.comm).topology
            self.local_rank, self.local_size = topology.local_rank, topology.local_size
            self.cross_rank = topology.cross_comm.Get_rank()
            self.cross_size = topology.cross_comm.Get_size()
            self.overlap = _decide_overlap(self.settings.overlap, self.local_size)
            self.bulk_gradients = self.size == 1 or \
                bool(self.comm.allreduce(not self.overlap, op=MPI.LAND))
        except BaseException:
            comms.free(self.comm)
            raise
        if self.size == 1:
            self._inline = Negotiator(1)
        else:
            self._notices = Notices(self.comm)
        self._negotiator = Negotiator(self.size)
        self._cache = ResponseCache()
        self._header = np.zeros(2 + SLOT_BYTES // 8, dtype=np.int64)
        self._headers = np.zeros((self.size, self._header.size), dtype=np.int64)
        # blocking waits: hvd training measured 5% slower with the lanes' sleeping ones
        # (docs/results/ddp_threads.md)
        self._lane = Lane("mpicoll.torch.engine", self.comm, inline=False, sleeps=False)
        self._lane.submit("the engine's loop", self._main)

    def _started(self) -> bool:
        return self._lane is not None and not self._stopped.is_set()

    def running(self) -> bool:
        """Whether the engine takes requests (not stopped by a shutdown or a failure)."""
        return self._started() and not self.stopping and self._fatal is None

    def join(self, timeout: float = SHUTDOWN_WAIT_SECONDS) -> None:
        """Wait (at most ``timeout`` seconds) for a stopped engine's loop to end, then
        close its lane (its thread ends). Not on the engine's own thread."""
        if threading.current_thread() is not self._loop_thread and \
                self._stopped.wait(timeout) and self._lane is not None:
            self._lane.close()

    def side_comm(self) -> MPI.Intracomm:
        """The communicator of this engine's ranks for work outside the engine, on the
        callers' threads in one order on every rank: compressed all-reduces and local
        SGD's averages. Made on first use by ``MPI_Comm_create_group`` over the runtime's
        world (not collective over the engine's busy communicator), watched for a member
        that dies meanwhile (:func:`mpicoll.runtime.progress.create`); freed with the
        engine.

        Raises:
            ProcessFailedError: the engine failed, or a member failed during the creation.
            CollectiveError: the engine has stopped.
        """
        with self._side_lock:
            if self._side is None:
                self._check_running()
                parent = runtime_world.comm()
                group, everyone = self.comm.Get_group(), parent.Get_group()   # local
                try:
                    members = [] if group.Get_size() == everyone.Get_size() else \
                        MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                  everyone)

                    def build(made: list[Any]) -> MPI.Intracomm:
                        made.append(comms.create_group(parent, group, _SIDE_TAG,
                                                       "engine.side"))
                        return made[-1]

                    self._side = progress.create(build, parent, members, "engine.side")
                finally:
                    group.Free()
                    everyone.Free()
            return self._side

    def submit(self, meta: Meta, tensor: Any = None, output: Any = None,
               waiting: bool = False) -> Future:
        """Queue a request; return its future.

        With one rank (and no ``shutdown``) the request runs at once on the calling thread:
        there is nobody to negotiate with, and no MPI call to make. ``waiting=True`` says
        the caller will :meth:`wait` for this future at once.

        Raises:
            ValueError: a request of the same name from this rank is still in flight.
            CollectiveError: the engine has stopped.
        """
        dev = device_of(tensor if tensor is not None else output)
        work = Work(_stamped(meta, dev), tensor, output, Future(self), trace.submit_time(),
                    None if dev is None else dev.record())
        self._enqueue(work, waiting)
        return work.future

    def submit_group(self, group: Meta, members: list[tuple[Any, Any]]) -> list[Future]:
        """Queue a grouped operation: one request ``group`` (kind ``"group"``, whose
        ``members`` are the members' metadata) negotiated as one unit; return the
        members' futures.

        Every rank's group completes (or fails) as a whole in one round; its members then
        run with that round's other requests (all-reduces and reduce-scatters fuse).

        Args:
            group: the group's metadata. members: (tensor, output) per member, in order.
        Raises:
            TypeError: the members' tensors are not all on one device (or all on the host).
            ValueError: the group's name is already in flight on this rank.
            CollectiveError: the engine has stopped.
        """
        since = trace.submit_time()
        dev = same_device([t if t is not None else out for t, out in members],
                          f"the tensors of group {group.name!r}")
        ready = None if dev is None else dev.record()
        stamped = tuple(_stamped(meta, dev) for meta in group.members)
        works = [Work(meta, tensor, output, Future(self), since, ready)
                 for meta, (tensor, output) in zip(stamped, members)]
        self._enqueue(Work(group._replace(members=stamped), works, None, Future(self)), False)
        return [work.future for work in works]

    def _enqueue(self, work: Work, waiting: bool) -> None:
        meta = work.meta
        key = JOIN if meta.kind == "join" else meta.name
        inline = self._inline is not None and meta.kind != "shutdown"
        with self._lock:
            if self._fatal is not None or self.stopping or not self._started():
                exc = self._fatal or CollectiveError("mpicoll.torch has been shut down")
                raise _engine_error(f"{meta.kind} {meta.name!r} failed: {exc}", exc)
            if key in self._inflight:
                raise ValueError(f"this {meta.kind}'s name {meta.name!r} is already in flight "
                                 f"on this rank (an operation of any kind): names must be "
                                 f"unique until synchronized")
            self._inflight.add(key)
            if not inline:
                if waiting:
                    self._waited[id(work.future)] = work.future
                self._submitted.append(work)
                self._last_submit = time.monotonic()
        if inline:
            self._run_inline(key, work)
        elif self.overlap:
            self._queue.put(None)                # wake the engine thread
        # Without overlap the thread that waits runs the round; the engine thread looks
        # every _MAX_DEFER_SECONDS for requests nobody waits for (no wake-up per request).

    def _register(self, work: Work) -> None:
        """Make ``work`` (and a group's members) findable by :meth:`finish`."""
        self.local[JOIN if work.meta.kind == "join" else work.meta.name] = work
        if work.meta.kind == "group":
            for member in work.tensor:
                self.local[member.meta.name] = member

    def _run_inline(self, key: str, work: Work) -> None:
        """One rank: negotiate and execute ``work`` on the calling thread."""
        with self._inline_lock:
            self._register(work)
            try:
                run_responses(self, self._inline.process([[work.meta]], [False]))
            finally:
                members = work.tensor if work.meta.kind == "group" else []
                for item in [work, *members]:
                    name = key if item is work else item.meta.name
                    if name in self.local:          # run_responses() failed before finishing
                        self.finish(name, error=CollectiveError(
                            f"{item.meta.kind} {item.meta.name!r} failed"))

    def wait(self, future: Future) -> None:
        """Block until ``future`` is done, telling the other ranks this rank is blocked.

        Without overlap the waiting thread runs the negotiation rounds itself (under the
        round lock, so one thread at a time makes the adapter's MPI calls): no hand-off to
        the engine thread and back, which costs two thread wake-ups per step.

        Raises:
            CollectiveError: the engine stopped.
        """
        if future.done():
            self._forget(future)
            return
        with self._lock:
            registered = id(future) in self._waited
            self._waited[id(future)] = future
        try:
            if self.overlap:
                if not registered:
                    self._queue.put(None)
                while not future.wait(0.5):
                    self._check_running()
            else:
                self._run_rounds_until(future)
        finally:
            self._forget(future)
            if not self.overlap and self._pending():
                self._queue.put(None)            # the engine thread takes over the rounds

    def _run_rounds_until(self, future: Future) -> None:
        while not future.done():
            if not self._round_lock.acquire(timeout=0.05):
                self._check_running()
                continue
            try:
                while not future.done() and self.running() and self._pending():
                    self._round()
            except BaseException as exc:  # noqa: BLE001  (reported through every future)
                self._failed("mpicoll.torch negotiation round failed", exc)
                self._queue.put(None)
            finally:
                self._round_lock.release()
            if not future.done():
                self._check_running()
                future.wait(0.001)

    def _check_running(self) -> None:
        if self._fatal is not None or not self._started():
            raise _engine_error(f"mpicoll.torch engine stopped ({self._fatal or 'shut down'})",
                                self._fatal)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._waited.pop(id(future), None)

    # ------------------------------------------------------------ engine side
    def finish(self, key: str, result: Any = None, error: BaseException | None = None,
               extra: Any = None) -> None:
        """Complete this rank's request ``key`` (if it has one)."""
        work = self.local.pop(key, None)
        if work is None:
            return
        with self._lock:
            self._inflight.discard(key)
        if error is not None:
            work.future.set_error(error)
        else:
            work.future.set_result(result, extra)

    def unnamed_name(self, kind: str) -> str:
        """The name of this engine's next unnamed ``kind`` request: ``<kind>.noname.<n>``,
        ``n`` counting from 0 per kind. Ranks that issue the same unnamed operations in
        the same order give them the same names."""
        with self._lock:
            n = self._unnamed.get(kind, 0)
            self._unnamed[kind] = n + 1
        return f"{kind}.noname.{n}"

    def realign_unnamed(self) -> dict[str, list[int]]:
        """Give every rank the same next number for each kind of unnamed request: the
        largest any rank has reached (collective on :attr:`comm`: run as a response of a
        round, which every rank runs at the same point). Called after a deadlock, so that
        ranks whose numbering diverged (one skipped an operation) match again.

        Returns:
            kind -> each rank's next number before realigning (the ones that differ).
        """
        with self._lock:
            mine = dict(self._unnamed)
        every = self.comm.allgather(mine)
        kinds = sorted({kind for counters in every for kind in counters})
        before = {kind: [c.get(kind, 0) for c in every] for kind in kinds}
        with self._lock:
            for kind, values in before.items():
                self._unnamed[kind] = max(values)
        return {kind: values for kind, values in before.items() if len(set(values)) > 1}

    def fusion_buffer(self, dtype: torch.dtype, count: int,
                      device: TensorDevice | None = None) -> torch.Tensor:
        """A flat scratch tensor of ``count`` elements on ``device`` (``None``: the host),
        reused across buckets (on a device: used only on the engine's stream)."""
        key = dtype if device is None else (dtype, device.name)
        buf = self._fusion.get(key)
        if buf is None or buf.numel() < count:
            size = max(count, 1024)
            buf = self._fusion[key] = torch.empty(size, dtype=dtype) if device is None \
                else device.empty((size,), dtype)
        return buf[:count]

    def host_slots(self, device: TensorDevice) -> HostSlots:
        """The pinned host memory that stages this engine's requests on ``device``."""
        slots = self._pinned.get(device.name)
        if slots is None:
            slots = self._pinned[device.name] = HostSlots(device.pinned)
        return slots

    def persistent_view(self, flat: torch.Tensor) -> np.ndarray:
        """The same numpy view of ``flat`` every time it is reduced (DistributedOptimizer's
        gradient buffers), so that mpicoll's call cache (keyed by the arrays) hits.

        A cached view keeps its memory alive, so a tensor at the same address with the same
        size and dtype is that same memory. At most :data:`_PERSISTENT_VIEWS` are kept.
        """
        key = (flat.data_ptr(), flat.numel(), flat.dtype)
        array = self._views.get(key)
        if array is None:
            if len(self._views) >= _PERSISTENT_VIEWS:
                self._views.pop(next(iter(self._views)))
            array = self._views[key] = numpy_view(flat)
        return array

    def _blocked(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._waited.values())

    def _main(self) -> None:
        """The engine's loop (the lane's one long operation); then release its
        communicators."""
        self._loop_thread = threading.current_thread()
        clean = False
        try:
            self._loop()
            clean = True
        except BaseException as exc:  # noqa: BLE001  (reported through every future)
            self._failed("mpicoll.torch engine failed", exc)
        try:
            if clean:
                self._fail_all(CollectiveError("mpicoll.torch has been shut down"))
                leaving = sorted(self.leaving or ())
                if self.on_peer_shutdown is not None and leaving and self.rank not in leaving:
                    self.on_peer_shutdown(leaving)
        except Exception:  # noqa: BLE001  (nothing to report to on this thread)
            log.exception("stopping the process sets after a shutdown failed")
        try:
            self._release(clean)
        finally:
            self._stopped.set()

    def _release(self, clean: bool) -> None:
        """Free the engine's communicators after a shutdown round (once its notices are
        in); after a failure, or when abandoned, only forget them
        (:func:`mpicoll.runtime.comms.forget`: a free could wait for ranks that are gone)."""
        with self._side_lock:
            owned, self._side = [self.comm, self._side], None
        clean = clean and self.leaving is not None
        try:
            if clean and self._notices is not None:
                clean = self._notices.close([r for r in self.leaving if r != self.rank])
        except MPI.Exception:
            clean = False
        if not clean:
            comms.forget(owned)
            return
        for comm in owned:
            comms.free(comm)

    def _failed(self, what: str, exc: BaseException) -> None:
        """A round failed: fail every request of this rank with ``exc`` as the runtime
        translates it (a process failure revokes the world's communicators, so every
        survivor's engine fails too)."""
        exc = failures.translate(exc, self.comm, "a negotiation round of mpicoll.torch")
        if isinstance(exc, ProcessFailedError):
            log.warning("%s: %s", what, exc)       # an expected event under ULFM
        else:
            log.error("%s", what, exc_info=exc)
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request of this rank (pending, or submitted later) with ``exc``'s
        message (the first failure is kept for later submissions)."""
        with self._lock:
            self._fatal = self._fatal or exc
            submitted, self._submitted = self._submitted, []
        for work in submitted:
            self._register(work)
        for key in list(self.local):
            meta = self.local[key].meta
            self.finish(key, error=_engine_error(f"{meta.kind} {meta.name!r} failed: {exc}",
                                                 exc))

    def abandon(self, reason: str) -> None:
        """Stop this engine without a shutdown round (after a process failure, which the
        runtime has answered by revoking the world's communicators, so a round in flight
        ends with an error) and wait briefly for its loop to end; its communicators are
        only forgotten. Pending and later requests fail with ``reason``."""
        self.stopping = True
        self._fail_all(CollectiveError(reason))
        self._queue.put(None)
        self.join(2.0)

    def _pending(self) -> bool:
        """Whether a round is due: this rank has new requests, or some request is
        incomplete somewhere (then every rank must keep negotiating)."""
        return bool(self._submitted) or self._negotiator.busy() or self._woken

    def _loop(self) -> None:
        while not self.stopping and self._fatal is None:
            if self._notices is not None and self._notices.poll():
                self._woken = True               # another rank shuts down: round now
            if not self._pending():
                # a wake-up: new request (with overlap), poke, stop, or time to look for a
                # shutdown notice; without overlap, look again after a while (requests
                # are not announced: see submit())
                with contextlib.suppress(queue.Empty):
                    self._queue.get(timeout=_NOTICE_POLL_SECONDS if self.overlap
                                    else min(_NOTICE_POLL_SECONDS, _MAX_DEFER_SECONDS))
                continue
            if self.overlap:
                # Wait out the cycle so that requests close together fuse, unless this
                # rank's user thread is already blocked on a result (nothing more coming).
                pause = self._last_round + self.settings.cycle_time - time.monotonic()
                if pause > 0 and not self._blocked():
                    time.sleep(pause)
            elif not self._defer():
                continue
            with self._round_lock:
                if self._pending() and not self.stopping and self._fatal is None:
                    self._round()

    def _round(self) -> None:
        """One negotiation round, then run what it completed (holding the round lock);
        recorded on the timeline as a ``CYCLE`` with ``mark_cycles``."""
        self.rounds += 1
        marked = self.mark_cycles and timeline.enabled()
        begin = timeline.now() if marked else 0.0
        try:
            self._negotiate_and_run()
        finally:
            if marked:
                trace.cycle(begin, {"round": self.rounds})

    def _negotiate_and_run(self) -> None:
        header, headers = self._header, self._headers
        header[1] = self._blocked()              # read before draining: see negotiation.py
        with self._lock:
            new, self._submitted = self._submitted, []
        self._last_round = time.monotonic()
        metas = [w.meta for w in new]
        negotiator, cache = self._negotiator, self._cache
        was_idle = not negotiator.busy()
        cache_id = cache.lookup(metas) if self.size > 1 else 0
        data = pickle.dumps(metas, protocol=pickle.HIGHEST_PROTOCOL) \
            if metas and not cache_id and self.size > 1 else b""
        header[0] = -cache_id if cache_id else len(data)
        if len(data) <= SLOT_BYTES:
            header.view(np.uint8)[16:16 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        for work in new:
            self._register(work)
        if self._notices is not None and any(m.kind == "shutdown" for m in metas):
            self._notices.announce()             # before the round: see notices.py
        stall_after = self.settings.stall_check_time
        if self.size == 1:
            headers[0, :2] = header[:2]
            payloads = [metas]                   # one rank: nothing to exchange
        else:
            self._poll(self.comm.Iallgather(header, headers), stall_after)
            if cache_id and was_idle and (headers[:, 0] == -cache_id).all():
                run_responses(self, cache.responses(cache_id))   # the same round as before
                return
            payloads = self._payloads(data, headers)
        responses = negotiator.process(payloads, [bool(b) for b in headers[:, 1]])
        cache.learn(payloads, responses, was_idle, not negotiator.busy())
        if responses:
            run_responses(self, responses)
        if stall_after > 0 and self.rank == 0:
            for name, have, missing in negotiator.stalled(time.monotonic(), stall_after):
                stall_log.warning("stall: %r was submitted by ranks %s but not yet by "
                                  "ranks %s (for %.0f s or more)", name, have, missing,
                                  stall_after)

    def poke(self) -> None:
        """Ask for progress without blocking (``poll()``): ends a deferral early."""
        if not self._poked:
            self._poked = True
            self._queue.put(None)

    def shutdown(self, reason: str = "") -> None:
        """Stop the engine here and, in the same round, on every other rank (not
        collective, as Horovod's): submit ``shutdown`` (``reason`` says why, for the other
        ranks' errors), wait for its round, at most :data:`SHUTDOWN_WAIT_SECONDS` for the
        other ranks to take part, and for the thread to end. Already stopped (another rank
        shut down first, or a failure): just wait for the thread."""
        with contextlib.suppress(CollectiveError):      # already stopped: just wait
            future = self.submit(Meta(SHUTDOWN, "shutdown", reason=reason))
            self._give_up_at = time.monotonic() + SHUTDOWN_WAIT_SECONDS
            if self._notices is not None and not self._stopped.is_set():
                # wake the others now: a round already in progress (waiting for ranks
                # with nothing to submit) would otherwise hold the shutdown round back
                with contextlib.suppress(MPI.Exception):   # (the loop ended meanwhile)
                    self._notices.announce()
            with contextlib.suppress(CollectiveError):
                self.wait(future)
            if future.error is not None and self.leaving is None:
                log.warning("rank %d shut down without the other ranks: %s", self.rank,
                            future.error)
        self.join()

    def stop(self, leaving: dict[int, Meta]) -> None:
        """Run for the ``shutdown`` response (``leaving``: rank -> its request): fail every
        request of this rank with :func:`~mpicoll.torch.engine.negotiation.shutdown_message` and
        make the engine thread leave its loop."""
        self.leaving = leaving
        self.stopping = True
        ranks = self.members or range(self.size)          # messages name global ranks
        self._fail_all(CollectiveError(shutdown_message(
            {ranks[r]: meta for r, meta in leaving.items()}, ranks[self.rank])))
        self._queue.put(None)

    def _defer(self) -> bool:
        """Without overlap, on the engine thread: wait for a poke, or until
        :data:`_MAX_DEFER_SECONDS` after the latest request while no user thread waits
        (a waiting thread runs the rounds itself). Returns whether to run a round now."""
        while not self._poked and not self.stopping and not self.overlap and not self._woken:
            if self._blocked():
                # The waiting thread does the rounds; look again now and then (the wait
                # may end with requests still pending, or overlap be switched on).
                with contextlib.suppress(queue.Empty):
                    self._queue.get(timeout=_MAX_DEFER_SECONDS)
                return False
            remaining = (max(self._last_submit, self._last_round) + _MAX_DEFER_SECONDS
                         - time.monotonic())
            if remaining <= 0:
                break
            try:
                self._queue.get(timeout=remaining)
            except queue.Empty:
                break
        self._poked = False
        return not self.stopping

    def _payloads(self, data: bytes, headers: np.ndarray) -> list[list[Meta]]:
        """Every rank's requests of this round, from the records (and the ``v`` fallback)."""
        codes = [int(c) for c in headers[:, 0]]
        counts = [max(c, 0) for c in codes]
        if max(counts) <= SLOT_BYTES:
            slots = headers.view(np.uint8)[:, 16:]
            raw = [slots[r, :c] for r, c in enumerate(counts)]
        else:
            displs = [0, *itertools.accumulate(counts)][:-1]
            recv = np.empty(sum(counts), dtype=np.uint8)
            send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, np.uint8)
            self.comm.Allgatherv(send, [recv, (counts, displs), MPI.BYTE])
            raw = [recv[d:d + c] for d, c in zip(displs, counts)]
        return [self._cache.metas(-code) if code < 0 else pickle.loads(payload.tobytes())
                if code else [] for code, payload in zip(codes, raw)]

    def _poll(self, request: MPI.Request, stall_after: float) -> None:
        """Complete ``request``: test and yield, then sleep between tests once it has taken
        a while (a rank waiting for slower ranks must not take their CPU)."""
        if request.Test():      # the common case: done at once, no clock read
            return
        spins = 0
        delay = 20e-6
        start = warned = time.monotonic()
        ask_at = start + watchdog.LEFT_GRACE_SECONDS
        while not request.Test():
            spins += 1
            if spins < 64 or time.monotonic() - start < _YIELD_SECONDS:
                # Yielding keeps the latency low when ranks are nearly in step (sleeping
                # costs a scheduler wake-up, milliseconds on a loaded machine) while
                # leaving the core to any runnable thread.
                os.sched_yield()
                continue
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
            now = time.monotonic()
            if self._give_up_at and now > self._give_up_at:
                raise CollectiveError(
                    f"rank {self.rank} is shutting down, but the other ranks did not take "
                    f"part in a negotiation round within {SHUTDOWN_WAIT_SECONDS:.0f} s")
            if now >= ask_at:
                # a rank whose elastic function ended never joins: it must leave
                ask_at = now + watchdog.POLL_SECONDS
                watchdog.ask_ended_to_leave(self.comm, "a Horovod engine negotiation round")
            if stall_after > 0 and now - warned >= stall_after:
                warned = now
                stall_log.warning("stall: rank %d has waited %.0f s for the other ranks to "
                                  "negotiate (its requests in flight: %s)", self.rank,
                                  now - start, sorted(self.local) or "none")
