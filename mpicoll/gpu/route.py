"""Where a call with device arrays goes: straight to MPI, or through the staged path.

:func:`device_call` is what :func:`mpicoll.collectives.dispatch` calls when
:func:`mpicoll.gpu.arrays.any_device` finds a device array among the arguments:

- it checks the call's buffers (device and host mixed: ``TypeError`` naming both; a
  non-contiguous device array: ``ValueError``), through the agreement step in checked
  mode so that the other ranks raise too;
- MPI not CUDA-aware (:func:`mpicoll.gpu.detect.cuda_aware`): the call runs through
  :func:`mpicoll.gpu.staging.staged`, whose host collectives are the public function
  itself on numpy chunks; returns ``(True, result)``;
- CUDA-aware: every producing stream is synchronised (CuPy's current stream, the stream in
  ``__cuda_array_interface__`` version 3, torch's current stream; the whole device for
  objects that name none), objects other than CuPy arrays are replaced by zero-copy CuPy
  views, and ``(False, args)`` tells the core to continue down its normal path with them:
  the algorithms hand device pointers to MPI, with no copy to the host.

The device work (awareness, copies, views, synchronisation) is the call's
:class:`mpicoll.gpu.backends.DeviceBackend`: the library's CUDA backend, or one registered
with :func:`mpicoll.gpu.backends.register` (the CPU tests' host stand-ins).
"""
from __future__ import annotations

from typing import Any, Callable

from .. import config
from . import arrays, backends

__all__ = ["device_call", "prepare_aware", "reporter"]


def reporter(collective: str, comm: Any, check: Any) -> Callable[[Exception], Any] | None:
    """In checked mode, a function reporting a local argument error to the other ranks.

    The returned function runs the agreement step with the error (the other ranks, in
    their own agreement step, raise ``RemoteError``) and raises it here.
    """
    use_check = config.check_wanted(check)
    if not use_check:
        return None
    from ..checked import agree  # noqa: PLC0415
    from ..context import get_context, resolve_comm  # noqa: PLC0415

    ctx = get_context(resolve_comm(comm))

    def report(exc: Exception) -> None:
        agree(ctx, exc, collective=collective)
        raise exc  # agree raises it already; never return normally

    return report


def prepare_aware(collective: str, args: tuple) -> tuple:
    """For CUDA-aware MPI: synchronise every producer; CuPy views of the device buffers.

    Args:
        collective, args: as :func:`mpicoll.collectives.dispatch` has them.
    Returns:
        ``args`` with every device buffer a CuPy array (the same memory).
    """
    names = arrays.ARGUMENT_NAMES[collective]
    out = list(args)
    for i, (name, value) in enumerate(zip(names, args)):
        if name in ("sendbuf", "recvbuf", "buf") and arrays.is_device(value):
            out[i] = backends.device_view(value)
    return tuple(out)


def device_call(collective: str, args: tuple, comm: Any, check: Any,
                public: Callable[..., Any], *,
                aware: tuple[bool, str] | None = None, **staged_options: Any) -> tuple[bool, Any]:
    """Route one call that has device arrays.

    Args:
        collective: the collective's name.
        args: :func:`mpicoll.collectives.dispatch`'s ``args`` (the public function's
            arguments without ``comm``/``check``, ``algorithm`` last).
        comm, check: the call's.
        public: the public function (``mpicoll.<collective>``), called on host chunks.
        aware: the CUDA-awareness decision (default: the backend's, for CUDA
            :func:`mpicoll.gpu.detect.cuda_aware`).
        staged_options: passed to :func:`mpicoll.gpu.staging.staged` (``copies``: default
            the backend's).
    Returns:
        ``(True, result)`` when the call ran (staged); ``(False, args)`` when the core
        must run it with these arguments (CUDA-aware MPI).
    Raises:
        TypeError, ValueError: bad buffers on this rank (in checked mode after telling the
            other ranks).
    """
    report = reporter(collective, comm, check)
    try:
        arrays.call_kind(collective, args)
    except (TypeError, ValueError) as exc:
        if report is not None:
            report(exc)
        raise
    backend = backends.backend_of([v for _, v in arrays.buffer_arguments(collective, args)])
    is_aware, _ = backend.aware() if aware is None else aware
    if is_aware:
        return False, prepare_aware(collective, args)
    from . import staging  # noqa: PLC0415

    *data, algorithm = args

    def host_call(host_args: tuple) -> Any:
        return public(*host_args, comm=comm, algorithm=algorithm, check=check)

    return True, staging.staged(collective, tuple(data), host_call, comm=comm,
                                report_error=report, **staged_options)
