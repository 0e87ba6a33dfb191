"""Point-to-point benchmarks between ranks 0 and 1 (OSU's osu_latency, osu_bw, osu_bibw).

Usage::

    mpirun -n 2 python -m bench.osu_latency -m 0:4M
    mpirun -n 2 python -m bench.osu_bw -W 64 -c
    mpirun -n 2 python -m bench.osu_bibw --format json --output bibw.json

- latency: ping-pong; each iteration is timed on rank 0; the table shows half the median
  round trip (``-f`` adds the min and max half round trip over iterations).
- bw: rank 0 sends a window of ``-W`` messages with ``Isend``, rank 1 posts as many
  ``Irecv``; rank 1 acknowledges each window. Bandwidth = size x window / median window
  time, in MB/s (1e6 bytes, as OSU).
- bibw: both ranks send and receive a window at once; bandwidth counts both directions.

Ranks other than 0 and 1 (if any) only take part in the barriers. With one rank the test
prints its header and a note and exits successfully (so smoke tests run at every size).
Mpi4py buffer methods (``Send``/``Recv``/``Isend``/``Irecv``) on uint8 arrays throughout.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .common import (Row, at_least, add_common_options, format_osu_rows, iterations_for, median,
                     osu_column_header, parse_args, power_of_two_sizes, report_validation,
                     run_meta, start_mpi, write_results)

__all__ = ["main", "TESTS"]

TESTS = {"latency": "Latency Test", "bw": "Bandwidth Test", "bibw": "Bi-Directional "
                                                                   "Bandwidth Test"}
TAG, ACK = 1, 2


def _fill(buf: Any, it: int, sender: int) -> None:
    import numpy as np  # noqa: PLC0415

    buf[:] = (np.arange(buf.size, dtype=np.int64) * 7 + it * 3 + sender * 11) % 251


def _expected(size: int, it: int, sender: int) -> Any:
    import numpy as np  # noqa: PLC0415

    return ((np.arange(size, dtype=np.int64) * 7 + it * 3 + sender * 11) % 251).astype(np.uint8)


def latency_once(MPI: Any, comm: Any, sbuf: Any, rbuf: Any, rank: int) -> float:
    """One ping-pong; returns the round-trip time on rank 0 (0 elsewhere)."""
    if rank == 0:
        t0 = time.perf_counter()
        comm.Send([sbuf, MPI.BYTE], 1, TAG)
        comm.Recv([rbuf, MPI.BYTE], 1, TAG)
        return time.perf_counter() - t0
    if rank == 1:
        comm.Recv([rbuf, MPI.BYTE], 0, TAG)
        comm.Send([sbuf, MPI.BYTE], 0, TAG)
    return 0.0


def bw_once(MPI: Any, comm: Any, sbuf: Any, rbufs: list, rank: int, window: int,
            bidirectional: bool) -> float:
    """One window; returns its time on rank 0 (0 elsewhere)."""
    if rank > 1:
        return 0.0
    peer = 1 - rank
    t0 = time.perf_counter()
    reqs = []
    if rank == 1 or bidirectional:
        reqs += [comm.Irecv([rbufs[w], MPI.BYTE], peer, TAG) for w in range(window)]
    if rank == 0 or bidirectional:
        reqs += [comm.Isend([sbuf, MPI.BYTE], peer, TAG) for _ in range(window)]
    MPI.Request.Waitall(reqs)
    if rank == 0:
        comm.Recv([rbufs[0][:0], MPI.BYTE], peer, ACK)
    else:
        comm.Send([sbuf[:0], MPI.BYTE], peer, ACK)
    return time.perf_counter() - t0


def build_parser(test: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"bench.osu_{test}",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default_range = "0:4M" if test == "latency" else "1:4M"
    add_common_options(parser, default_range=default_range,
                       iterations=1000 if test == "latency" else 100,
                       warmup=100 if test == "latency" else 10)
    parser.add_argument("-W", "--window-size", type=at_least(1), default=64,
                        help="messages per window for bw/bibw (default 64)")
    return parser


def run(args: argparse.Namespace, test: str) -> int:
    import numpy as np  # noqa: PLC0415

    MPI = start_mpi(args.thread_level)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    lo, hi = args.message_size
    sizes = ([0] if lo == 0 and test == "latency" else []) + power_of_two_sizes(lo, hi)
    kind = "latency" if test == "latency" else "bandwidth"
    common = run_meta(MPI, n, f"osu_{test}", getattr(args, "argv", None))
    meta = {
        "test": test, "title": f"MPI {TESTS[test]} (mpicoll bench)",
        "mpi_library": common["mpi_library"],
        "thread_level": common["thread_level"],
        "thread_level_requested": args.thread_level or "default",
        "world_size": n, "window": args.window_size if test != "latency" else None,
        "iterations": args.iterations, "warmup": args.warmup, "validate": args.validate,
        "machine": common["machine"], "date": common["date"], "command": common["command"],
    }
    header = (f"# OSU-style {meta['title']}\n# MPI library: {meta['mpi_library']}\n"
              f"# Thread level: {meta['thread_level']} (requested: "
              f"{meta['thread_level_requested']})   World size: {n}"
              + (f"   Window: {args.window_size}" if test != "latency" else "") +
              f"\n# Times: median over iterations on rank 0\n# Machine: {meta['machine']}\n")
    show = rank == 0 and (args.format == "osu" or args.output)
    if show:
        sys.stdout.write(header)
    if n < 2:
        if rank == 0:
            sys.stdout.write("# This test needs at least two ranks; nothing measured.\n")
        return 0
    if show:
        sys.stdout.write(osu_column_header(kind, args.full))
        sys.stdout.flush()
    rows: list[Row] = []
    failures: list[str] = []
    window = args.window_size
    for size in sizes:
        sbuf = np.zeros(size, np.uint8)
        rbufs = [np.zeros(size, np.uint8) for _ in range(1 if test == "latency" else window)]
        warm, iters = iterations_for(args, size)
        if args.validate and rank <= 1:
            _fill(sbuf, 0, rank)
        times = []
        comm.Barrier()
        for it in range(warm + iters):
            if test == "latency":
                dt = latency_once(MPI, comm, sbuf, rbufs[0], rank)
            else:
                dt = bw_once(MPI, comm, sbuf, rbufs, rank, window, test == "bibw")
            if it >= warm:
                times.append(dt)
        ok = True
        if args.validate and rank <= 1:
            if test == "latency" or rank == 1 or test == "bibw":
                peer = 1 - rank
                ok = all(np.array_equal(b, _expected(size, 0, peer)) for b in rbufs)
        ok = comm.allreduce(ok, op=MPI.LAND)
        if not ok:
            failures.append(f"{test} size {size}: received data differs from what was sent")
        if rank == 0:
            med = median(times)
            if test == "latency":
                row = Row(test=test, size=size, algorithm="mpi", avg_us=med / 2 * 1e6,
                          min_us=min(times) / 2 * 1e6, max_us=max(times) / 2 * 1e6,
                          iterations=iters, world_size=n, bytes=size,
                          validated=ok if args.validate else None)
            else:
                moved = size * window * (2 if test == "bibw" else 1)
                row = Row(test=test, size=size, algorithm="mpi", avg_us=med * 1e6,
                          min_us=min(times) * 1e6, max_us=max(times) * 1e6,
                          iterations=iters, world_size=n, bytes=size,
                          bandwidth_MBps=moved / med / 1e6,
                          validated=ok if args.validate else None)
            rows.append(row)
            if show:
                sys.stdout.write(format_osu_rows([row], full=args.full, kind=kind))
                sys.stdout.flush()
    if rank == 0:
        write_results(args, meta, rows, header + osu_column_header(kind, args.full)
                      + format_osu_rows(rows, full=args.full, kind=kind))
        report_validation(failures, args.validate, "messages")
    return 1 if failures else 0


def main(argv: list[str] | None = None, test: str = "latency") -> int:
    """Entry point of ``osu_latency`` / ``osu_bw`` / ``osu_bibw``."""
    return run(parse_args(build_parser(test), argv), test)


if __name__ == "__main__":
    sys.exit(main())
