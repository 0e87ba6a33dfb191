"""Validated calls, cached so that a repeated collective on the same buffers skips validation.

Validating a call (flat views, dtype and size checks, op and algorithm resolution, binding
the algorithm to its buffers) costs a few microseconds of Python, more than a small
all-reduce itself. Training loops call the same collective on the same arrays over and
over, so each validated call is kept as a ready-to-run closure, keyed by the *identity* of
its arguments (``id`` of the arrays, op, algorithm, root and communicator objects), and
a repeated call runs that closure directly (under half a microsecond of Python on top of
the MPI call).

Why identity is safe: an entry holds strong references to every object it is keyed by, so
no other object can take one of their ``id``s while the entry lives, and a numpy array that
is referenced cannot be resized in place. Consequences and limits:

- only exact ``numpy.ndarray`` buffers (and ``IN_PLACE``/``None``) are cached; buffer
  specifications such as ``[array, MPI.FLOAT]`` lists can be mutated and never are;
- an entry keeps its arrays alive until it is evicted: at most :data:`MAX_ENTRIES` entries
  and :data:`MAX_BYTES` bytes of arrays are held (oldest entry evicted first); calls with
  bigger buffers are not cached (validation is negligible next to moving them);
- an output buffer made read-only after it was cached is re-validated (and refused);
- :func:`invalidate` forgets everything when a setting the call depends on changes
  (:func:`mpicoll.config.refresh`, a new tuning table) and when a communicator is freed.

Checked mode never uses the cache: its agreement step runs on every call.

**Calls by shape** (:func:`run_shaped`): a loop that passes a *new* array each time (a
fresh gradient, ``y = allreduce(x * 2)``) never hits the identity cache. For the
all-reduce, the slow path also keeps a *shaped* call: the same validated choices
(algorithm, options, op, scaling) as a function of the buffers, keyed by the shape and
dtype of the arrays and the identity of the other arguments. A new array of a known shape
and dtype then costs a dictionary lookup and a few flag checks (C-contiguous, writable
output, no overlap) instead of the whole validation; anything else (another layout, an
overlap, in place, a buffer specification) goes back to the slow path, which validates and
raises as usual. No array is held: only the shapes and the argument objects, which the
entry keeps alive as the identity cache does. :func:`invalidate` forgets these too.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .ops import Op

__all__ = ["run_cached", "run_shaped", "store_shaped", "MISS", "key", "lookup", "store",
           "invalidate", "MAX_ENTRIES", "MAX_BYTES"]

#: Cached calls kept at most (oldest dropped first).
MAX_ENTRIES = 64
#: Bytes of arrays the cache may keep alive; a call holding more is not cached.
MAX_BYTES = 64 * 1024 * 1024

# key -> (run, result, output array to re-check for writability or None, held args, bytes)
_calls: dict[tuple, tuple] = {}
_held_bytes = 0
# (collective, send shape, send dtype, recv shape or None, id(arg)...) -> (fn, held args)
_shaped: dict[tuple, tuple] = {}
_lock = threading.Lock()
_VALUE_TYPES = (str, int, type(None), type(MPI.IN_PLACE))


#: What :func:`run_cached` returns when there is no usable cached call.
MISS = object()


def key(collective: str, *args: Any) -> tuple:
    """The cache key of a call: ``(collective, id(arg0), id(arg1), ...)``.

    Public functions build this tuple inline on their hot path (a call to this function
    costs as much as the lookup itself); :func:`store` and :func:`lookup` use this one.
    """
    return (collective, *map(id, args))


def run_cached(call_key: tuple) -> Any:
    """Run the call cached under ``call_key`` (see :func:`key`); return its result.

    The hot path of every public collective and :class:`mpicoll.Comm` method.

    Returns:
        The call's result, or :data:`MISS` when nothing usable is cached (no entry, or its
        output has been made read-only since): the caller then takes the slow path
        (:func:`mpicoll.collectives.dispatch`), which validates, caches and runs the call.
    """
    entry = _calls.get(call_key)
    if entry is None or (entry[2] is not None and not entry[2].flags.writeable):
        return MISS
    made = entry[0]()
    return entry[1] if made is None else made


def run_shaped(collective: str, sendbuf: Any, recvbuf: Any, *rest: Any) -> Any:
    """Run the shaped call kept for arrays shaped like these (see the module docstring).

    ``rest`` are the other arguments the call depends on (op, algorithm, communicator),
    compared by identity. Returns the result, or :data:`MISS` when none applies (no entry;
    not exact numpy arrays; the entry refused this layout): the caller takes the slow path.
    """
    if type(sendbuf) is not np.ndarray:
        return MISS
    if recvbuf is None:
        entry = _shaped.get((collective, sendbuf.shape, sendbuf.dtype, None, *map(id, rest)))
    elif type(recvbuf) is np.ndarray:
        entry = _shaped.get((collective, sendbuf.shape, sendbuf.dtype, recvbuf.shape,
                             *map(id, rest)))
    else:
        return MISS
    if entry is None:
        return MISS
    return entry[0](sendbuf, recvbuf)


def store_shaped(collective: str, sendbuf: Any, recvbuf: Any, rest: tuple,
                 fn: Callable[[Any, Any], Any]) -> None:
    """Keep ``fn(sendbuf, recvbuf)`` for later arrays shaped like these (or no recvbuf).

    ``fn`` returns the result or :data:`MISS` when it refuses the arrays it is given.
    Only exact numpy arrays key an entry; ``rest`` (compared by identity) is held alive.
    """
    if type(sendbuf) is not np.ndarray or not (recvbuf is None or
                                               type(recvbuf) is np.ndarray):
        return
    if any(_cacheable(arg) != 0 for arg in rest):
        return
    shape = None if recvbuf is None else recvbuf.shape
    call_key = (collective, sendbuf.shape, sendbuf.dtype, shape, *map(id, rest))
    with _lock:
        _shaped.pop(call_key, None)
        while len(_shaped) >= MAX_ENTRIES:
            _shaped.pop(next(iter(_shaped)))
        _shaped[call_key] = (fn, rest)


def lookup(collective: str, *args: Any) -> tuple | None:
    """The cached entry (``(run, result, ...)``) for exactly these argument objects, or
    ``None`` when :func:`run_cached` would miss. For tests and diagnostics."""
    entry = _calls.get(key(collective, *args))
    if entry is None or (entry[2] is not None and not entry[2].flags.writeable):
        return None
    return entry


def _cacheable(arg: Any) -> int | None:
    """Bytes ``arg`` keeps alive if it may key a cached call, ``None`` if it may not."""
    if type(arg) is np.ndarray:
        return arg.nbytes
    if isinstance(arg, _VALUE_TYPES) or isinstance(arg, (MPI.Op, MPI.Comm, Op)):
        return 0
    return None


def store(collective: str, args: tuple, run: Callable[[], Any], result: Any,
          output: Any = None) -> None:
    """Cache ``run`` (and the ``result`` to return) for these argument objects.

    Args:
        collective: a name that, with ``args``, identifies the call.
        args: every argument the call depends on (buffers, op, root, algorithm, comm).
        run: performs the validated collective; returns ``None``, or the result itself
            when each call makes a new one (then ``result`` is ``None``).
        result: what the public function returns.
        output: the numpy array written by ``run``; re-checked for writability on a hit.
    """
    global _held_bytes
    nbytes = 0
    for arg in args:
        held = _cacheable(arg)
        if held is None:
            return
        nbytes += held
    if nbytes > MAX_BYTES // 4:
        return
    call_key = key(collective, *args)
    out = output if type(output) is np.ndarray else None
    with _lock:
        old = _calls.pop(call_key, None)
        if old is not None:
            _held_bytes -= old[4]
        while _calls and (len(_calls) >= MAX_ENTRIES or _held_bytes + nbytes > MAX_BYTES):
            _held_bytes -= _calls.pop(next(iter(_calls)))[4]
        _calls[call_key] = (run, result, out, args, nbytes)
        _held_bytes += nbytes


def invalidate() -> None:
    """Forget every cached call (settings that choose algorithms have changed)."""
    global _held_bytes
    with _lock:
        _calls.clear()
        _shaped.clear()
        _held_bytes = 0
