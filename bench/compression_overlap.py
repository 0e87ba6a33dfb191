"""Before/after of one change to the compressed ring's schedule, interleaved in one run.

``mpicoll.compression.ring._PIPELINED`` switches between the two schedules: ``True`` posts
the all-gather's receives before the reduce-scatter and sends each final payload as soon
as it is encoded; ``False`` sends them all after the reduce-scatter. Each iteration runs
every (codec, schedule) pair once, in turn; an iteration's time is the slowest rank's;
the table gives medians::

    mpirun -n 2 python -m bench.compression_overlap -m 4M:64M -i 9 -x 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if not __package__:  # run as a script: find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import parse_size_range, power_of_two_sizes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI  # noqa: PLC0415

    from mpicoll import compression  # noqa: PLC0415
    from mpicoll.compression import ring  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--message-size", type=parse_size_range, default="4M:64M")
    parser.add_argument("-i", "--iterations", type=int, default=9)
    parser.add_argument("-x", "--warmup", type=int, default=2)
    parser.add_argument("--codecs", nargs="+", default=["int8", "onebit"])
    parser.add_argument("--output", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    variants = {"before": False, "after": True}
    original = ring._PIPELINED
    rows = []
    if rank == 0:
        print(f"# compressed ring, n = {n}, layout flat, error feedback on; median of "
              f"{args.iterations} after {args.warmup} warm-up (slowest rank per iteration)")
        print(f"# {'Size':>10} {'codec':<8}{'before ms':>11}{'after ms':>10}{'after/before':>14}")
    for size in power_of_two_sizes(*args.message_size):
        x = np.random.default_rng([rank, size]).standard_normal(size // 4).astype(np.float32)
        for codec in args.codecs:
            fbs = {v: compression.ErrorFeedback() for v in variants}
            out = np.empty_like(x)
            times = {v: np.zeros(args.iterations) for v in variants}
            for it in range(args.warmup + args.iterations):
                for v, flag in variants.items():
                    ring._PIPELINED = flag
                    comm.Barrier()
                    t0 = time.perf_counter()
                    compression.allreduce(x, out, compression=codec, feedback=fbs[v],
                                          layout="flat")
                    if it >= args.warmup:
                        times[v][it - args.warmup] = time.perf_counter() - t0
            med = {}
            for v in variants:
                slowest = np.empty_like(times[v])
                comm.Allreduce(times[v], slowest, op=MPI.MAX)
                med[v] = float(np.median(slowest))
            rows.append({"n": n, "bytes": size, "codec": codec, "before_s": med["before"],
                         "after_s": med["after"], "ratio": med["after"] / med["before"]})
            if rank == 0:
                print(f"  {size:>10} {codec:<8}{med['before'] * 1e3:>11.2f}"
                      f"{med['after'] * 1e3:>10.2f}{med['after'] / med['before']:>14.3f}",
                      flush=True)
    ring._PIPELINED = original
    if rank == 0 and args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
