"""The public collectives: validate, agree (checked mode), choose, run, finalize.

Each function validates this rank's arguments (raising ``ValueError``/``TypeError`` that
name the argument, before any message is sent), optionally runs the agreement step of
:mod:`mpicoll.checked`, resolves ``algorithm`` (``"auto"`` through
:mod:`mpicoll.selection`) and runs the registered algorithm on flat views of the buffers.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import numpy as np

from . import buffers, config, fastpath, tracking, validation
from .runtime import failures
from .algorithms.registry import bind, lookup, scales_shards
from .buffers import flat_view, is_array, is_in_place
from .checked import agree
from .context import CommContext, get_context, resolve_comm
from .fastpath import MISS, run_fast
from .gpu.arrays import any_device as _any_device
from .ops import resolve_op
from .selection import algorithm_options, resolve_algorithm

__all__ = ["allreduce", "allreduce_init", "reduce_scatter", "allgather", "broadcast",
           "reduce", "dispatch", "Plan"]


class Plan(NamedTuple):
    """One validated call, ready to run (what each collective's plan function returns).

    A ``NamedTuple``: built on every call that misses the cache, so it must be cheap.

    Attributes:
        run: performs the collective (trivial cases and the final scaling included);
            ``None`` for a fresh result (then ``remake`` runs the call).
        result: what the public function returns (``None`` for a fresh result).
        out: the numpy array ``run`` writes, re-checked for writability on a cache hit
            (``None`` when it writes none).
        fresh: the result is allocated by the call: the call runs, and is cached, through
            ``remake``, or (``remake`` is ``None``) runs ``run`` and is never cached.
        remake: for a fresh result, a callable that allocates a new result, performs the
            collective into it and returns it.
        shaped: the same call as a function of other arrays of the same shapes and dtype
            (:class:`mpicoll.fastpath.Shaped`; ``None`` where none applies, e.g. in
            place): the slow path keeps it behind :func:`mpicoll.fastpath.by_shape`'s
            checks as the call by shape.
        count, dtype, op, root: what checked mode compares across ranks (``op``/``root``
            ``None`` where the collective has none).
        requested: the ``algorithm`` argument; ``algorithm``: the registered name it
            resolved to.
    """

    run: Callable[[], Any] | None
    result: Any
    out: Any
    fresh: bool
    count: int
    dtype: str
    requested: Any
    algorithm: str
    op: str | None = None
    root: int | None = None
    remake: Callable[[], Any] | None = None
    shaped: fastpath.Shaped | None = None


def _noop(*_: Any) -> None:
    """Nothing to run: a step of no arguments, or a ``run(a, out)`` with nothing to move."""


def _chain(*steps: Callable[[], Any] | None) -> Callable[[], Any]:
    """One callable running the given steps (``None`` skipped) in order."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return _noop
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


def _copy_step(dst: Any, src: Any) -> Callable[[], Any] | None:
    return None if dst is src or src is None else functools.partial(buffers.copy, dst, src)


def _finalize_step(opo: Any, out: Any, size: int) -> Callable[[], Any] | None:
    if out is None or not opo.averages or size == 1:
        return None
    return functools.partial(opo.finalize, out, size)


def _resolve(ctx: CommContext, collective: str, algorithm: Any, nbytes: int,
             host: bool = True) -> str:
    return resolve_algorithm(collective, algorithm, ctx.size, ctx.ranks_per_node, nbytes,
                             host)


def _planned(ctx: CommContext, collective: str, args: tuple, check: Any) -> Plan:
    """This rank's plan of the call; in checked mode, after every rank agreed on it."""
    use_check = config.check_wanted(check)
    try:
        plan = _PLANS[collective](ctx, *args)
    except (TypeError, ValueError) as exc:
        if use_check:
            agree(ctx, exc, collective=collective)  # raises: a rank reported an error
        raise
    if use_check:
        agree(ctx, None, collective=collective, count=plan.count, dtype=plan.dtype,
              op=plan.op, root=plan.root, algorithm=plan.requested, resolved=plan.algorithm,
              segment_bytes=ctx.segment_bytes)
    return plan


def dispatch(collective: str, args: tuple, comm: Any = None, check: Any = None,
             cache_as: tuple | None = None) -> Any:
    """Plan a call (validate; agree on it when checked), cache it, run it, return its result.

    The slow path of every public collective and :class:`mpicoll.Comm` method, taken when
    :func:`mpicoll.fastpath.run_fast` misses. The collective's plan function
    (``plan(ctx, *args)``, in :data:`_PLANS`) validates this rank's arguments and returns a
    :class:`Plan`. The cache key is ``cache_as`` (a name and the argument objects) or
    ``(collective, args + (comm,))``, a ``None`` inserted after a broadcast's one buffer:
    the same objects, in the same order, that the caller passes to
    :func:`~mpicoll.fastpath.run_fast`.
    """
    if _any_device(args):  # device arrays (mpicoll.gpu): staged, or straight to MPI
        from .gpu import route  # noqa: PLC0415  (GPU modules only from here on)

        ran, value = route.device_call(collective, args, comm, check, _PUBLIC[collective])
        if ran:
            return value
        args = value  # CUDA-aware MPI: producers synchronised, CuPy views of the buffers
    ctx = get_context(resolve_comm(comm))
    # (the stall inspector or the timeline: the tracked plan numbers and describes it)
    plan = (_tracked_plan if tracking.wanted() else _planned)(ctx, collective, args, check)
    cacheable = plan.remake is not None or not plan.fresh
    if cacheable and not check and not config.check_enabled():
        # (checked calls are never cached: the agreement step runs on every call; with
        # MPICOLL_CHECK=1 neither is an explicitly unchecked call, or a later call with
        # the default check=None would skip its agreement step through the cache)
        key, key_args = cache_as if cache_as is not None else (collective, args + (comm,))
        if collective == "broadcast":  # one buffer; the second is None (fastpath.run_fast)
            key_args = (key_args[0], None, *key_args[1:])
        if plan.fresh:
            fastpath.store(key, key_args, plan.remake, None)
        else:
            fastpath.store(key, key_args, plan.run, plan.result, plan.out)
        if plan.shaped is not None:  # the two buffers lead the arguments
            fastpath.store_shaped(key, key_args[0], key_args[1], key_args[2:],
                                  fastpath.by_shape(plan.shaped))
    if plan.remake is not None:
        return plan.remake()
    plan.run()
    return plan.result


def _tracked_plan(ctx: CommContext, collective: str, args: tuple, check: Any) -> Plan:
    """:func:`_planned`, counted as call ``#seq`` while it plans (checked mode's agreement
    step may wait for the other ranks), with its ``run``/``remake`` recorded
    (:func:`mpicoll.tracking.recorded`), which numbers it ``#seq`` again when it runs.
    The call by shape records its ``run`` only, after its checks: a call it refuses (and
    sends to the slow path) is not counted twice."""
    tracker = ctx.tracker
    seq = tracker.begin(tracking.CallInfo(collective))
    try:
        plan = _planned(ctx, collective, args, check)
    finally:
        tracker.entered = seq - 1  # numbered again by the recorded run
    info = tracking.CallInfo(collective, plan.count, plan.dtype, plan.op, plan.root,
                             plan.requested, plan.algorithm,
                             plan.count * np.dtype(plan.dtype).itemsize)
    shaped = plan.shaped and plan.shaped._replace(
        run=tracking.recorded(tracker, info, plan.shaped.run))
    if plan.remake is not None:
        return plan._replace(remake=tracking.recorded(tracker, info, plan.remake),
                             shaped=shaped)
    return plan._replace(run=tracking.recorded(tracker, info, plan.run or _noop),
                         shaped=shaped)


def _allreduce_plan(ctx: CommContext, sendbuf: Any, recvbuf: Any, op: Any,
                    algorithm: Any) -> Plan:
    """The all-reduce of ``send`` into ``recv``, the flat views of ``sendbuf`` and
    ``recvbuf`` (``recv`` ``None``: into a new array shaped like ``result``, the user's
    ``sendbuf``, each time the plan runs)."""
    opo = resolve_op(op)
    send, recv, _ = validation.elementwise(sendbuf, recvbuf, flat_view)
    opo.check_dtype(send.dtype)
    # (recv None: the result is allocated by remake(), shaped like sendbuf)
    result = sendbuf if recv is None else recvbuf
    flat = send if recv is None else recv
    name = _resolve(ctx, "allreduce", algorithm, flat.nbytes, isinstance(flat, np.ndarray))
    options = algorithm_options("allreduce", name, ctx, flat)
    trivial = ctx.size == 1 or flat.size == 0
    scale = opo.averages and ctx.size > 1  # the final division of average, if still due
    if not trivial and scale and scales_shards("allreduce", name):
        options["finalize"] = True   # the algorithm divides each shard once
        scale = False
    fields = (flat.size, flat.dtype.str, algorithm, name)
    if recv is not None:
        run = (_copy_step(recv, send) if trivial
               else bind("allreduce", name, ctx, send, recv, opo, **options))
        plan = Plan(_chain(run, _finalize_step(opo, recv, ctx.size) if scale else None),
                    result, result, False, *fields, op=opo.name)
        if send is recv:  # in place: no call by shape
            return plan
    else:
        plan = Plan(None, None, None, True, *fields, op=opo.name)
    # (send.view(): a stand-in output of the right size and dtype, not send itself,
    # which would mean in place)
    run_on = _run_on(ctx, "allreduce", name, (send, send.view() if recv is None else recv, opo),
                     options, trivial, opo if scale else None)
    return _with_shape(plan, run_on, send, result, recv is None)


def _run_on(ctx: CommContext, collective: str, name: str, args: tuple, options: dict,
            trivial: bool, scale: Any = None) -> Callable[[Any, Any], None]:
    """The planned call as ``run(a, out)`` of other buffers (the calls by shape and the new
    outputs of ``remake``): C-contiguous arrays of any shape with the sizes and dtype of
    the flat views leading ``args`` (``out`` is ``None`` where the plan has no output);
    ``args`` and ``options`` are the algorithm's arguments as planned.

    ``trivial``: one rank (a copy) or nothing to move; ``scale``: the op whose
    ``finalize`` (the division of ``average``) follows the algorithm.
    """
    if trivial:
        run = _copy_flat if ctx.size == 1 else _noop
    else:
        fn = lookup(collective, name)
        binder = getattr(fn, "bind_buffers", None)
        if binder is not None:   # native MPI: its specs and datatype prepared once
            run = binder(ctx, *args, **options)
        elif collective == "broadcast":
            fixed = args[1:]
            run = lambda a, _out: fn(ctx, a.reshape(-1), *fixed, **options)  # noqa: E731
        else:
            fixed = args[2:]
            run = lambda a, out: fn(ctx, a.reshape(-1),  # noqa: E731
                                    None if out is None else out.reshape(-1), *fixed,
                                    **options)
    if scale is None:
        return run
    finalize, size = scale.finalize, ctx.size

    def run_and_scale(a: Any, out: Any) -> None:
        run(a, out)
        finalize(out, size)

    return run_and_scale


def _copy_flat(a: Any, out: Any) -> None:
    if out is not None:
        buffers.copy(out.reshape(-1), a.reshape(-1))


def _with_shape(plan: Plan, run_on: Callable[[Any, Any], None], send: Any, like: Any,
                fresh: bool, shape: tuple | None = None) -> Plan:
    """``plan`` with its call by shape (``run_on`` behind the checks of new arrays) and,
    for a new output each call (``fresh``: the call passed none), ``remake``.

    A new output is shaped ``shape`` (C order), or like ``like`` (the user's
    ``sendbuf``, in its memory order: a Fortran-ordered input gets a Fortran-ordered
    result, as ``numpy.empty_like`` would)."""
    shape = like.shape if shape is None else shape
    plan = plan._replace(shaped=fastpath.Shaped(run_on, send.dtype, shape))
    if not fresh:
        return plan
    empty, dtype = buffers.array_module(send).empty, send.dtype
    if like is None or like.flags.c_contiguous:
        def remake() -> Any:  # y = allreduce(x), cached: a new y each time
            out = empty(shape, dtype)
            run_on(send, out)
            return out
    else:
        def remake() -> Any:
            out = empty(shape, dtype, order="F")
            run_on(send, out.reshape(-1, order="A"))
            return out
    return plan._replace(remake=remake)


def allreduce(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", comm: Any = None,
              algorithm: str = "auto", *, check: bool | None = None,
              compression: Any = None, feedback: Any = None, layout: str = "auto") -> Any:
    """Reduce ``sendbuf`` elementwise over all ranks; every rank gets the result.

    Args:
        sendbuf: this rank's contribution (numpy or CuPy array, any shape, contiguous), or
            :data:`mpicoll.IN_PLACE` / ``None`` to take it from ``recvbuf``.
        recvbuf: output array with as many elements and the same dtype; ``None`` allocates
            one shaped like ``sendbuf``. ``sendbuf is recvbuf`` works in place.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"average"``, ``"band"``,
            ``"bor"``, ``"bxor"``, an mpi4py op (``MPI.SUM`` ...) or an :class:`Op`.
        comm: mpi4py intracommunicator; ``None`` means ``MPI.COMM_WORLD``.
        algorithm: a name from ``mpicoll.algorithms("allreduce")`` or ``"auto"``.
        check: run the cross-rank agreement step (default: ``MPICOLL_CHECK``; with
            ``compression`` the default is on).
        compression: a codec name (``"fp16"``, ``"bf16"``, ``"int8"``, ``"onebit"``,
            ``"topk:0.01"``, ``"randomk:0.01"``) or an :mod:`mpicoll.compression` codec:
            run :func:`mpicoll.compression.allreduce` (float32/float64, op ``"sum"`` or
            ``"average"``, its own ring; ``check`` on by default); ``None`` or
            ``"none"``: uncompressed (``"none"`` with ``check`` on by default too).
        feedback: with ``compression``, the :class:`mpicoll.compression.ErrorFeedback`
            holding this tensor's residual (default: kept with ``sendbuf``).
        layout: with ``compression``, ``"auto"``, ``"flat"`` or ``"node"`` (compress only
            between nodes); see :func:`mpicoll.compression.allreduce`. Without
            ``compression`` only ``"auto"`` is accepted.
    Returns:
        The result array (``recvbuf`` when given). Every rank's result is bit-identical.
    Raises:
        TypeError, ValueError: bad arguments on this rank (before any message).
        mpicoll.CollectiveError: in checked mode, another rank's bad arguments, or ranks
            that disagree.
    """
    if compression is not None:
        if compression != "none":
            return _compressed("allreduce", algorithm, compression, sendbuf, recvbuf, op=op,
                               comm=comm, feedback=feedback, layout=layout, check=check)
        check = True if check is None else check  # (as a codec's: see _compressed)
    if layout != "auto" and compression is None:  # ("none": layout is not looked at)
        raise ValueError(f"layout={layout!r} applies only with compression=; the "
                         f"uncompressed all-reduce chooses its algorithm with algorithm=")
    result = run_fast(check, "allreduce", sendbuf, recvbuf, op, algorithm, comm)
    if result is not MISS:
        return result
    return dispatch("allreduce", (sendbuf, recvbuf, op, algorithm), comm, check)


def allreduce_init(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", comm: Any = None,
                   algorithm: str = "auto", *, check: bool | None = None) -> Callable[[], Any]:
    """Plan an all-reduce once; return ``call`` that runs it (``MPI_Allreduce_init``'s idea).

    ``call()`` performs the all-reduce of the current contents of ``sendbuf`` into
    ``recvbuf`` and returns ``recvbuf``: no lookup, no validation, nothing but the
    algorithm. Collective like the all-reduce itself, on every call and at planning (in
    checked mode the agreement step runs once, here).

    Args:
        sendbuf, recvbuf, op, comm, algorithm, check: as for :func:`allreduce`, except that
            ``recvbuf=None`` allocates one output here, which every ``call()`` reuses.
    Returns:
        ``call``, a function of no arguments.
    Raises:
        TypeError, ValueError, mpicoll.CollectiveError: as for :func:`allreduce`.
    """
    if _any_device((sendbuf, recvbuf)):  # device arrays: each call through dispatch
        return lambda: allreduce(sendbuf, recvbuf, op, comm, algorithm, check=check)
    if recvbuf is None and not is_in_place(sendbuf):
        recvbuf = buffers.array_module(sendbuf).empty_like(sendbuf)
    ctx = get_context(resolve_comm(comm))
    args = (sendbuf, recvbuf, op, algorithm)
    plan = (_tracked_plan if tracking.wanted() else _planned)(ctx, "allreduce", args, check)
    run, result = plan.run, plan.result

    def call() -> Any:
        run()
        return result

    return failures.guard(call, comm=comm) if failures.ENABLED else call


def _reduce_scatter_plan(ctx: CommContext, sendbuf: Any, recvbuf: Any, op: Any,
                         algorithm: Any) -> Plan:
    send, recv, in_place = validation.reduce_scatter(sendbuf, recvbuf, ctx.rank, ctx.size,
                                                     flat_view)
    refill, result = None, recvbuf
    if in_place:
        # the algorithms need the input apart from the output: a scratch copy, refilled
        # at every call (allocated once per cached call)
        full, send = send, buffers.empty(send.size, send.dtype, send)
        refill = _copy_step(send, full)
        result = recv
    elif recv is None:
        result = recv = buffers.empty(validation.own_block(send.size, ctx.rank, ctx.size),
                                      send.dtype, send)
    opo = resolve_op(op)
    opo.check_dtype(send.dtype)
    name = _resolve(ctx, "reduce_scatter", algorithm, send.nbytes)
    if ctx.size == 1:
        run = _chain(refill, _copy_step(recv, send))
    elif send.size:
        run = _chain(refill, bind("reduce_scatter", name, ctx, send, recv, opo))
    else:
        run = None
    plan = Plan(_chain(run, _finalize_step(opo, recv, ctx.size)), result, recvbuf,
                recvbuf is None, send.size, send.dtype.str, algorithm, name, op=opo.name)
    if refill is not None:
        return plan
    run_on = _run_on(ctx, "reduce_scatter", name, (send, recv, opo), {},
                     ctx.size == 1 or not send.size,
                     opo if opo.averages and ctx.size > 1 else None)
    return _with_shape(plan, run_on, send, None, recvbuf is None, recv.shape)


def reduce_scatter(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", comm: Any = None,
                   algorithm: str = "auto", *, check: bool | None = None,
                   compression: Any = None, feedback: Any = None) -> Any:
    """Reduce ``sendbuf`` over all ranks; rank ``i`` gets block ``i`` of the result.

    Blocks follow ``numpy.array_split(range(count), size)``: ``count // size`` elements,
    one more for the first ``count % size`` ranks.

    Args:
        sendbuf: the full vector (``count`` elements), or :data:`mpicoll.IN_PLACE` /
            ``None`` to take it from ``recvbuf`` (then the block is left in the first
            elements of ``recvbuf``, as MPI does).
        recvbuf: this rank's block (flat, or any shape with that many elements); ``None``
            allocates a flat array.
        op, comm, algorithm, check: as for :func:`allreduce`.
        compression, feedback: as for :func:`allreduce`: run
            :func:`mpicoll.compression.reduce_scatter` (float32/float64, op ``"sum"`` or
            ``"average"``; error feedback on by default for lossy codecs).
    Returns:
        This rank's block of the result.
    Raises:
        TypeError, ValueError, mpicoll.CollectiveError: as for :func:`allreduce`.
    """
    if compression is not None:
        if compression != "none":
            return _compressed("reduce_scatter", algorithm, compression, sendbuf, recvbuf,
                               op=op, comm=comm, feedback=feedback, check=check)
        check = True if check is None else check  # (as a codec's: see _compressed)
    result = run_fast(check, "reduce_scatter", sendbuf, recvbuf, op, algorithm, comm)
    if result is not MISS:
        return result
    return dispatch("reduce_scatter", (sendbuf, recvbuf, op, algorithm), comm, check)


def _allgather_plan(ctx: CommContext, sendbuf: Any, recvbuf: Any, algorithm: Any) -> Plan:
    if (recvbuf is None and is_array(sendbuf) and sendbuf.ndim > 1
            and not sendbuf.flags.c_contiguous and sendbuf.flags.f_contiguous):
        # a Fortran-ordered block into rows of a new result: its elements in C order (a
        # copy on every call, never cached: the cached call would send the old copy)
        plan = _allgather_plan(ctx, buffers.array_module(sendbuf).ascontiguousarray(sendbuf),
                               None, algorithm)
        return plan._replace(remake=None, shaped=None)
    send, recv, in_place = validation.allgather(sendbuf, recvbuf, ctx.rank, ctx.size,
                                                flat_view)
    result = recvbuf
    if in_place:
        send = None  # (the algorithms find this rank's block in place)
    elif recv is None:
        result = buffers.array_module(sendbuf).empty(
            validation.gathered_shape(sendbuf.shape, ctx.size), dtype=sendbuf.dtype)
        recv = flat_view(result, "recvbuf", writable=True)
    name = _resolve(ctx, "allgather", algorithm, recv.nbytes)
    if ctx.size == 1:
        run = _copy_step(recv, send)
    else:
        run = bind("allgather", name, ctx, send, recv) if recv.size else None
    plan = Plan(_chain(run), result, recvbuf, recvbuf is None, recv.size // ctx.size,
                recv.dtype.str, algorithm, name)
    if send is None:
        return plan
    run_on = _run_on(ctx, "allgather", name, (send, recv), {},
                     ctx.size == 1 or not recv.size)
    return _with_shape(plan, run_on, send, None, recvbuf is None, result.shape)


def allgather(sendbuf: Any, recvbuf: Any = None, comm: Any = None, algorithm: str = "auto",
              *, check: bool | None = None, compression: Any = None,
              feedback: Any = None) -> Any:
    """Gather every rank's ``sendbuf`` (same size everywhere) to every rank, in rank order.

    Args:
        sendbuf: this rank's block, or :data:`mpicoll.IN_PLACE` / ``None`` when the block is
            already at position ``rank`` of ``recvbuf``.
        recvbuf: ``size`` times as many elements, same dtype; ``None`` allocates one shaped
            ``(size * sendbuf.shape[0], *sendbuf.shape[1:])`` (``(size,)`` for 0-d input),
            in C order, whose rows are every rank's ``sendbuf`` in rank order, whatever its
            memory order (a Fortran-ordered one is copied to C order first).
        comm, algorithm, check: as for :func:`allreduce`.
        compression: as for :func:`allreduce`: run :func:`mpicoll.compression.allgather`
            (float32/float64; every rank decodes every block from the same bytes).
        feedback: with ``compression``, error feedback on this rank's block: off by
            default (``None``/``False``), ``True`` or an
            :class:`mpicoll.compression.ErrorFeedback` turn it on.
    Returns:
        The gathered array (``recvbuf`` when given).
    Raises:
        TypeError, ValueError, mpicoll.CollectiveError: as for :func:`allreduce`.
    """
    if compression is not None:
        if compression != "none":
            return _compressed("allgather", algorithm, compression, sendbuf, recvbuf,
                               comm=comm, feedback=feedback, check=check)
        check = True if check is None else check  # (as a codec's: see _compressed)
    result = run_fast(check, "allgather", sendbuf, recvbuf, algorithm, comm)
    if result is not MISS:
        return result
    return dispatch("allgather", (sendbuf, recvbuf, algorithm), comm, check)


def _compressed(name: str, algorithm: Any, compression: Any, *args: Any, **kwargs: Any) -> Any:
    """The call of a collective given ``compression=`` other than ``None`` or ``"none"``
    (those run the uncompressed collective): :mod:`mpicoll.compression`'s collective
    ``name`` on ``args``/``kwargs``. ``check=None`` means on: the compressed collectives
    agree by default, and so does ``"none"`` (ranks naming different codecs, or one rank's
    ``algorithm=``, then raise on every rank instead of waiting in different steps)."""
    if kwargs.get("check") is None:
        kwargs["check"] = True
    if algorithm != "auto":
        exc = ValueError(f"algorithm={algorithm!r} does not apply with compression=; the "
                         f"compressed {name} runs its own schedule")
        if kwargs["check"]:
            agree(get_context(resolve_comm(kwargs["comm"])), exc, collective=name)
        raise exc
    from . import compression as compressed  # noqa: PLC0415  (loaded on first use)

    return getattr(compressed, name)(*args, compression=compression, **kwargs)


def _broadcast_plan(ctx: CommContext, buf: Any, root: Any, algorithm: Any) -> Plan:
    r, flat = validation.broadcast(buf, root, ctx.rank, ctx.size, flat_view)
    name = _resolve(ctx, "broadcast", algorithm, flat.nbytes)
    trivial = ctx.size == 1 or not flat.size
    run = None if trivial else bind("broadcast", name, ctx, flat, r)
    run_on = _noop if trivial else _run_on(ctx, "broadcast", name, (flat, r), {}, False)
    return Plan(_chain(run), buf, buf if ctx.rank != r else None, False, flat.size,
                flat.dtype.str, algorithm, name, root=r,
                shaped=fastpath.Shaped(run_on, flat.dtype, mode=fastpath.INOUT,
                                       writable=ctx.rank != r))


def broadcast(buf: Any, root: int = 0, comm: Any = None, algorithm: str = "auto",
              *, check: bool | None = None) -> Any:
    """Copy ``buf`` from ``root`` to every rank, in place.

    Args:
        buf: the data on ``root``; the output (same size and dtype) elsewhere.
        root: the rank that sends.
        comm, algorithm, check: as for :func:`allreduce`.
    Returns:
        ``buf``.
    Raises:
        TypeError, ValueError, mpicoll.CollectiveError: as for :func:`allreduce`.
    """
    result = run_fast(check, "broadcast", buf, None, root, algorithm, comm)
    if result is not MISS:
        return result
    return dispatch("broadcast", (buf, root, algorithm), comm, check)


def _reduce_plan(ctx: CommContext, sendbuf: Any, recvbuf: Any, op: Any, root: Any,
                 algorithm: Any) -> Plan:
    r, (send, recv, _) = validation.reduce(sendbuf, recvbuf, root, ctx.rank, ctx.size,
                                           flat_view)
    at_root = ctx.rank == r
    result = recvbuf if at_root else None
    if at_root and recv is None:
        result = buffers.array_module(sendbuf).empty_like(sendbuf)
        recv = flat_view(result, "recvbuf", writable=True)
    opo = resolve_op(op)
    opo.check_dtype(send.dtype)
    name = _resolve(ctx, "reduce", algorithm, send.nbytes)
    if ctx.size == 1:
        run = _copy_step(recv, send)
    else:
        run = bind("reduce", name, ctx, send, recv, opo, r) if send.size else None
    plan = Plan(_chain(run, _finalize_step(opo, recv, ctx.size)), result,
                recvbuf if at_root else None, at_root and recvbuf is None, send.size,
                send.dtype.str, algorithm, name, op=opo.name, root=r)
    if send is recv:  # in place
        return plan
    run_on = _run_on(ctx, "reduce", name, (send, recv, opo, r), {},
                     ctx.size == 1 or not send.size,
                     opo if at_root and opo.averages and ctx.size > 1 else None)
    if not at_root:
        return plan._replace(shaped=fastpath.Shaped(run_on, send.dtype,
                                                    mode=fastpath.INPUT_ONLY))
    return _with_shape(plan, run_on, send, sendbuf, recvbuf is None)


def reduce(sendbuf: Any, recvbuf: Any = None, op: Any = "sum", root: int = 0,
           comm: Any = None, algorithm: str = "auto", *, check: bool | None = None) -> Any:
    """Reduce ``sendbuf`` elementwise over all ranks to ``root``.

    Args:
        sendbuf: this rank's contribution, or (on the root) :data:`mpicoll.IN_PLACE` /
            ``None`` to take it from ``recvbuf``.
        recvbuf: on the root, the output (``None`` allocates one shaped like
            ``sendbuf``); ignored elsewhere.
        root: the rank that receives the result.
        op, comm, algorithm, check: as for :func:`allreduce`.
    Returns:
        The result on the root (``recvbuf`` when given); ``None`` elsewhere.
    Raises:
        TypeError, ValueError, mpicoll.CollectiveError: as for :func:`allreduce`.
    """
    result = run_fast(check, "reduce", sendbuf, recvbuf, op, root, algorithm, comm)
    if result is not MISS:
        return result
    return dispatch("reduce", (sendbuf, recvbuf, op, root, algorithm), comm, check)


_PLANS: dict[str, Callable[..., Plan]] = {
    "allreduce": _allreduce_plan, "reduce_scatter": _reduce_scatter_plan,
    "allgather": _allgather_plan, "broadcast": _broadcast_plan, "reduce": _reduce_plan}

#: The public function of each collective (what the staged path runs on host chunks).
_PUBLIC: dict[str, Callable[..., Any]] = {
    "allreduce": allreduce, "reduce_scatter": reduce_scatter, "allgather": allgather,
    "broadcast": broadcast, "reduce": reduce}

if failures.ENABLED:  # ULFM on: a process failure raises ProcessFailedError (mpicoll.runtime)
    allreduce = failures.guard(allreduce)
    allreduce_init = failures.guard(allreduce_init)
    reduce_scatter = failures.guard(reduce_scatter)
    allgather = failures.guard(allgather)
    broadcast = failures.guard(broadcast)
    reduce = failures.guard(reduce)
