"""Collective benchmarks (OSU style): every algorithm plus MPI, interleaved, per size.

Usage::

    mpirun -n 4 python -m bench.osu_allreduce -m 8:16M -c -f
    mpirun -n 4 python -m bench allreduce --algo ring,rabenseifner --format csv --output ar.csv

What is timed: each call alone, between barriers (as OSU does), for every algorithm in the
same iteration loop (A B C ... C B A, direction alternating) so drift on a noisy machine
hits every algorithm alike. Each rank takes the median of its iterations; the table shows
the average over ranks (``-f``: also min and max).

Algorithms: ``mpi`` is the direct mpi4py call (``comm.Allreduce(...)``), the baseline of the
``vs MPI`` ratio; ``native`` is the same MPI collective called through mpicoll (the
difference is mpicoll's per-call overhead); then every registered hand-written algorithm
and ``auto``.

Size is the byte count of the whole vector (nccl-tests' convention): for ``allgather`` all
blocks together, for ``reduce_scatter`` the full input. algbw = size / time,
busbw = algbw x (2(n-1)/n for allreduce, (n-1)/n for allgather and reduce_scatter, 1 for
broadcast and reduce).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from .common import (BUS_FACTOR, MiB, Progress, Row, add_common_options, format_osu_rows,
                     human_bytes, iterations_for, median, osu_column_header, parse_args,
                     parse_size, power_of_two_sizes, report_validation, run_meta, start_mpi,
                     write_results)

__all__ = ["main", "run", "build_parser", "TITLES", "MODULES", "CollectiveCase"]

#: OSU-style test names.
TITLES = {
    "allreduce": "Allreduce",
    "reduce_scatter": "Reduce_scatter",
    "allgather": "Allgather",
    "broadcast": "Bcast",
    "reduce": "Reduce",
}

#: The ``bench.osu_*`` module that runs each collective (the command results record).
MODULES = {"allreduce": "osu_allreduce", "reduce_scatter": "osu_reduce_scatter",
           "allgather": "osu_allgather", "broadcast": "osu_bcast", "reduce": "osu_reduce"}


#: ``--op`` choices (exact for the small integers the data uses, in every dtype).
OPS = ("sum", "max", "min")


def pattern(rank: int, index: Any, dtype: Any) -> Any:
    """Deterministic test data: small positive integers depending on rank and index.

    Any summation order gives the exact result in every dtype (values 1..13, at most a few
    hundred after summing), so results are compared for equality.
    """
    import numpy as np  # noqa: PLC0415

    return ((rank * 7 + index * 3) % 13 + 1).astype(np.dtype(dtype))


class CollectiveCase:
    """Buffers, calls and reference result of one collective at one size.

    Args:
        collective: a name from ``mpicoll.COLLECTIVES``.
        comm: the communicator.
        nbytes: the nominal size (whole vector, see the module docstring).
        dtype: numpy dtype of the data.
        op: reduction name.
        root: root of broadcast/reduce.
    """

    def __init__(self, collective: str, comm: Any, nbytes: int, dtype: Any, op: str = "sum",
                 root: int = 0) -> None:
        import numpy as np  # noqa: PLC0415

        from mpicoll.algorithms.native import native_types  # noqa: PLC0415
        from mpicoll.ops import resolve_op  # noqa: PLC0415
        from mpicoll.partition import block_bounds  # noqa: PLC0415

        self.collective, self.comm, self.root = collective, comm, root
        self.requested_bytes = nbytes
        self.op = op
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.dtype = np.dtype(dtype)
        n, r = self.size, self.rank
        count = measured_bytes(collective, nbytes, self.dtype.itemsize, n) // self.dtype.itemsize
        self.block = count // n
        self.count = count
        self.nbytes = count * self.dtype.itemsize
        self.bounds = block_bounds(count, n)
        mpi_type, self.mpi_op = native_types(self.dtype, resolve_op(op))
        idx = np.arange(count)
        if collective == "allgather":
            self.send = pattern(r, np.arange(self.block), self.dtype)
            self.recv = np.zeros(count, self.dtype)
        elif collective == "broadcast":
            self.send = None
            self.recv = pattern(root, idx, self.dtype) if r == root else np.zeros(count,
                                                                                 self.dtype)
        elif collective == "reduce_scatter":
            self.send = pattern(r, idx, self.dtype)
            self.recv = np.zeros(self.bounds[r + 1] - self.bounds[r], self.dtype)
        else:
            self.send = pattern(r, idx, self.dtype)
            self.recv = (np.zeros(count, self.dtype)
                         if collective == "allreduce" or r == root else None)
        self._mpi_type = mpi_type
        self._np = np

    def _spec(self, a: Any) -> list:
        return [a, a.size, self._mpi_type]

    def call(self, algorithm: str) -> Callable[[], Any]:
        """A no-argument function running the collective with ``algorithm``.

        ``"mpi"`` is the direct mpi4py call; anything else goes through mpicoll.
        """
        import mpicoll  # noqa: PLC0415

        c, comm, send, recv, op, root = (self.collective, self.comm, self.send, self.recv,
                                         self.op, self.root)
        if algorithm == "mpi":
            mop = self.mpi_op
            if c == "allreduce":
                s, rv = self._spec(send), self._spec(recv)
                return lambda: comm.Allreduce(s, rv, mop)
            if c == "reduce_scatter":
                s, rv = self._spec(send), self._spec(recv)
                counts = [self.bounds[i + 1] - self.bounds[i] for i in range(self.size)]
                return lambda: comm.Reduce_scatter(s, rv, counts, mop)
            if c == "allgather":
                s, rv = [send, send.nbytes, self._byte()], [recv, send.nbytes, self._byte()]
                return lambda: comm.Allgather(s, rv)
            if c == "broadcast":
                b = [recv, recv.nbytes, self._byte()]
                return lambda: comm.Bcast(b, root)
            s = self._spec(send)
            rv = self._spec(recv) if recv is not None else None
            return lambda: comm.Reduce(s, rv, mop, root)
        if c == "allreduce":
            return lambda: mpicoll.allreduce(send, recv, op, comm, algorithm)
        if c == "reduce_scatter":
            return lambda: mpicoll.reduce_scatter(send, recv, op, comm, algorithm)
        if c == "allgather":
            return lambda: mpicoll.allgather(send, recv, comm, algorithm)
        if c == "broadcast":
            return lambda: mpicoll.broadcast(recv, root, comm, algorithm)
        return lambda: mpicoll.reduce(send, recv, op, root, comm, algorithm)

    def _byte(self) -> Any:
        from mpi4py import MPI  # noqa: PLC0415

        return MPI.BYTE

    def reference(self) -> Any:
        """This rank's expected output (``None`` where a rank has none)."""
        np = self._np
        n, r = self.size, self.rank
        if self.collective == "allgather":
            return np.concatenate([pattern(q, np.arange(self.block), self.dtype)
                                   for q in range(n)])
        idx = np.arange(self.count)
        if self.collective == "broadcast":
            return pattern(self.root, idx, self.dtype)
        stack = np.stack([pattern(q, idx, np.int64) for q in range(n)])
        full = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0)}[self.op]
        full = full.astype(self.dtype)
        if self.collective == "reduce_scatter":
            return full[self.bounds[r]:self.bounds[r + 1]]
        if self.collective == "reduce" and r != self.root:
            return None
        return full

    def clear_output(self) -> None:
        """Overwrite the output with zeros (a value the data never takes)."""
        if self.collective == "broadcast":
            if self.rank != self.root:
                self.recv[...] = 0
        elif self.recv is not None:
            self.recv[...] = 0

    def validate(self, algorithm: str, repeats: int = 2) -> str | None:
        """Run ``algorithm`` ``repeats`` times from a cleared output; a message if wrong."""
        np = self._np
        ref = self.reference()
        fn = self.call(algorithm)
        for rep in range(repeats):
            self.clear_output()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001  (reported, and the run fails)
                return f"raised {type(exc).__name__}: {exc}"
            if ref is not None and not np.array_equal(self.recv, ref):
                bad = int(np.flatnonzero(self.recv != ref)[0])
                return (f"call {rep + 1}: element {bad} is {self.recv[bad]!r}, "
                        f"expected {ref[bad]!r}")
        return None


def measured_bytes(collective: str, nbytes: int, itemsize: int, n: int) -> int:
    """The bytes a row asked for ``nbytes`` measures: whole elements, at least one, and
    for allgather a whole block per rank (the row's Size)."""
    count = max(1, nbytes // itemsize)
    if collective == "allgather":
        count = max(1, count // n) * n
    return count * itemsize


def build_parser(collective: str | None = None) -> argparse.ArgumentParser:
    """Options of the collective benchmarks."""
    prog = f"bench.{MODULES[collective]}" if collective else "bench.collective"
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    if collective is None:
        parser.add_argument("collective", choices=tuple(TITLES))
    add_common_options(parser, default_range="8:1M", iterations=100, warmup=10)
    parser.add_argument("--algo", default="all",
                        help="comma-separated algorithms (registered names, 'native', 'auto');"
                             " 'all' (default) = every registered one plus auto. The direct"
                             " MPI call 'mpi' is always measured, as the baseline")
    parser.add_argument("--dtype", default="float32",
                        help="numpy dtype (default float32)")
    parser.add_argument("--op", choices=OPS, default="sum", help="reduction (default sum)")
    parser.add_argument("--root", type=int, default=0, help="root of broadcast/reduce")
    parser.add_argument("--step", type=int, default=2, choices=(2, 4, 8),
                        help="size factor between rows (default 2)")
    parser.add_argument("--memcpy-bytes", type=parse_size, default=64 * MiB,
                        help="np.copyto size for the memory-bandwidth line (0: skip)")
    parser.add_argument("--plot", metavar="PNG", help="write busbw vs size (one line per "
                                                      "algorithm) to this PNG")
    parser.add_argument("--markdown", metavar="MD", help="write a markdown table here")
    return parser


def check_case_options(collective: str, dtype: str, op: str, root: int, n: int) -> None:
    """``--dtype``, ``--op`` and ``--root`` as the collective can take them, on every rank
    before anything is measured.

    Raises:
        SystemExit: naming the option and why.
    """
    import numpy as np  # noqa: PLC0415

    from mpicoll.buffers import check_dtype  # noqa: PLC0415
    from mpicoll.ops import resolve_op  # noqa: PLC0415

    try:
        check_dtype(np.dtype(dtype), "--dtype")
        if collective in ("allreduce", "reduce_scatter", "reduce"):
            resolve_op(op).check_dtype(np.dtype(dtype), "--op")
    except TypeError as exc:
        raise SystemExit(f"{collective}: {exc}") from None
    if collective in ("broadcast", "reduce") and not 0 <= root < n:
        raise SystemExit(f"{collective}: --root {root} is not a rank of the {n} ranks")


def select_algorithms(collective: str, spec: str) -> list[str]:
    """``--algo`` -> the list measured, ``mpi`` first.

    Raises:
        SystemExit: an unknown name.
    """
    import mpicoll  # noqa: PLC0415

    registered = mpicoll.algorithms(collective)
    if spec == "all":
        chosen = ["native"] + [a for a in registered if a != "native"] + ["auto"]
    else:
        chosen = [a.strip() for a in spec.split(",") if a.strip() and a.strip() != "mpi"]
        unknown = [a for a in chosen if a not in registered and a != "auto"]
        if unknown:
            raise SystemExit(f"unknown {collective} algorithm(s) {unknown}; registered: "
                             f"{registered} (plus auto, mpi)")
    return ["mpi"] + chosen


def measure_memcpy(comm: Any, nbytes: int) -> float | None:
    """Rank 0's ``np.copyto`` bandwidth (GB/s) while the other ranks sleep; on every rank."""
    from .common import memcpy_bandwidth  # noqa: PLC0415

    if nbytes <= 0:
        return None
    comm.Barrier()
    bw = None
    if comm.Get_rank() == 0:
        bw = memcpy_bandwidth(nbytes)
    else:
        time.sleep(max(0.05, 1.5 * nbytes / (64 * MiB)))
    return comm.bcast(bw, root=0)


def time_interleaved(comm: Any, fns: dict[str, Callable[[], Any]], warmup: int,
                     iters: int) -> dict[str, float]:
    """This rank's median time (s) per algorithm, iterations interleaved.

    Iteration ``it`` runs the algorithms in the order rotated by ``it`` (each takes every
    position equally often), and each timed call is preceded by one untimed call of the
    same algorithm, both between barriers: a timed call then finds caches and buffers as
    that algorithm leaves them (as in OSU's back-to-back loops), never as the previous
    algorithm did. Measured without that warm call, the same ``MPI_Allreduce`` through
    mpicoll (``native``) came out 7-11% slower than the direct call at 1-2 MiB, n = 2-8,
    although its front end costs 0.3 us: whichever variant ran twice in a row (at the
    A B .. B A turns) was favoured.
    """
    barrier = comm.Barrier
    clock = time.perf_counter
    names = list(fns)
    times: dict[str, list[float]] = {a: [] for a in names}
    for it in range(warmup + iters):
        k = it % len(names)
        for a in names[k:] + names[:k]:
            fn = fns[a]
            barrier()
            fn()
            barrier()
            t0 = clock()
            fn()
            dt = clock() - t0
            if it >= warmup:
                times[a].append(dt)
    return {a: median(v) for a, v in times.items()}


def run(args: argparse.Namespace, collective: str) -> int:
    """Run the benchmark; return the exit status (1 if a validation failed)."""
    import numpy as np  # noqa: PLC0415

    MPI = start_mpi(args.thread_level)
    comm = MPI.COMM_WORLD
    algs = select_algorithms(collective, args.algo)
    check_case_options(collective, args.dtype, args.op, args.root, comm.Get_size())
    meta = run_metadata(MPI, comm, args, collective, algs)
    header = osu_header(meta, args.full)
    echo = comm.Get_rank() == 0 and (args.format == "osu" or bool(args.output))
    if echo:
        sys.stdout.write(header)
        sys.stdout.flush()
    itemsize, n = np.dtype(args.dtype).itemsize, comm.Get_size()
    first: dict[int, int] = {}   # one row per size measured (1 and 2 B of float32 are 4 B)
    for asked in power_of_two_sizes(*args.message_size, step=args.step):
        first.setdefault(measured_bytes(collective, asked, itemsize, n), asked)
    sizes = list(first.values())
    progress = Progress(comm.Get_rank() == 0 and not args.quiet, collective, len(sizes))
    rows: list[Row] = []
    failures: list[str] = []
    for k, nbytes in enumerate(sizes):
        new_rows, new_failures = measure_size(args, comm, collective, algs, nbytes)
        rows += new_rows
        failures += new_failures
        if echo:
            sys.stdout.write(format_osu_rows(new_rows, full=args.full, kind="collective"))
            sys.stdout.flush()
        progress.step(k + 1, f"sizes done, last {nbytes} B")
    if comm.Get_rank() == 0:
        write_outputs(args, meta, rows, header)
        report_validation(failures, args.validate)
    return 1 if failures else 0


def run_metadata(MPI: Any, comm: Any, args: argparse.Namespace, collective: str,
                 algs: list[str]) -> dict:
    """The ``meta`` of the results: setup, options, memory bandwidth, date and command."""
    import numpy as np  # noqa: PLC0415

    from mpicoll.context import get_context  # noqa: PLC0415

    n = comm.Get_size()
    ctx = get_context(comm)
    memcpy = measure_memcpy(comm, args.memcpy_bytes)
    common = run_meta(MPI, n, MODULES[collective], getattr(args, "argv", None))
    return {
        "test": collective,
        "title": f"MPI {TITLES[collective]} Latency Test (mpicoll bench)",
        "mpi_library": common["mpi_library"],
        "thread_level": common["thread_level"],
        "thread_level_requested": args.thread_level or "default",
        "world_size": n,
        "ranks_per_node": ctx.topology.local_size,
        "dtype": np.dtype(args.dtype).name,
        "op": args.op,
        "algorithms": algs,
        "iterations": args.iterations,
        "iterations_large": args.iterations_large,
        "large_size": args.large_size,
        "warmup": args.warmup,
        "validate": args.validate,
        "segment_bytes": ctx.segment_bytes,
        "memcpy_GBps": memcpy,
        "memcpy_bytes": args.memcpy_bytes,
        "machine": common["machine"],
        "date": common["date"],
        "command": common["command"],
    }


def validate_all(case: CollectiveCase, algs: list[str], repeats: int = 2
                 ) -> tuple[dict[str, bool], list[str]]:
    """Validate every algorithm on every rank: ({alg: all ranks right}, failure lines)."""
    validated: dict[str, bool] = {}
    failures: list[str] = []
    for a in algs:
        errs = case.comm.allgather(case.validate(a, repeats=repeats))
        validated[a] = not any(errs)
        failures += [f"{case.collective} {a} size {case.requested_bytes} rank {r}: {e}"
                     for r, e in enumerate(errs) if e]
    return validated, failures


def measure_size(args: argparse.Namespace, comm: Any, collective: str, algs: list[str],
                 nbytes: int) -> tuple[list[Row], list[str]]:
    """Validate (``-c``), time and validate again every algorithm at one size."""
    case = CollectiveCase(collective, comm, nbytes, args.dtype, args.op, args.root)
    validated, failures = validate_all(case, algs) if args.validate else ({}, [])
    warm, iters = iterations_for(args, nbytes)
    medians = comm.allgather(time_interleaved(comm, {a: case.call(a) for a in algs}, warm,
                                              iters))
    if args.validate:  # the timed calls must not have broken anything either
        after, _ = validate_all(case, algs, repeats=1)
        for a in (a for a in algs if not after[a]):
            validated[a] = False
            failures.append(f"{collective} {a} size {nbytes}: wrong after timing")
    return rows_for(case, algs, medians, iters, validated if args.validate else None), failures


def rows_for(case: CollectiveCase, algs: list[str], medians: list[dict[str, float]],
             iters: int, validated: dict[str, bool] | None) -> list[Row]:
    """One result row per algorithm from every rank's medians (seconds)."""
    from mpicoll.context import get_context  # noqa: PLC0415

    n = case.size
    rpn = get_context(case.comm).ranks_per_node   # (what auto itself is told)
    factor = BUS_FACTOR[case.collective](n)
    base = sum(m["mpi"] for m in medians) / n
    rows = []
    for a in algs:
        vals = [m[a] for m in medians]
        avg = sum(vals) / n
        algbw = case.nbytes / avg / 1e9 if avg > 0 else None
        rows.append(Row(
            test=case.collective, size=case.nbytes, algorithm=a, avg_us=avg * 1e6,
            min_us=min(vals) * 1e6, max_us=max(vals) * 1e6, iterations=iters,
            world_size=n, bytes=case.nbytes, algbw=algbw,
            busbw=algbw * factor if algbw is not None else None,
            ratio=avg / base if base > 0 else None,
            validated=validated.get(a) if validated is not None else None,
            extra={"chosen": _auto_choice(case.collective, n, rpn, case.nbytes)
                   if a == "auto" else None}))
    return rows


def write_outputs(args: argparse.Namespace, meta: dict, rows: list[Row], header: str) -> None:
    """Rank 0: the results in ``--format`` (stdout or ``--output``), ``--plot``,
    ``--markdown``."""
    write_results(args, meta, rows,
                  header + format_osu_rows(rows, full=args.full, kind="collective"))
    if args.plot or args.markdown:
        from . import report  # noqa: PLC0415

        if args.plot:
            report.plot_busbw([(meta, rows)], args.plot)
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as fh:
                fh.write(report.markdown_table(meta, rows))


def _auto_choice(collective: str, n: int, rpn: int, nbytes: int) -> str:
    from mpicoll.selection import choose  # noqa: PLC0415

    return choose(collective, n, rpn, nbytes)


def osu_header(meta: dict, full: bool) -> str:
    """OSU-style header lines (``# ...``) and the column line."""
    lines = [
        f"# OSU-style {meta['title']}",
        f"# MPI library: {meta['mpi_library']}",
        f"# Thread level: {meta['thread_level']} (requested: {meta['thread_level_requested']})"
        f"   World size: {meta['world_size']}   Ranks per node: {meta['ranks_per_node']}",
        f"# dtype: {meta['dtype']}   op: {meta['op']}   validation: "
        f"{'on' if meta['validate'] else 'off'}   segment: {meta['segment_bytes']} B",
        f"# Times: per-rank median of {meta['iterations']} iterations "
        f"({meta['iterations_large']} above {meta['large_size']} B) after {meta['warmup']}"
        f" warm-up, algorithms interleaved (rotated order, each timed call right after an "
        f"untimed one of the same algorithm); averaged over ranks",
        "# Size: bytes of the whole vector (nccl-tests); vs MPI = time / time of the direct "
        "mpi4py call ('mpi')",
    ]
    if meta.get("memcpy_GBps"):
        lines.append(f"# Memory copy bandwidth (np.copyto {human_bytes(meta['memcpy_bytes'])}, "
                     f"one core): {meta['memcpy_GBps']:.2f} GB/s")
    lines.append(f"# Machine: {meta['machine']}")
    return "\n".join(lines) + "\n" + osu_column_header("collective", full)


def main(argv: list[str] | None = None, collective: str | None = None) -> int:
    """Entry point: ``collective`` fixed by the ``osu_*`` wrappers, else the first argument."""
    args = parse_args(build_parser(collective), argv)
    return run(args, collective or args.collective)


if __name__ == "__main__":
    sys.exit(main())
