"""mpicoll's communication runtime: the one layer that talks to MPI about anything but
message schedules.

- :mod:`.world`: the current world (what ``comm=None`` means) and its failure state
  machine, healthy -> failed(ranks) -> reconfigured; :func:`reconfigure` for shrink and
  growth.
- :mod:`.comms`: every communicator mpicoll makes, made and freed here, with its owner,
  world and lifetime.
- :mod:`.failures`: MPI errors into :class:`~mpicoll.ProcessFailedError`, once; the
  revocation of a failed world's communicators.
- :mod:`.progress`: work off the caller's thread, ``Lane.submit(kind, op) -> Work``, with
  timeouts and abort.
- :mod:`.exit`: the process's exit: what is left of the communicators freed; under ULFM
  never waiting forever for a dead rank, and a rank lost meanwhile in the status.

Clients (the synchronous collectives, the Horovod engine, torch.distributed groups, the
codecs, local SGD, the parameter server, elastic mode) ask the runtime for communicators,
threads and failure handling; they make none of their own.
"""
from __future__ import annotations

from . import comms, exit, failures, progress, world  # noqa: A004
from .progress import Lane, Work
from .world import reconfigure

__all__ = ["comms", "exit", "failures", "progress", "world", "Lane", "Work", "reconfigure"]
