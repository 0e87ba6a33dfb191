"""torch.distributed operations on "mpicoll" against gloo, per call: ``gather``,
``scatter``, ``all_to_all_single`` and ``barrier`` (the ones the backend hands to MPI's
own collectives), ``all_reduce`` and ``all_reduce_future`` (``async_op=True``, then the
future's ``wait()``, as DDP's reducer waits), synchronous, on the default "mpicoll" group,
on a "mpicoll" group that agrees on the first call of each kind only
(``mpicoll-first``: the operation itself, with no agreement step before it) and on a gloo
group of the same ranks, interleaved over ``--repeats`` rounds of ``--steps`` calls; rank
0 prints the median per call (the slowest rank's) for each size in ``--sizes`` (float32
elements per rank and peer).

    mpirun -n 4 python -m bench.dist_ops --sizes 256,262144
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from bench.bench_torch import interleaved_times, mpicoll_default_group
from mpicoll.torch.distributed import Options

OPERATIONS = ("gather", "scatter", "all_to_all_single", "barrier", "all_reduce",
              "all_reduce_future")
BACKENDS = ("mpicoll", "mpicoll-first", "gloo")


def operations(count: int, group: Any) -> dict[str, Callable[[], Any]]:
    """The timed calls for ``count`` elements per rank (and per peer) on ``group``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(count)
    parts = [torch.zeros(count) for _ in range(n)] if rank == 0 else None
    send, recv = torch.ones(count * n), torch.empty(count * n)
    summed = torch.zeros(count)
    return {"gather": lambda: dist.gather(x, parts, dst=0, group=group),
            "scatter": lambda: dist.scatter(x, parts, src=0, group=group),
            "all_to_all_single": lambda: dist.all_to_all_single(recv, send, group=group),
            "barrier": lambda: dist.barrier(group=group),
            "all_reduce": lambda: dist.all_reduce(summed, group=group),
            "all_reduce_future": lambda: dist.all_reduce(summed, group=group, async_op=True)
            .get_future().wait()}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run it; returns the rows (on every rank): operation, bytes, backend, median ms."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,262144",
                   help="float32 elements per rank and peer, comma-separated")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    started = mpicoll_default_group("bench.dist_ops")
    groups = {"mpicoll": dist.group.WORLD,
              "mpicoll-first": dist.new_group(pg_options=Options(check="first")),
              "gloo": dist.new_group(backend="gloo")}
    comm = MPI.COMM_WORLD
    rows = []
    for count in (int(s) for s in args.sizes.split(",")):
        calls = {(op, name): fn for name, group in groups.items()
                 for op, fn in operations(count, group).items()}
        times = interleaved_times(calls, args.steps, args.repeats, comm)
        rows += [{"operation": op, "bytes": 4 * count, "backend": name,
                  "median_ms": 1e3 * statistics.median(v)} for (op, name), v in times.items()]
    if comm.rank == 0:
        print(f"# {comm.size} ranks, median ms per call over {args.repeats} rounds of "
              f"{args.steps} calls (bytes: per rank and peer)")
        for op in OPERATIONS:
            for count in {r["bytes"] for r in rows}:
                cells = {r["backend"]: r["median_ms"] for r in rows
                         if r["operation"] == op and r["bytes"] == count}
                if cells:
                    print(f"{op:18s} {count:9d} B  " + "  ".join(
                        f"{name} {cells[name]:8.3f}" for name in BACKENDS))
    for name in BACKENDS[1:]:
        dist.destroy_process_group(groups[name])
    if started:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
