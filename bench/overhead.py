"""Per-call Python overhead of small collectives, and this machine's memory bandwidth.

Usage::

    mpirun -n 2 python -m bench.overhead              # 8-byte all-reduce, every algorithm
    mpirun -n 2 python -m bench.overhead --profile    # plus a cProfile of mpicoll's call

Calls run back to back (no barrier between them, as a training loop would) in blocks of
``--calls``; blocks of each variant are interleaved and repeated ``--repeats`` times; each
rank takes the median block, the table shows the average over ranks. Variants:

- ``mpi``: the direct mpi4py call ``comm.Allreduce(x, y, MPI.SUM)``;
- ``native``: the same MPI call through ``mpicoll.allreduce(..., algorithm="native")``:
  ``native - mpi`` is mpicoll's per-call overhead (argument checks, op and algorithm
  resolution, dispatch);
- each hand-written algorithm, and ``auto``;
- ``mpi recorded``: the direct call wrapped as the stall inspector records every call
  (:func:`mpicoll.tracking.recorded`): ``mpi recorded - mpi`` is the inspector's cost per
  call on the fast path (it is on by default: the other mpicoll variants include it unless
  ``MPICOLL_STALL_WARN_SECONDS=0``);
- the other forms of a call, each beside the MPI call doing the same work:
  ``auto persistent`` (``call = mpicoll.allreduce_init(x, y)``, then ``call()``),
  ``auto new-out`` (``y = mpicoll.allreduce(x)``) beside ``mpi new-out`` (a new output
  each call), ``auto new-in`` (a new input array each call: never in the identity cache,
  run as a call by shape, :func:`mpicoll.fastpath.run_fast`) beside ``mpi new-in``, and
  ``auto planned`` (the slow path itself, :func:`mpicoll.collectives.dispatch`: validation,
  algorithm choice, plan, cache store; what the first call of a shape costs).

Two more tables, from the same interleaved blocks:

- the *layers* of a call by shape (a new input array each call), each row adding one layer
  on top of the row before: the prepared MPI call (``Shaped.run``: buffer specs, datatype
  and op found at planning, only the arrays new), its record for the stall inspector,
  the checks of the new arrays (:func:`mpicoll.fastpath.by_shape`), the lookup by shape
  (:func:`mpicoll.fastpath.run_fast`), and the public function (``auto new-in``); and
  the same for a new output (``y = allreduce(x)``: allocation and the prepared call, its
  record, the identity lookup, the public function);
- the other collectives (reduce-scatter, all-gather, broadcast, reduce), cached and with
  a new input array each call (by shape), each beside the MPI call doing the same work.

Memory: one core's ``np.copyto`` of 64 MiB (others sleeping) and ``np.add(a, b, out=b)``,
in GB/s, the physical limits for the bus bandwidth of the collectives here.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

if not __package__:  # run as a script (python bench/overhead.py): find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (MiB, THREAD_LEVELS, at_least, human_bytes, parse_args,  # noqa: E402
                          parse_size, relative_paths, run_meta, start_mpi)

__all__ = ["main", "measure"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.overhead",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=8, help="bytes (default 8)")
    parser.add_argument("--calls", type=at_least(1), default=1000, help="calls per block (1000)")
    parser.add_argument("--repeats", type=at_least(1), default=7, help="blocks per variant (7)")
    parser.add_argument("--memcpy-bytes", type=parse_size, default=64 * MiB,
                        help="bytes copied for the memory bandwidth (64M; 0: skip)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile 'native' through mpicoll on rank 0; print the top")
    parser.add_argument("--thread-level", choices=THREAD_LEVELS, default=None)
    parser.add_argument("--format", choices=("osu", "json"), default="osu")
    parser.add_argument("--output", metavar="FILE", help="write the --format output here")
    return parser


def _add_bandwidth(nbytes: int, repeats: int = 5) -> float:
    import numpy as np  # noqa: PLC0415

    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    np.add(a, b, out=b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.add(a, b, out=b)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure(args: argparse.Namespace) -> dict:
    """Run the measurements; the result dict on rank 0 (``{}`` elsewhere)."""
    import numpy as np  # noqa: PLC0415

    MPI = start_mpi(args.thread_level)
    import mpicoll  # noqa: PLC0415

    from bench.common import memcpy_bandwidth  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    x = np.ones(max(1, args.size // 4), np.float32)
    y = np.empty_like(x)
    variants = {"mpi": lambda: comm.Allreduce(x, y, MPI.SUM)}
    for a in ["native", *[a for a in mpicoll.algorithms("allreduce") if a != "native"], "auto"]:
        variants[a] = (lambda a=a: mpicoll.allreduce(x, y, "sum", comm, a))
    persistent = mpicoll.allreduce_init(x, y, "sum", comm)
    from mpicoll import tracking, watchdog  # noqa: PLC0415
    from mpicoll.collectives import dispatch  # noqa: PLC0415

    recorded = tracking.recorded(tracking.Tracker("bench"), tracking.CallInfo("allreduce"),
                                 functools.partial(comm.Allreduce, x, y, MPI.SUM))
    variants.update({
        # the forms of a call, each against the MPI call that does the same work
        "auto persistent": persistent,                    # allreduce_init once, call()
        "mpi new-out": lambda: comm.Allreduce(x, np.empty_like(x), MPI.SUM),
        "auto new-out": lambda: mpicoll.allreduce(x, None, "sum", comm),    # y = f(x)
        "mpi new-in": lambda: comm.Allreduce(x.copy(), y, MPI.SUM),
        "auto new-in": lambda: mpicoll.allreduce(x.copy(), y, "sum", comm),  # by shape
        "auto planned": lambda: dispatch("allreduce", (x.copy(), y, "sum", "auto"), comm),
        # the stall inspector's record of a call (what every cached call pays while the
        # inspector or the timeline is on), around the direct MPI call
        "mpi recorded": recorded,
    })
    layers = _layer_variants(comm, x, y)
    others = _other_collectives(comm, MPI, x, n)
    variants.update(layers)
    variants.update(others)
    blocks: dict[str, list[float]] = {v: [] for v in variants}
    calls = args.calls
    for fn in variants.values():  # warm-up: plans, caches, topology
        for _ in range(20):
            fn()
    for rep in range(args.repeats):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for v in order:
            fn = variants[v]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            blocks[v].append((time.perf_counter() - t0) / calls)
    mine = {v: statistics.median(b) for v, b in blocks.items()}
    every = comm.allgather(mine)
    averaged = {v: sum(m[v] for m in every) / n * 1e6 for v in variants}
    per_call = {v: us for v, us in averaged.items() if v not in layers and v not in others}
    profile_text = None
    if args.profile:
        import cProfile  # noqa: PLC0415
        import io  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        prof = cProfile.Profile() if rank == 0 else None
        comm.Barrier()
        if prof:
            prof.enable()
        for _ in range(calls):
            variants["native"]()
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
            profile_text = relative_paths(buf.getvalue())
    comm.Barrier()
    memcpy = add = None
    if args.memcpy_bytes > 0:
        if rank == 0:
            memcpy = memcpy_bandwidth(args.memcpy_bytes)
            add = _add_bandwidth(args.memcpy_bytes)
        else:
            time.sleep(max(0.1, 3.0 * args.memcpy_bytes / (64 * MiB)))
        comm.Barrier()
    if rank != 0:
        return {}
    meta = run_meta(MPI, n, "overhead", getattr(args, "argv", None))
    return {
        "mpi_library": meta["mpi_library"],
        "thread_level": meta["thread_level"],
        "world_size": n, "size": args.size, "calls": calls, "repeats": args.repeats,
        "machine": meta["machine"], "date": meta["date"], "command": meta["command"],
        "per_call_us": per_call,
        "layers_us": {v: averaged[v] for v in layers},
        "collectives_us": {v: averaged[v] for v in others},
        "mpicoll_overhead_us": per_call["native"] - per_call["mpi"],
        "inspector_us": per_call["mpi recorded"] - per_call["mpi"],
        "inspector_on": watchdog.enabled(),
        "memcpy_GBps": memcpy, "add_GBps": add, "memcpy_bytes": args.memcpy_bytes,
        "profile": profile_text,
    }


def _layer_variants(comm: Any, x: Any, y: Any) -> dict[str, Callable[[], Any]]:
    """A call by shape and a new-output call taken apart: each variant adds one layer.

    Built from the pieces the slow path makes (private to :mod:`mpicoll.collectives`: a
    profiling aid, not an API), for the same arrays and arguments as ``auto new-in``.
    """
    import numpy as np  # noqa: PLC0415

    import mpicoll  # noqa: PLC0415
    from mpicoll import collectives, fastpath, tracking  # noqa: PLC0415
    from mpicoll.context import get_context  # noqa: PLC0415

    op, alg = "sum", "auto"
    ctx = get_context(comm)
    plan = collectives._planned(ctx, "allreduce", (x, y, op, alg), False)
    run = plan.shaped.run
    info = tracking.CallInfo("allreduce", plan.count, plan.dtype, plan.op, None, alg,
                             plan.algorithm, x.nbytes)
    recorded = tracking.recorded(ctx.tracker, info, run)
    checked = fastpath.by_shape(plan.shaped._replace(run=recorded))
    new = collectives._planned(ctx, "allreduce", (x, None, op, alg), False)
    remake = tracking.recorded(ctx.tracker, info, new.remake)
    empty, shape, dtype, new_run = np.empty, x.shape, x.dtype, new.shaped.run
    MISS = fastpath.MISS

    def public(a: Any, b: Any) -> Any:
        return mpicoll.allreduce(a, b, op, comm, alg)

    public(x.copy(), y)   # plans the shape: run_fast finds it by shape
    public(x, None)       # and x's new-output call
    return {
        "in: run": lambda: run(x.copy(), y),
        "in: + record": lambda: recorded(x.copy(), y),
        "in: + checks": lambda: checked(x.copy(), y),
        # (a lookup that misses, once after "auto planned" evicted the entry, plans again)
        "in: + lookup": lambda: fastpath.run_fast(False, "allreduce", x.copy(), y, op, alg,
                                                  comm) is not MISS or public(x.copy(), y),
        "in: + allreduce()": lambda: mpicoll.allreduce(x.copy(), y, op, comm, alg),
        "out: empty + run": lambda: new_run(x, empty(shape, dtype)),
        "out: + record": remake,
        "out: + lookup": lambda: fastpath.run_fast(False, "allreduce", x, None, op, alg,
                                                   comm) is not MISS or public(x, None),
        "out: + allreduce()": lambda: mpicoll.allreduce(x, None, op, comm, alg),
    }


def _other_collectives(comm: Any, MPI: Any, x: Any, n: int) -> dict[str, Callable[[], Any]]:
    """Reduce-scatter, all-gather, broadcast and reduce of ``x``'s size (per rank), cached
    and with a new input each call, each beside the mpi4py call doing the same work."""
    import numpy as np  # noqa: PLC0415

    import mpicoll  # noqa: PLC0415

    full = np.ones(x.size * n, x.dtype)   # reduce-scatter: one block of x's size per rank
    block, gathered, out = np.empty_like(x), np.empty_like(full), np.empty_like(x)
    buf = x.copy()
    return {
        "reduce_scatter mpi": lambda: comm.Reduce_scatter_block(full, block, MPI.SUM),
        "reduce_scatter cached": lambda: mpicoll.reduce_scatter(full, block, "sum", comm),
        "reduce_scatter mpi new-in": lambda: comm.Reduce_scatter_block(full.copy(), block,
                                                                       MPI.SUM),
        "reduce_scatter new-in": lambda: mpicoll.reduce_scatter(full.copy(), block, "sum",
                                                                comm),
        "allgather mpi": lambda: comm.Allgather(x, gathered),
        "allgather cached": lambda: mpicoll.allgather(x, gathered, comm),
        "allgather mpi new-in": lambda: comm.Allgather(x.copy(), gathered),
        "allgather new-in": lambda: mpicoll.allgather(x.copy(), gathered, comm),
        "broadcast mpi": lambda: comm.Bcast(buf, 0),
        "broadcast cached": lambda: mpicoll.broadcast(buf, 0, comm),
        "broadcast mpi new-in": lambda: comm.Bcast(x.copy(), 0),
        "broadcast new-in": lambda: mpicoll.broadcast(x.copy(), 0, comm),
        "reduce mpi": lambda: comm.Reduce(x, out, MPI.SUM, 0),
        "reduce cached": lambda: mpicoll.reduce(x, out, "sum", 0, comm),
        "reduce mpi new-in": lambda: comm.Reduce(x.copy(), out, MPI.SUM, 0),
        "reduce new-in": lambda: mpicoll.reduce(x.copy(), out, "sum", 0, comm),
    }


def format_text(res: dict) -> str:
    """The human-readable report."""
    lines = [f"# mpicoll per-call overhead: {res['size']}-byte all-reduce, float32 sum",
             f"# MPI library: {res['mpi_library']}",
             f"# Thread level: {res['thread_level']}   World size: {res['world_size']}",
             f"# Back-to-back calls, median of {res['repeats']} blocks of {res['calls']}, "
             "averaged over ranks",
             f"# Machine: {res['machine']}",
             f"# Date: {res.get('date', '?')}   Command: {res.get('command', '?')}",
             f"{'# Variant':<22s}{'us/call':>10s}{'vs mpi':>9s}"]
    base = res["per_call_us"]["mpi"]
    for v, us in res["per_call_us"].items():
        lines.append(f"{v:<22s}{us:10.2f}{us / base:9.2f}")
    lines.append(f"# mpicoll overhead per call (native through mpicoll - direct mpi4py): "
                 f"{res['mpicoll_overhead_us']:.2f} us")
    if "inspector_us" in res:
        lines.append(f"# stall inspector's record per call (mpi recorded - mpi): "
                     f"{res['inspector_us']:.2f} us; inspector "
                     f"{'on' if res['inspector_on'] else 'off'} in this run")
    if res.get("layers_us"):
        lines.append("# Layers: each row adds one to the row above (in: new input, given "
                     "output; out: y = allreduce(x))")
        lines.append(f"{'# Layer':<22s}{'us/call':>10s}{'added':>9s}")
        prev = None
        for v, us in res["layers_us"].items():
            if v.endswith(": run") or v.endswith("empty + run"):
                prev = res["per_call_us"]["mpi new-in" if v.startswith("in") else "mpi new-out"]
            lines.append(f"{v:<22s}{us:10.2f}{us - prev:9.2f}")
            prev = us
    if res.get("collectives_us"):
        lines.append("# Other collectives (ratio: to the mpi4py call doing the same work)")
        for v, us in res["collectives_us"].items():
            name, _, form = v.partition(" ")
            base = res["collectives_us"][f"{name} mpi new-in" if "new-in" in form
                                         else f"{name} mpi"]
            lines.append(f"{v:<28s}{us:10.2f}{us / base:9.2f}")
    if res.get("memcpy_GBps"):
        lines.append(f"# Memory: np.copyto {human_bytes(res['memcpy_bytes'])}: "
                     f"{res['memcpy_GBps']:.2f} GB/s; np.add(a, b, out=b): "
                     f"{res['add_GBps']:.2f} GB/s (one core, other ranks asleep)")
    if res.get("profile"):
        lines.append("# cProfile of mpicoll.allreduce(algorithm='native') on rank 0:")
        lines.extend("#   " + ln for ln in res["profile"].strip().splitlines())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(build_parser(), argv)
    res = measure(args)
    if res:
        text = format_text(res)
        sys.stdout.write(text)
        if args.output:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(res, indent=1) + "\n" if args.format == "json" else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
