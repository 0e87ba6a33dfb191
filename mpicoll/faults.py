"""TEMPORARY shim while clients move onto :mod:`mpicoll.runtime` (deleted before landing)."""
from __future__ import annotations

from typing import Any

from .errors import ProcessFailedError
from .runtime import exit as _exit
from .runtime import failures as _f
from .runtime.failures import (ENABLED, FAILED_WAIT_S, OTHER_WAIT_S, available,  # noqa: F401
                               failed_ranks, guard, guard_call, keep_requests, turned_on)

FINALIZE_WAIT_S = _exit.FINALIZE_WAIT_S


def is_process_failure(exc: BaseException) -> bool:
    return _f._error_class(exc) in _f._FAILURE_CLASSES


def revoke_all(comm: Any) -> None:
    _f.revoke(comm)


def note_failure() -> None:
    pass


def translate(exc: BaseException, comm: Any) -> None:
    _f.raise_translated(exc, comm)


def as_process_failure(exc: BaseException, comm: Any) -> ProcessFailedError | None:
    err = _f.translate(exc, comm)
    return err if isinstance(err, ProcessFailedError) else None


def finalize_or_exit(wait_s: float | None = None) -> None:
    _exit.finalize_bounded(wait_s)


def exit_without_finalize() -> None:
    pass


def __getattr__(name: str) -> Any:
    if name == "failure_seen":
        return _exit.failure_seen()
    raise AttributeError(name)
