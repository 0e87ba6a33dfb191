"""Exceptions raised by mpicoll.

Bad arguments on one rank raise the builtin :class:`ValueError` or :class:`TypeError`
(naming the argument). Failures that involve other ranks raise a subclass of
:class:`CollectiveError`; where the failure is detected by an agreement step, every rank
raises the same error.
"""
from __future__ import annotations

__all__ = ["CollectiveError", "MismatchError", "RemoteError", "ProcessFailedError",
           "TooFewRanksError", "ResetLimitError", "CollectiveTimeoutError",
           "HostsUpdatedInterrupt"]


class CollectiveError(RuntimeError):
    """A collective operation failed in a way that involves more than one rank."""


class MismatchError(CollectiveError):
    """Ranks called the same collective with arguments that do not agree.

    Attributes:
        details: one line per disagreement, naming the ranks and their values.
    """

    def __init__(self, message: str, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.details = list(details or [])


class RemoteError(CollectiveError):
    """Another rank rejected its arguments to a collective that this rank also called.

    Attributes:
        errors: mapping rank -> the error message that rank raised locally.
    """

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})


class ProcessFailedError(CollectiveError):
    """A peer process died during a collective (detected by ULFM; see :mod:`mpicoll.runtime.failures`).

    Raised on every surviving rank of the communicator the collective ran on; mpicoll has
    revoked its communicators for that communicator, so nothing more runs on it.

    Attributes:
        failed_ranks: the ranks (of the communicator passed to the collective) known to
            have failed, sorted.
    """

    def __init__(self, message: str, failed_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = sorted(failed_ranks or [])


class TooFewRanksError(CollectiveError):
    """After a failure, fewer ranks survive than the job's ``min_np``
    (:mod:`mpicoll.elastic`): raised on every survivor, which then ends.

    Attributes:
        size: how many ranks survived. min_np: the least the job accepts.
        failed_ranks: the ranks (of the communicator before the failure) that failed.
    """

    def __init__(self, message: str, size: int, min_np: int,
                 failed_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.size, self.min_np = size, min_np
        self.failed_ranks = sorted(failed_ranks or [])


class ResetLimitError(CollectiveError):
    """An elastic job was reset more often than its ``reset_limit``
    (:func:`mpicoll.elastic.run`): raised on every rank, which then ends (Horovod's
    ``--reset-limit``).

    Attributes:
        resets: how many resets the job went through. limit: its ``reset_limit``.
    """

    def __init__(self, message: str, resets: int, limit: int) -> None:
        super().__init__(message)
        self.resets, self.limit = resets, limit


class CollectiveTimeoutError(CollectiveError):
    """A wait on an operation ran past its timeout (:meth:`mpicoll.runtime.Work.wait`).
    The operation's lane (a process group, the engine) is then broken: under ULFM its
    communicators are revoked and it can be rebuilt; without, using it again ends the job.

    Attributes:
        operation: the operation's name. missing: the ranks known not to have arrived
            (``[]``: not known).
    """

    def __init__(self, message: str, operation: str = "",
                 missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.operation = operation
        self.missing = sorted(missing or [])


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's interruption of an elastic function when hosts were added or removed
    (:mod:`mpicoll.elastic`); the function is reset and run again.

    Attributes:
        skip_sync: whether the state need not be synchronised before running again
            (Horovod sets it when hosts were only removed: every remaining rank's state is
            already the same; a growth never skips it, the new ranks need the state).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync
