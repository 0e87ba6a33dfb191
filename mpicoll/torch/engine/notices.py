"""Wake-up calls for a shutdown round: a rank that shuts down tells every other rank.

Negotiation rounds are all-gathers, so a rank's ``shutdown`` request reaches the others in
the next round that *all* ranks make. A rank whose user thread is busy elsewhere makes no
round until it submits something; the rank that shuts down would wait for it in its exit.
So, right before posting the round that carries its ``shutdown``, a rank sends a one-integer
notice to every other rank on the engine's communicator (point-to-point, with a tag of its
own: the engine's rounds there are collectives, which never match a send, and Adasum's
messages have other tags); each engine thread, when idle, looks for a notice every few
hundredths of a second and then makes a round at once. Every rank stops after that round
(see :mod:`mpicoll.torch.engine.negotiation`), and each one then receives exactly the
notices that the round's leaving ranks sent it, on one receive per peer posted at the
start (so no message outlives the communicator, whose context id a later ``init`` may
reuse).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import numpy as np
from mpi4py import MPI

__all__ = ["Notices"]

log = logging.getLogger("mpicoll.torch.engine.notices")

#: The notices' tag on the engine's communicator ("SD"; Adasum uses 0x4144 and 0x4145).
_TAG = 0x5344


class Notices:
    """The notice channel of one engine, on the engine's communicator.

    :meth:`poll` belongs to the engine thread; :meth:`announce` to the thread running the
    round that carries this rank's ``shutdown``; :meth:`close` to the engine thread once the
    engine has stopped.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # one receive per peer: under MPICH 5.0.2, on a communicator spanning processes a
        # growth spawned, a receive from MPI_ANY_SOURCE got its message and then, in about
        # half the runs, never reported completion (each shutdown after a second growth
        # waited out close()'s timeout: 5 s and a warning on every rank)
        self._bufs = {r: np.zeros(1, dtype=np.int64) for r in range(self.size)
                      if r != self.rank}
        self._recvs: dict[int, MPI.Request] = {
            r: self.comm.Irecv(b, source=r, tag=_TAG) for r, b in self._bufs.items()}
        self._sends: list[MPI.Request] = []
        self._announcing = threading.Lock()
        self._mine = np.full(1, self.rank, dtype=np.int64)
        #: Whether a notice has arrived (set by :meth:`poll`).
        self.arrived = False

    def poll(self) -> bool:
        """Whether another rank has announced its shutdown (tests the pending receive)."""
        if not self.arrived:
            for r, req in list(self._recvs.items()):
                if req.Test():
                    del self._recvs[r]
                    self.arrived = True
                    log.debug("rank %d: shutdown notice from rank %d", self.rank, r)
                    break
        return self.arrived

    def announce(self) -> None:
        """Send this rank's notice to every other rank (non-blocking; once, whichever
        thread asks first: the shutting-down thread, or the round that carries it)."""
        with self._announcing:
            if not self._sends and self.comm != MPI.COMM_NULL:
                self._sends = [self.comm.Isend(self._mine, dest=r, tag=_TAG)
                               for r in range(self.size) if r != self.rank]

    def close(self, expected: Iterable[int], timeout: float = 5.0) -> bool:
        """Receive the notices the ranks ``expected`` sent to this rank, cancel the
        receives from the others, and complete this rank's own.

        Args:
            expected: the other ranks that announced (they sent one notice each).
        Returns:
            whether they completed within ``timeout`` seconds (else a rank that announced
            is gone, and the communicator must be left unfreed rather than waited for).
        """
        deadline = time.monotonic() + timeout
        leaving = set(expected)
        requests = list(self._sends)
        for r, req in self._recvs.items():
            if r not in leaving:
                req.Cancel()
            requests.append(req)
        self._recvs = {}
        while not MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                log.warning("rank %d: shutdown notices incomplete after %.0f s; the engine's "
                            "communicator is left as it is", self.rank, timeout)
                return False
            time.sleep(0.001)
        self._sends = []
        return True
