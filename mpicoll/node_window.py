"""The node's shared window: the shm all-reduce's slots, and a barrier and a table
exchange that sleep in the kernel.

The ranks of a node map one shared file (:func:`_map_shared`; not an MPI window, whose
free is collective: groups are destroyed in a different order on each rank), in which
every rank owns one part:

- two slots of ``MPICOLL_SHM_CHUNK_BYTES`` (the shm all-reduce's chunks,
  :mod:`mpicoll.algorithms.allreduce_shm`);
- a 32-bit counter on a cache line of its own: the rank's *bell*;
- two mailboxes of :data:`BOX_WORDS` 64-bit integers (:meth:`NodeWindow.exchange`).

**The barrier.** A thread that waits for MPI by polling (:func:`mpicoll.waiting.sleeps`:
a runtime lane, such as a torch.distributed group's) gives the core up between polls in
ever longer sleeps: a peer that arrives late is noticed up to
:data:`mpicoll.waiting.SLEEP_MAX_S` after, and the polls before that spend the core the
late peer needs. gloo's threads instead sleep in the kernel until their data is there. At
:meth:`NodeWindow.barrier` a rank adds one to its counter and wakes the threads asleep on
it (``FUTEX_WAKE``), then waits until every peer's counter has caught up with its own:
on the core for :data:`mpicoll.waiting.SPIN_S`, then asleep in ``FUTEX_WAIT`` on the
first peer still missing, which the kernel ends the moment that peer arrives (or after
:data:`NAP_S`, to look again). No MPI call is made, so every thread waits this way.

Where MPI must stay the authority, the barrier is MPI's (:func:`mpicoll.waiting.barrier`)
and the counters still count: with ``MPICOLL_NODE_WAIT=mpi`` on any rank of the node,
under ULFM (a failed peer or a revoked communicator must
raise from an MPI call, :mod:`mpicoll.runtime.failures`), and off Linux on x86-64 (the
futex system call; x86 keeps a rank's stores in order, so its copies into its slot are
visible before its counter moves). Without ULFM a failed rank ends the job (MPICH's and
Open MPI's launchers kill the others), as it does for a rank blocked in MPI.

The measured effect is in docs/results/ddp_threads.md ("The node's barrier in the kernel").
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import sys
import tempfile
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from . import config, waiting
from .context import CommContext
from .errors import CollectiveError
from .runtime import failures

__all__ = ["BOX_WORDS", "DEFAULT_CHUNK_BYTES", "NAP_S", "NodeWindow", "kernel_waits",
           "node_table", "node_window"]

#: Default slot size per rank (``MPICOLL_SHM_CHUNK_BYTES``).
DEFAULT_CHUNK_BYTES = 1 << 20
#: The 64-bit integers one mailbox holds.
BOX_WORDS = 16
#: The longest a barrier sleeps before it looks at the counters again (seconds).
NAP_S = 1e-3
_ALIGN = 64
_BELL_BYTES = 64
_SYS_FUTEX = 202        # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_ALL = 0x7FFFFFFF
_HALF = 1 << 31
_MASK = (1 << 32) - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
#: How long a barrier sleeps at most before it looks at the counters again.
_NAP = _Timespec(0, int(NAP_S * 1e9))


def _futex_here() -> bool:
    """Linux on x86-64, and not under ULFM (where MPI must stay the barrier)."""
    return _LIBC is not None and not failures.ENABLED


def kernel_waits() -> bool:
    """Whether node barriers can sleep in the kernel here: Linux on x86-64, not under ULFM,
    ``MPICOLL_NODE_WAIT`` not ``mpi``.

    Raises:
        ValueError: ``MPICOLL_NODE_WAIT`` is neither ``kernel`` nor ``mpi``.
    """
    wait = config.env_choice("MPICOLL_NODE_WAIT", ("kernel", "mpi"))   # (checked everywhere)
    return _futex_here() and wait == "kernel"


def _map_shared(node_comm: MPI.Comm, nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeroed memory shared by the ranks of ``node_comm``: a file that the
    node's rank 0 makes in /dev/shm (the temporary folder where there is none), every rank
    maps, and rank 0 removes once all have, so that nothing is left behind however the
    job ends. Collective over ``node_comm``.

    Raises:
        OSError: the file could not be made or mapped on some rank (on every rank).
    """
    path, error, memory = None, None, None
    if node_comm.Get_rank() == 0:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        try:
            fd, path = tempfile.mkstemp(prefix="mpicoll-node-", dir=folder)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"node rank 0: {exc}"
    try:    # (the file goes whatever happens here: a peer may die in these collectives)
        path, error = node_comm.bcast((path, error), root=0)
        if error is None:
            try:
                with open(path, "r+b") as file:
                    memory = mmap.mmap(file.fileno(), nbytes)
            except OSError as exc:
                error = f"node rank {node_comm.Get_rank()}: {exc}"
        errors = [e for e in node_comm.allgather(error) if e]
    finally:
        if node_comm.Get_rank() == 0 and path is not None:
            os.unlink(path)
    if errors:
        if memory is not None:
            memory.close()
        raise OSError(f"mpicoll: the node's shared memory could not be set up: "
                      f"{'; '.join(dict.fromkeys(errors))}")
    return memory


class NodeWindow:
    """The parts of a node's ranks in one shared window (module docstring).

    Collective over ``node_comm``; kept on the communicator's context (never evicted) and
    freed with it. The slot size is the largest any rank of the node asked for, so ranks
    whose settings differ still share one layout.
    """

    def __init__(self, node_comm: MPI.Comm, slot_bytes: int) -> None:
        self.comm = node_comm
        self.rank = node_comm.Get_rank()
        self.size = node_comm.Get_size()
        slot_bytes = node_comm.allreduce(slot_bytes, op=MPI.MAX)
        self.slot_bytes = slot = -(-slot_bytes // _ALIGN) * _ALIGN
        part = 2 * slot + _BELL_BYTES + 16 * BOX_WORDS
        self.memory = _map_shared(node_comm, part * self.size)
        whole = np.frombuffer(self.memory, dtype=np.uint8)
        self.slots, self.bells = [], []
        for r in range(self.size):
            mem = whole[r * part:(r + 1) * part]
            self.slots.append((mem[:slot], mem[slot:2 * slot]))
            self.bells.append(mem[2 * slot:2 * slot + 4].view(np.uint32))
        #: per mailbox, every rank's box (row ``r``: rank ``r``'s) as one strided table
        self.tables = tuple(np.ndarray((self.size, BOX_WORDS), np.int64, self.memory,
                                       2 * slot + _BELL_BYTES + 8 * BOX_WORDS * box,
                                       (part, 8)) for box in (0, 1))
        self.addresses = [bell.ctypes.data for bell in self.bells]
        self.half = 0
        self.exchanges = 0
        #: whether barriers sleep in the kernel: on every rank of the node, or on none
        self.kernel = bool(node_comm.allreduce(int(kernel_waits()), op=MPI.MIN))

    def next_half(self) -> int:
        """The half the next chunk uses (they alternate, across calls too)."""
        half = self.half
        self.half ^= 1
        return half

    def barrier(self) -> None:
        """The node's barrier (module docstring)."""
        # (this call's own references: a window freed by another thread meanwhile, say at
        # a client's shutdown after a peer left, keeps its mapping for them; the wait then
        # ends with an error, not an IndexError or a wait for a peer that has gone)
        bells, addresses = self.bells, self.addresses
        mine = bells[self.rank]
        gen = (int(mine[0]) + 1) & _MASK
        mine[0] = gen
        if not self.kernel:
            waiting.barrier(self.comm)
            return
        _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addresses[self.rank]), _FUTEX_WAKE,
                      _ALL, None, None, 0)
        missing = [r for r in range(self.size) if r != self.rank]
        clock = time.perf_counter
        start = clock()
        while missing:
            peer = missing[0]
            seen = int(bells[peer][0])
            if (seen - gen) & _MASK < _HALF:
                missing.pop(0)
                continue
            if clock() - start < waiting.SPIN_S:
                continue
            _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addresses[peer]), _FUTEX_WAIT,
                          ctypes.c_uint32(seen), ctypes.byref(_NAP), None, 0)
            waiting.check_deadline()
            if self.bells is not bells:
                raise CollectiveError(f"mpicoll: the node's shared window was freed while "
                                      f"this rank waited for rank {peer} of the node in it "
                                      f"(its communicator was freed by another thread: a "
                                      f"client shut down, after a peer left?)")

    def exchange(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` (64-bit integers, at most :data:`BOX_WORDS`), as a table (a
        list of rows) in rank order: an all-gather through the mailboxes and one
        :meth:`barrier`. Collective over the node.
        The mailboxes alternate, so a rank that goes on to the next exchange never
        overwrites a row a slower peer is still reading: that one waits at the barrier."""
        table = self.tables[self.exchanges & 1]   # (this call's: see barrier)
        self.exchanges += 1
        table[self.rank, :len(row)] = row
        self.barrier()
        return table[:, :len(row)].tolist()

    def free(self) -> None:
        """Unmap the window: local, so ranks may free their groups in any order (the
        node communicator's owner frees that)."""
        self.slots, self.bells, self.tables = [], [], ()
        with contextlib.suppress(BufferError):  # a view still held: the mapping goes with it
            self.memory.close()


def node_window(ctx: CommContext) -> NodeWindow:
    """The node's window of ``ctx``, made on its first use (``MPICOLL_SHM_CHUNK_BYTES`` is
    read then). Collective over ``ctx``'s node."""
    def build() -> NodeWindow:
        slot = config.env_int("MPICOLL_SHM_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, minimum=_ALIGN)
        return NodeWindow(ctx.topology.node_comm, slot)

    return ctx.resource("shm_window", build)


def node_table(ctx: CommContext) -> NodeWindow | None:
    """A window without slots for :meth:`NodeWindow.exchange` over ``ctx``, when every rank
    of ``ctx`` shares one node and its barriers sleep in the kernel; else ``None``. Decided
    alike on every rank; collective over ``ctx`` on its first use."""
    if ctx.size == 1 or not _futex_here() or ctx.topology.num_nodes != 1:
        return None
    window = ctx.resource("node_table", lambda: NodeWindow(ctx.topology.node_comm, 0))
    return window if window.kernel else None
