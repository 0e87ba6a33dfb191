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
- an array whose ``dtype`` is reassigned in place (``a.dtype = np.int64``) after it was
  cached is not: the cached call reinterprets its bytes as the old dtype (checking it
  would cost every call; use a new view, ``a.view(np.int64)``, which is a new array);
- :func:`invalidate` forgets everything when a setting the call depends on changes
  (:func:`mpicoll.config.refresh`, a new tuning table) and when a communicator is freed.

Checked mode never uses the cache: its agreement step runs on every call.

**Calls by shape** (:func:`run_fast`'s second lookup): a loop that passes a *new* array
each time (a fresh gradient, ``y = allreduce(x * 2)``) never hits the identity cache. So
the slow path of every collective and :class:`mpicoll.Comm` method also keeps a *call by
shape*: the planned call as a function of new arrays (:class:`Shaped`: the algorithm bound to
everything but the arrays, native MPI with its count, datatype and op found once; the
final scaling; how a new output is allocated), keyed by the shapes and dtype of the
arrays and the identity of the other arguments. A new array of a known shape then costs
a dictionary lookup and the checks a new array can fail (:func:`by_shape`: C-contiguous,
writable output of the planned dtype, no overlap) instead of the whole validation;
anything else (another layout, an overlap, in place, a buffer specification) goes back to
the slow path, which validates and raises as usual. No array is held, apart from the last
call's (to notice the same arrays coming back: those go to the identity cache); only the
shapes and the argument objects, which the entry keeps alive as the identity cache does.
:func:`invalidate` forgets these too.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from .ops import Op

__all__ = ["run_fast", "store_shaped", "by_shape", "Shaped", "OUTPUT", "INPUT_ONLY",
           "INOUT", "MISS", "ARITY", "key", "lookup", "store", "invalidate", "MAX_ENTRIES",
           "MAX_BYTES", "KEEP_LAST_BYTES"]

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


#: What :func:`run_fast` returns when there is no usable cached call.
MISS = object()


#: Argument objects a key holds: every call's are padded with ``None`` to this many (the
#: hot path, :func:`run_fast`, then builds its keys without ``map`` or ``*``).
ARITY = 6
_NONE = id(None)


def _padded(args: tuple) -> tuple:
    if len(args) > ARITY:
        raise ValueError(f"a cached call takes at most {ARITY} arguments, not {len(args)}")
    return args + (None,) * (ARITY - len(args))


def key(collective: str, *args: Any) -> tuple:
    """The cache key of a call: ``(collective, id(arg0), id(arg1), ...)``, the arguments
    padded with ``None`` to :data:`ARITY`: the key :func:`run_fast` builds."""
    return (collective, *map(id, _padded(args)))


def run_fast(check: Any, collective: str, a: Any, b: Any, c: Any = None, d: Any = None,
             e: Any = None, f: Any = None) -> Any:
    """The hot path of every public collective and :class:`mpicoll.Comm` method: run the
    call cached for exactly these argument objects (:func:`store`), else the call by shape
    kept for arrays shaped like ``a`` and ``b`` (:func:`store_shaped`); return its result.

    Args:
        check: the call's ``check``: when true, nothing runs (checked calls are never
            cached: their agreement step runs on every call).
        collective: the name the call is stored under.
        a, b: the two buffers (``b`` is ``None`` for a broadcast's one).
        c, d, e, f: the other arguments the call depends on (op, root, algorithm,
            communicator), compared by identity; unused ones ``None``.
    Returns:
        The call's result, or :data:`MISS` when nothing applies (checked; no entry; its
        output has been made read-only since; the call by shape refused the arrays): the
        caller then takes the slow path (:func:`mpicoll.collectives.dispatch`), which
        validates, caches and runs the call.
    """
    if check:
        return MISS
    # (the trailing arguments are often the None of a default: its id without a call)
    d = _NONE if d is None else id(d)
    e = _NONE if e is None else id(e)
    f = _NONE if f is None else id(f)
    entry = _calls.get((collective, id(a), id(b), id(c), d, e, f))
    if entry is not None and (entry[2] is None or entry[2].flags.writeable):
        made = entry[0]()
        return entry[1] if made is None else made
    if type(a) is not np.ndarray:
        return MISS
    if b is None:
        entry = _shaped.get((collective, a.shape, a.dtype, None, id(c), d, e, f))
    elif type(b) is np.ndarray:
        entry = _shaped.get((collective, a.shape, a.dtype, b.shape, id(c), d, e, f))
    else:
        return MISS
    if entry is None:
        return MISS
    return entry[0](a, b)


#: What the second buffer of a call by shape is (:attr:`Shaped.mode`): an output
#: (``None``: allocated per call), ignored (a reduce off its root: the result is ``None``),
#: or absent, the first buffer being the result (a broadcast).
OUTPUT, INPUT_ONLY, INOUT = 0, 1, 2


class Shaped(NamedTuple):
    """A planned call as a function of new arrays of the same shapes (:func:`by_shape`).

    Attributes:
        run: ``run(a, out)`` performs the planned collective (trivial cases and final
            scaling included) on C-contiguous arrays of any shape with the planned sizes
            and dtype; ``out`` is ``None`` unless ``mode`` is :data:`OUTPUT`.
        dtype: the output's dtype (also the input's: the key holds it).
        new_shape: the shape of the output allocated when the call passes none.
        mode: :data:`OUTPUT`, :data:`INPUT_ONLY` or :data:`INOUT`.
        writable: with :data:`INOUT`, whether the buffer is written (not a broadcast's
            root).
    """

    run: Callable[[Any, Any], Any]
    dtype: Any
    new_shape: tuple | None = None
    mode: int = OUTPUT
    writable: bool = True


#: Arrays up to this size are remembered by a call by shape (to notice them coming back).
KEEP_LAST_BYTES = MAX_BYTES // 4


def by_shape(spec: Shaped) -> Callable[[Any, Any], Any]:
    """``spec.run`` behind the checks a new array can fail: what :func:`store_shaped` keeps.

    The returned ``call(a, b)`` (numpy arrays whose shapes and first dtype match the
    plan, :func:`run_fast` saw to that) runs the call and returns its result when ``a``
    is C-contiguous and, for an :data:`OUTPUT`, ``b`` is ``None`` (a new array of
    ``new_shape`` is the result) or a writable C-contiguous array of ``dtype`` that does
    not overlap ``a``; for an :data:`INOUT`, ``a`` is writable where written. Anything
    else returns :data:`MISS` before anything runs (the slow path validates it and
    raises). So do the arrays of the previous call coming back: the slow path then caches
    them by identity (cheaper), so a loop over the same arrays ends up there even after
    its entry was evicted.
    """
    run, dtype, new_shape, mode, writable = spec
    empty = np.empty
    overlap = np.may_share_memory
    last: list = [None, None]  # the arrays of the last call, when small enough to keep

    def call(a: Any, b: Any) -> Any:
        if a is last[0] and b is last[1]:
            last[0] = None
            return MISS
        flags = a.flags
        if not flags.c_contiguous:
            return MISS
        if mode == OUTPUT:
            if b is None:
                out = empty(new_shape, dtype)
            else:
                out_flags = b.flags
                if (not out_flags.c_contiguous or not out_flags.writeable
                        or (b.dtype is not dtype and b.dtype != dtype)
                        # two arrays that each own their memory are apart (cheaper to
                        # see than numpy.may_share_memory's bounds)
                        or b is a or not (flags.owndata and out_flags.owndata)
                        and overlap(a, b)):
                    return MISS
                out = b
        elif mode == INOUT and writable and not flags.writeable:
            return MISS
        else:
            out = None
        if a.nbytes <= KEEP_LAST_BYTES:
            last[0], last[1] = a, b
        run(a, out)
        return a if mode == INOUT else out

    return call


def store_shaped(collective: str, sendbuf: Any, recvbuf: Any, rest: tuple,
                 fn: Callable[[Any, Any], Any]) -> None:
    """Keep ``fn(sendbuf, recvbuf)`` (:func:`by_shape`) for later arrays shaped like these.

    ``fn`` returns the result or :data:`MISS` when it refuses the arrays it is given.
    Only exact numpy arrays (``recvbuf`` may be ``None``) key an entry; ``rest``
    (compared by identity) is held alive, and must hold only values that may key a cached
    call (a list of counts may not: it could change in place).
    """
    if type(sendbuf) is not np.ndarray or not (recvbuf is None or
                                               type(recvbuf) is np.ndarray):
        return
    if any(_cacheable(arg) != 0 for arg in rest):
        return
    shape = None if recvbuf is None else recvbuf.shape
    padded = _padded((sendbuf, recvbuf, *rest))
    call_key = (collective, sendbuf.shape, sendbuf.dtype, shape, *map(id, padded[2:]))
    with _lock:
        _shaped.pop(call_key, None)
        while len(_shaped) >= MAX_ENTRIES:
            _shaped.pop(next(iter(_shaped)))
        _shaped[call_key] = (fn, rest)


def lookup(collective: str, *args: Any) -> tuple | None:
    """The cached entry (``(run, result, ...)``) for exactly these argument objects, or
    ``None`` when :func:`run_fast` would find no usable one by identity. For tests and
    diagnostics."""
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
    held = [_cacheable(arg) for arg in args]
    if None in held or (nbytes := sum(held)) > MAX_BYTES // 4:
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
