"""The background engine: one thread that makes every MPI call of the adapter.

User threads (and gradient hooks) only :meth:`Engine.submit` requests and wait on futures.
The engine thread loops over *negotiation rounds* on a private duplicate of the user's
communicator:

1. wait until this rank has a new request, or some request is incomplete anywhere
   (then every rank must keep negotiating), and at least one cycle time since the previous
   round, so that requests arriving close together are negotiated and fused together;
2. all-gather (non-blocking, polled with yields then sleeps so a rank that waits for slower
   ranks leaves the CPU to them) one fixed-size record per rank: payload length, whether the
   rank's user threads are blocked waiting for a result, and the payload itself (the pickled
   :class:`~mpicoll.torch.negotiation.Meta` of each new request, small control data) when it
   fits in :data:`SLOT_BYTES`; only a longer payload costs a second all-gather (``v``);
3. feed them to the :class:`~mpicoll.torch.negotiation.Negotiator` (same input, same
   responses on every rank) and run the responses (:mod:`mpicoll.torch.execute`) with
   mpicoll's collectives on the tensors themselves (zero-copy numpy views).

The stall inspector (rank 0) logs requests that some ranks submitted and others did not.
"""
from __future__ import annotations

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

from ..context import get_context
from ..errors import CollectiveError
from .handles import Future
from .negotiation import JOIN, Meta, Negotiator
from .settings import Settings

__all__ = ["Engine", "Work"]

log = logging.getLogger("mpicoll.torch.engine")
stall_log = logging.getLogger("mpicoll.torch.stall")

#: Payload bytes carried inside the fixed negotiation record (about 40 requests).
SLOT_BYTES = 4096

#: Seconds of testing a pending negotiation (each test followed by ``sched_yield``) before
#: sleeping between tests.
_YIELD_SECONDS = 0.002

#: Without overlap, the longest the engine waits for the user thread to block after the
#: latest request arrived (bounds the delay for threads that never wait on a handle).
_MAX_DEFER_SECONDS = 0.05


class Work(NamedTuple):
    """One local request: its metadata, the tensors it reads and writes, its future."""

    meta: Meta
    tensor: Any
    output: Any
    future: Future


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

    Attributes:
        comm: private duplicate of the user's communicator (valid once started).
        rank, size, local_rank, local_size, cross_rank, cross_size: the layout.
        settings: fusion threshold, cycle time, algorithm, stall time.
        local: name -> :class:`Work` submitted by this rank and not finished (engine thread).
    """

    def __init__(self, comm: MPI.Intracomm, settings: Settings) -> None:
        self.settings = settings
        self._user_comm = comm
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._waited: dict[int, Future] = {}
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._fusion: dict[torch.dtype, torch.Tensor] = {}
        self.local: dict[str, Work] = {}
        self.stopping = False
        self.overlap = True
        self._poked = False
        self.comm: Any = None
        self.rank = self.size = self.local_rank = self.local_size = 0
        self.cross_rank = self.cross_size = 0
        self._thread = threading.Thread(target=self._main, name="mpicoll.torch.engine",
                                        daemon=True)

    # ----------------------------------------------------------------- user side
    def start(self) -> None:
        """Start the thread; return once the communicator and layout are ready.

        Raises:
            whatever setting up the communicator raised (collective: on every rank).
        """
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    def alive(self) -> bool:
        """Whether the engine thread is still running."""
        return self._thread.is_alive()

    def submit(self, meta: Meta, tensor: Any = None, output: Any = None) -> Future:
        """Queue a request; return its future.

        Raises:
            ValueError: a request of the same name from this rank is still in flight.
            CollectiveError: the engine has stopped.
        """
        key = JOIN if meta.kind == "join" else meta.name
        with self._lock:
            if self._fatal is not None or not self._thread.is_alive():
                raise CollectiveError(f"mpicoll.torch engine is not running "
                                      f"({self._fatal or 'shut down'})")
            if key in self._inflight:
                raise ValueError(f"a {meta.kind} named {meta.name!r} is already in flight on "
                                 f"this rank; names must be unique until synchronized")
            self._inflight.add(key)
        future = Future()
        self._queue.put(Work(meta, tensor, output, future))
        return future

    def wait(self, future: Future) -> None:
        """Block until ``future`` is done, telling the other ranks this rank is blocked."""
        if future.done():
            return
        with self._lock:
            self._waited[id(future)] = future
        self._queue.put(None)
        try:
            while not future.wait(0.5):
                if not self._thread.is_alive():
                    raise CollectiveError(f"mpicoll.torch engine stopped "
                                          f"({self._fatal or 'shut down'})")
        finally:
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

    def fusion_buffer(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """A flat scratch tensor of ``count`` elements, reused across buckets."""
        buf = self._fusion.get(dtype)
        if buf is None or buf.numel() < count:
            buf = self._fusion[dtype] = torch.empty(max(count, 1024), dtype=dtype)
        return buf[:count]

    def _blocked(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._waited.values())

    def _main(self) -> None:
        try:
            self.comm = self._user_comm.Dup()
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            topology = get_context(self.comm).topology
            self.local_rank, self.local_size = topology.local_rank, topology.local_size
            self.cross_rank = topology.cross_comm.Get_rank()
            self.cross_size = topology.cross_comm.Get_size()
            self.overlap = _decide_overlap(self.settings.overlap, self.local_size)
        except BaseException as exc:  # noqa: BLE001  (re-raised by start())
            self._init_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001  (reported through every future)
            log.exception("mpicoll.torch engine failed")
            self._fail_all(exc)
            return
        self._fail_all(CollectiveError("mpicoll.torch was shut down"))
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001
            log.debug("freeing the adapter communicator failed", exc_info=True)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._fatal = self._fatal or exc
        for key in list(self.local):
            self.finish(key, error=CollectiveError(f"mpicoll.torch engine stopped: {exc}"))
        for item in self._drain():
            item.future.set_error(CollectiveError(f"mpicoll.torch engine stopped: {exc}"))

    def _drain(self) -> list:
        """Every request queued now, without waiting (wake-up markers dropped)."""
        items = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)

    def _loop(self) -> None:
        from .execute import execute  # noqa: PLC0415  (import cycle)

        negotiator = Negotiator(self.size)
        new: list[Work] = []
        last_round = -1.0
        header = np.zeros(2 + SLOT_BYTES // 8, dtype=np.int64)
        headers = np.zeros((self.size, header.size), dtype=np.int64)
        slot = header.view(np.uint8)[16:]
        stall_after = self.settings.stall_check_time
        while not self.stopping:
            if not new and not negotiator.busy():
                item = self._queue.get()
                if item is not None:
                    new.append(item)
                continue
            if not self.overlap:
                self._defer(new, time.monotonic() + _MAX_DEFER_SECONDS)
            # Wait out the cycle so that requests close together fuse, unless this rank's
            # user thread is already blocked on a result (then nothing more is coming).
            blocked = self._blocked()
            pause = last_round + self.settings.cycle_time - time.monotonic()
            if pause > 0 and not blocked:
                time.sleep(pause)
                blocked = self._blocked()
            header[1] = blocked                  # read before draining: see negotiation.py
            new.extend(self._drain())
            last_round = time.monotonic()
            metas = [w.meta for w in new]
            data = pickle.dumps(metas, protocol=pickle.HIGHEST_PROTOCOL) \
                if metas and self.size > 1 else b""
            header[0] = len(data)
            if len(data) <= SLOT_BYTES:
                slot[:len(data)] = np.frombuffer(data, dtype=np.uint8)
            for work in new:
                self.local[JOIN if work.meta.kind == "join" else work.meta.name] = work
            new = []
            if self.size == 1:
                headers[0, :2] = header[:2]
                payloads = [metas]               # one rank: nothing to exchange
            else:
                self._poll(self.comm.Iallgather(header, headers), stall_after)
                payloads = self._payloads(data, headers)
            responses = negotiator.process(payloads, [bool(b) for b in headers[:, 1]])
            if responses:
                execute(self, responses)
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

    def _defer(self, new: list, deadline: float) -> None:
        """Without overlap: wait for the user thread to block, a poke, or ``deadline``
        (pushed back by every new request: gradients still arriving mean backward runs)."""
        while not self._poked and not self._blocked():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if item is not None:
                new.append(item)
                deadline = time.monotonic() + _MAX_DEFER_SECONDS
        self._poked = False

    def _payloads(self, data: bytes, headers: np.ndarray) -> list[list[Meta]]:
        """Every rank's requests of this round, from the records (and the ``v`` fallback)."""
        counts = [int(c) for c in headers[:, 0]]
        if max(counts) <= SLOT_BYTES:
            slots = headers.view(np.uint8)[:, 16:]
            return [pickle.loads(slots[r, :c].tobytes()) if c else []
                    for r, c in enumerate(counts)]
        displs = [0] * self.size
        for r in range(1, self.size):
            displs[r] = displs[r - 1] + counts[r - 1]
        recv = np.empty(sum(counts), dtype=np.uint8)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
        self.comm.Allgatherv(send, [recv, (counts, displs), MPI.BYTE])
        return [pickle.loads(recv[d:d + c].tobytes()) if c else []
                for d, c in zip(displs, counts)]

    def _poll(self, request: MPI.Request, stall_after: float) -> None:
        """Complete ``request``: test and yield, then sleep between tests once it has taken
        a while (a rank waiting for slower ranks must not take their CPU)."""
        spins = 0
        delay = 20e-6
        start = warned = time.monotonic()
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
            if stall_after > 0:
                now = time.monotonic()
                if now - warned >= stall_after:
                    warned = now
                    stall_log.warning("stall: rank %d has waited %.0f s for the other ranks to "
                                      "negotiate (its requests in flight: %s)", self.rank,
                                      now - start, sorted(self.local) or "none")
