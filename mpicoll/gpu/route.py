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
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .. import config
from . import arrays, detect

__all__ = ["device_call", "prepare_aware", "reporter", "simulated", "simulation",
           "as_device_array", "synchronise"]

#: CPU tests (:func:`simulated`): the copies object (it also makes device views) and the
#: CUDA-awareness decision every device call uses instead of CuPy's and detection's.
_simulation: tuple[Any, tuple[bool, str]] | None = None


@contextlib.contextmanager
def simulated(copies: Any, aware: tuple[bool, str] = (False, "simulated")) -> Iterator[None]:
    """Within: every device call (``mpicoll.<collective>``, :class:`mpicoll.Comm`) runs with
    ``copies`` (e.g. :class:`mpicoll.gpu.simulated.SimulatedCopies`) and ``aware``."""
    global _simulation
    saved, _simulation = _simulation, (copies, aware)
    try:
        yield
    finally:
        _simulation = saved


def simulation() -> tuple[Any, tuple[bool, str]] | None:
    """The ``(copies, aware)`` of :func:`simulated` in force, or ``None``."""
    return _simulation


def reporter(collective: str, comm: Any, check: Any) -> Callable[[Exception], Any] | None:
    """In checked mode, a function reporting a local argument error to the other ranks.

    The returned function runs the agreement step with the error (the other ranks, in
    their own agreement step, raise ``RemoteError``) and raises it here.
    """
    use_check = config.check_enabled() if check is None else bool(check)
    if not use_check:
        return None
    from ..checked import agree  # noqa: PLC0415
    from ..context import get_context, resolve_comm  # noqa: PLC0415

    ctx = get_context(resolve_comm(comm))

    def report(exc: Exception) -> None:
        agree(ctx, exc, collective=collective)
        raise exc  # agree raises it already; never return normally

    return report


def synchronise(obj: Any) -> None:
    """Wait until the stream producing device object ``obj`` has finished (CuPy's current
    stream, the ``stream`` of ``__cuda_array_interface__`` v3, torch's current stream; the
    whole device for objects that name none)."""
    _synchronise(obj)


def _synchronise(obj: Any) -> None:
    import cupy  # noqa: PLC0415

    stream = arrays.producer_stream(obj)
    if stream is not None:
        cupy.cuda.runtime.streamSynchronize(stream)
        return
    cai = arrays.cuda_interface(arrays.unwrap_spec(obj))
    if cai is not None and cai.get("version", 0) >= 3:
        return  # version 3 with stream None: the producer says the data is ready
    cupy.cuda.runtime.deviceSynchronize()  # nothing says which stream: be safe


def as_device_array(obj: Any) -> tuple[Any, Callable[[Any], Any]]:
    """An array view of device object ``obj`` (CuPy; the simulation's arrays in tests)
    and the function that turns a view of it back into a device argument."""
    if _simulation is not None:
        copies = _simulation[0]
        return copies.as_array(obj), copies.wrap
    return _as_cupy(obj), lambda a: a


def _as_cupy(obj: Any) -> Any:
    import cupy  # noqa: PLC0415

    if isinstance(obj, cupy.ndarray) or not arrays.is_device(obj):
        return obj
    if arrays.cuda_interface(obj) is not None:
        return cupy.asarray(obj)
    return cupy.from_dlpack(obj)


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
            _synchronise(value)
            out[i] = _as_cupy(value)
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
        aware: the CUDA-awareness decision (default :func:`detect.cuda_aware`).
        staged_options: passed to :func:`mpicoll.gpu.staging.staged` (tests: ``copies``).
    Returns:
        ``(True, result)`` when the call ran (staged); ``(False, args)`` when the core
        must run it with these arguments (CUDA-aware MPI).
    Raises:
        TypeError, ValueError: bad buffers on this rank (in checked mode after telling the
            other ranks).
    """
    if _simulation is not None:
        aware = _simulation[1] if aware is None else aware
        staged_options.setdefault("copies", _simulation[0])
    report = reporter(collective, comm, check)
    try:
        arrays.call_kind(collective, args)
    except (TypeError, ValueError) as exc:
        if report is not None:
            report(exc)
        raise
    is_aware, _ = detect.cuda_aware() if aware is None else aware
    if is_aware:
        return False, prepare_aware(collective, args)
    from . import staging  # noqa: PLC0415

    *data, algorithm = args

    def host_call(host_args: tuple) -> Any:
        return public(*host_args, comm=comm, algorithm=algorithm, check=check)

    if comm is None:
        from mpi4py import MPI  # noqa: PLC0415

        world: Any = MPI.COMM_WORLD
    else:
        world = comm
    result = staging.staged(collective, tuple(data), host_call, comm=world,
                            report_error=report, **staged_options)
    return True, result
