"""Gradient compression benchmark: codec throughput and the compressed all-reduce.

Four modes::

    python -m bench.compression codecs [-s 16M] [-i 20]          # one process
    mpirun -n 2 python -m bench.compression allreduce [-m 1M:64M] [-i 10] [-x 2]
    mpirun -n 2 python -m bench.compression reducescatter [-m 1M:64M] [-i 10] [-x 2]
    mpirun -n 2 python -m bench.compression allgather [-m 1M:64M] [-i 10] [-x 2]

``codecs`` times ``encode`` and ``decode`` of every codec on a float32 vector of ``-s``
bytes (standard normal data) and prints GB/s of input per second of encode+decode
(best of ``-i`` runs, the machine being shared), the bytes on the wire and the relative
error ``|x - decode(encode(x))| / |x|``.

``allreduce`` times, for each power-of-two size, MPI's own all-reduce (``native``),
mpicoll's ring (``ring``) and ``mpicoll.compression.allreduce`` with each codec (error
feedback on, as in training), interleaved within each iteration; it prints the average
and the median time (each iteration's time is the slowest rank's), the ratio of the
average to native's and the payload bytes each rank sent
(``mpicoll.compression.last_stats``; for ``ring`` the uncompressed ring's bytes), and of
those the bytes sent to other nodes (largest per rank, and summed over ranks).
``--layouts flat node`` runs each codec in each layout (methods ``int8@flat``,
``int8@node``; default: ``layout="auto"``, methods named by the codec alone).

``reducescatter`` and ``allgather`` do the same for ``mpicoll.compression.reduce_scatter``
(error feedback on; ``-m`` is the whole vector, rank ``i`` gets block ``i``; ``native`` is
``MPI_Reduce_scatter``) and ``mpicoll.compression.allgather`` (error feedback off, its
default; ``-m`` is each rank's block; ``native`` is ``MPI_Allgather``); ``ring`` is
mpicoll's uncompressed ring of the same collective, and the bytes of ``native``/``ring``
the uncompressed ring's ``(n-1)/n`` of the vector (reduce-scatter) or ``n - 1`` blocks
(all-gather).

``--format csv|json --output PATH`` writes the rows as well. Options: ``--help``.
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

from bench.common import (at_least, human_bytes, machine_description, parse_size,  # noqa: E402
                          parse_size_range, power_of_two_sizes)

CODECS = ["none", "fp16", "bf16", "int8", "int8:stochastic", "onebit", "topk:0.01",
          "randomk:0.01"]
ALLREDUCE_CODECS = ["fp16", "bf16", "int8", "onebit", "topk:0.01"]


def bench_codecs(args: argparse.Namespace) -> list[dict]:
    """Encode/decode throughput of each codec, best of ``args.iterations`` runs."""
    from mpicoll.compression import get_codec, new_payload  # noqa: PLC0415

    count = args.size // 4
    x = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    out = np.empty_like(x)
    rows = []
    print(f"# mpicoll.compression codec throughput: {human_bytes(args.size)} float32, "
          f"best of {args.iterations}")
    print(f"# {'codec':<16}{'encode ms':>11}{'decode ms':>11}{'GB/s':>8}{'enc GB/s':>10}"
          f"{'dec GB/s':>10}{'wire bytes':>13}{'ratio':>8}{'rel err':>10}")
    for spec in args.codecs or CODECS:
        codec = get_codec(spec)
        _, parts = new_payload(codec, count)
        enc = dec = float("inf")
        for _ in range(args.iterations):
            t0 = time.perf_counter()
            codec.encode(x, parts)
            t1 = time.perf_counter()
            codec.decode(parts, count, np.float32, out)
            t2 = time.perf_counter()
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
        wire = codec.wire_bytes(count)
        err = float(np.linalg.norm(out - x) / np.linalg.norm(x))
        row = {"codec": codec.name, "bytes": args.size, "encode_s": enc, "decode_s": dec,
               "gbps": args.size / (enc + dec) / 1e9, "encode_gbps": args.size / enc / 1e9,
               "decode_gbps": args.size / dec / 1e9, "wire_bytes": wire,
               "ratio": args.size / wire, "rel_error": err}
        rows.append(row)
        print(f"  {row['codec']:<16}{enc * 1e3:>11.2f}{dec * 1e3:>11.2f}{row['gbps']:>8.2f}"
              f"{row['encode_gbps']:>10.2f}{row['decode_gbps']:>10.2f}{wire:>13}"
              f"{row['ratio']:>8.1f}{err:>10.2e}", flush=True)
    return rows


class _Collective:
    """One collective's calls for the timing loop: MPI's, mpicoll's ring, the codec's."""

    def __init__(self, mode: str, comm, n: int, rank: int) -> None:
        import mpicoll  # noqa: PLC0415
        from mpicoll import compression  # noqa: PLC0415
        from mpicoll.partition import block_bounds  # noqa: PLC0415

        self.mode, self.comm, self.n = mode, comm, n
        self.compression, self.mpicoll = compression, mpicoll
        self.block_bounds = block_bounds
        self.rank = rank

    def output(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "allreduce":
            return np.empty_like(x)
        if self.mode == "allgather":
            return np.empty(x.size * self.n, x.dtype)
        b = self.block_bounds(x.size, self.n)
        return np.empty(b[self.rank + 1] - b[self.rank], x.dtype)

    def native(self, x: np.ndarray, out: np.ndarray) -> None:
        if self.mode == "allreduce":
            self.comm.Allreduce(x, out)
        elif self.mode == "allgather":
            self.comm.Allgather(x, out)
        else:
            b = self.block_bounds(x.size, self.n)
            self.comm.Reduce_scatter(x, out, [b[i + 1] - b[i] for i in range(self.n)])

    def ring(self, x: np.ndarray, out: np.ndarray) -> None:
        name = {"reducescatter": "reduce_scatter"}.get(self.mode, self.mode)
        getattr(self.mpicoll, name)(x, out, algorithm="ring")

    def coded(self, x: np.ndarray, out: np.ndarray, codec: str, layout: str, fb) -> None:
        c = self.compression
        if self.mode == "allreduce":
            c.allreduce(x, out, compression=codec, feedback=fb, layout=layout)
        elif self.mode == "allgather":
            c.allgather(x, out, compression=codec)
        else:
            c.reduce_scatter(x, out, compression=codec, feedback=fb)

    def ring_bytes(self, size: int) -> int:
        """What the uncompressed ring sends per rank."""
        if self.mode == "allreduce":
            return 2 * (self.n - 1) * size // self.n
        if self.mode == "allgather":
            return (self.n - 1) * size
        return (self.n - 1) * size // self.n


def bench_collective(args: argparse.Namespace) -> list[dict]:
    """Compressed vs uncompressed collective (``args.mode``) times and bytes per rank,
    under mpirun."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpicoll import compression  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    coll = _Collective(args.mode, comm, n, rank)
    lo, hi = args.message_size
    codecs = args.codecs or ALLREDUCE_CODECS
    if args.layouts and args.mode == "allreduce":
        coded = {f"{c}@{lay}": (c, lay) for c in codecs for lay in args.layouts}
    else:
        coded = {c: (c, "auto") for c in codecs}
    methods = ["native", "ring", *coded]
    rows = []
    if rank == 0:
        name = {"reducescatter": "reduce_scatter"}.get(args.mode, args.mode)
        op = ", op = sum" if args.mode != "allgather" else ""
        fb = "off" if args.mode == "allgather" else "on"
        print(f"# mpicoll.compression.{name} vs uncompressed, n = {n}{op}, "
              f"float32, error feedback {fb}; {args.iterations} iterations after "
              f"{args.warmup} warm-up; an iteration's time is the slowest rank's")
        print(f"# {'Size':>10} {'method':<16}{'avg ms':>10}{'median ms':>11}{'x native':>10}"
              f"{'MB sent/rank':>14}{'MB across':>11}{'rel err':>10}")
    for size in power_of_two_sizes(lo, hi):
        count = size // 4
        x = np.random.default_rng([rank, size]).standard_normal(count).astype(np.float32)
        exact = coll.output(x)
        coll.native(x, exact)
        outs = {m: coll.output(x) for m in methods}
        fbs = {m: compression.ErrorFeedback() for m in methods}
        times = {m: np.zeros(args.iterations) for m in methods}
        sent = {m: (0, 0) for m in methods}

        def run(m: str, x: np.ndarray = x, outs: dict = outs, fbs: dict = fbs,
                sent: dict = sent) -> None:
            if m == "native":
                coll.native(x, outs[m])
            elif m == "ring":
                coll.ring(x, outs[m])
            else:
                codec, layout = coded[m]
                coll.coded(x, outs[m], codec, layout, fbs[m])
                stats = compression.last_stats()
                sent[m] = (stats.bytes_sent, stats.inter_node_bytes)

        first_err = {}   # each method's error after its first call (error feedback empty)
        for it in range(args.warmup + args.iterations):
            for m in methods:  # interleaved: every method sees the same machine state
                comm.Barrier()
                t0 = time.perf_counter()
                run(m)
                dt = time.perf_counter() - t0
                if it >= args.warmup:
                    times[m][it - args.warmup] = dt
                if it == 0:
                    first_err[m] = float(np.linalg.norm(outs[m] - exact)
                                         / max(np.linalg.norm(exact), 1e-30))
        ring_bytes = coll.ring_bytes(size)
        slowest = {m: np.empty_like(times[m]) for m in methods}
        for m in methods:  # each iteration's time: the slowest rank's
            comm.Allreduce(times[m], slowest[m], op=MPI.MAX)
        base = float(slowest["native"].mean())
        for m in methods:
            t, med = float(slowest[m].mean()), float(np.median(slowest[m]))
            mine = sent[m] if m in coded else (ring_bytes, None)
            b = comm.allreduce(mine[0], op=MPI.MAX)
            across = None if mine[1] is None else comm.allreduce(mine[1], op=MPI.MAX)
            total = None if mine[1] is None else comm.allreduce(mine[1], op=MPI.SUM)
            err = comm.allreduce(first_err[m], op=MPI.MAX)
            row = {"bytes": size, "method": m, "n": n, "time_s": t, "median_s": med,
                   "vs_native": t / base, "median_vs_native":
                   med / float(np.median(slowest["native"])),
                   "bytes_sent_per_rank": b, "inter_node_bytes_per_rank": across,
                   "inter_node_bytes_total": total, "rel_error_first_call": err}
            rows.append(row)
            if rank == 0:
                shown = "-" if across is None else f"{across / 1e6:.2f}"
                print(f"  {size:>10} {m:<16}{t * 1e3:>10.2f}{med * 1e3:>11.2f}"
                      f"{t / base:>10.2f}{b / 1e6:>14.2f}{shown:>11}{err:>10.2e}", flush=True)
    return rows if rank == 0 else []


def _rank() -> int:
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.COMM_WORLD.Get_rank()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["codecs", "allreduce", "reducescatter", "allgather"])
    parser.add_argument("-s", "--size", type=parse_size, default="16M",
                        help="codecs: vector size in bytes (default 16M)")
    parser.add_argument("-m", "--message-size", type=parse_size_range, default="1M:64M",
                        help="allreduce: MIN:MAX bytes, powers of two (default 1M:64M)")
    parser.add_argument("-i", "--iterations", type=at_least(1), default=None,
                        help="timed runs (default 20 for codecs, 10 for allreduce)")
    parser.add_argument("-x", "--warmup", type=at_least(0), default=2,
                        help="allreduce warm-up runs")
    parser.add_argument("--codecs", nargs="+", default=None, help="codec specs to run")
    parser.add_argument("--layouts", nargs="+", choices=["auto", "flat", "node"], default=None,
                        help="allreduce: run each codec in each of these layouts "
                             "(default: auto only)")
    parser.add_argument("--format", choices=["csv", "json"], default=None)
    parser.add_argument("--output", default=None, help="file for --format (default stdout)")
    args = parser.parse_args(argv)
    if args.iterations is None:
        args.iterations = 20 if args.mode == "codecs" else 10
    if args.mode == "codecs" or _rank() == 0:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"{machine_description()}")
    rows = bench_codecs(args) if args.mode == "codecs" else bench_collective(args)
    if args.format and rows:
        if args.format == "json":
            text = json.dumps(rows, indent=1)
        else:
            keys = list(rows[0])
            text = "\n".join([",".join(keys)] + [",".join(str(r[k]) for k in keys)
                                                   for r in rows]) + "\n"
        if args.output:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
