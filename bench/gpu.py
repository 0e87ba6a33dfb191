"""GPU all-reduce: the staged path pipelined vs unpipelined vs host arrays, 4 KiB - 256 MiB.

    mpirun -n 2 python -m bench.gpu [-m 4K:256M] [-i 20] [-x 3] [-c] [--format json]
           [--output FILE] [--device cuda|sim]

Three ways to all-reduce ``size`` bytes of float32, measured interleaved (each iteration
runs them in a rotating order, every rank starting together after a barrier):

- ``staged_pipelined``: device arrays through :func:`mpicoll.gpu.staging.staged` (pinned
  slots, d2h of chunk k+1 and h2d of chunk k-1 overlapping the host all-reduce of chunk k);
- ``staged_unpipelined``: the same path with one chunk of the whole message: copy out,
  host all-reduce, copy in (one pinned buffer of the message's size);
- ``host``: ``mpicoll.allreduce`` in place on host (numpy) arrays of the same size: the
  host collective alone, the floor of both staged variants.

The issue's targets are checked and recorded: at >= 16 MiB pipelined <= 0.8x unpipelined;
at 256 MiB pipelined <= 1.25x host. ``--device sim`` runs the same code on the CPU with
:class:`mpicoll.gpu.numpy_copies.NumpyCopies` (numpy arrays stand in for device arrays,
every copy a synchronous ``numpy.copyto``; its timings mean nothing: it is the smoke test
of this script).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from . import common

VARIANTS = ("staged_pipelined", "staged_unpipelined", "host")
KiB, MiB = 1024, 1024 * 1024


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_options(parser, default_range="4K:256M", iterations=20, warmup=3)
    parser.add_argument("--device", choices=("cuda", "sim"), default="cuda",
                        help="cuda (CuPy arrays) or sim (host stand-in, for smoke tests)")
    parser.add_argument("--step", type=int, default=2,
                        help="size step factor (default 2: every power of two)")
    return parser


class Device:
    """The device side of the benchmark: arrays, copies, synchronisation."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "cuda":
            import cupy  # noqa: PLC0415

            from mpicoll.gpu.cupy_copies import CupyCopies  # noqa: PLC0415
            from mpicoll.gpu.device import select_device  # noqa: PLC0415

            self.xp = cupy
            self.ordinal = select_device()
            self.copies = CupyCopies(self.ordinal)
            props = cupy.cuda.runtime.getDeviceProperties(self.ordinal)
            self.name = props["name"].decode()
        else:
            from mpicoll.gpu.numpy_copies import NumpyCopies  # noqa: PLC0415
            from mpicoll.gpu.slots import HostSlots  # noqa: PLC0415

            self.xp = np
            self.ordinal = None
            self.copies = NumpyCopies(HostSlots(lambda n: np.empty(n, np.uint8)))
            self.name = "simulated (numpy)"

    def synchronize(self) -> None:
        if self.kind == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def asnumpy(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a) if self.kind == "cuda" else np.asarray(a)


def _variants(dev: Device, comm: Any, count: int) -> tuple[dict[str, Callable[[], Any]],
                                                           dict[str, Any]]:
    import mpicoll  # noqa: PLC0415
    from mpicoll import IN_PLACE  # noqa: PLC0415
    from mpicoll.gpu import staging  # noqa: PLC0415

    rank = comm.Get_rank()
    data = ((np.arange(count) + rank) % 7).astype(np.float32)
    x = dev.xp.asarray(data)
    outs = {"staged_pipelined": dev.xp.empty_like(x), "staged_unpipelined":
            dev.xp.empty_like(x), "host": np.empty_like(data)}
    host_buf = outs["host"]
    nbytes = count * 4

    def host_call(a: tuple) -> Any:
        return mpicoll.allreduce(*a, comm=comm)

    def pipelined() -> Any:
        return staging.staged("allreduce", (x, outs["staged_pipelined"], "sum"), host_call,
                              comm=comm, copies=dev.copies)

    def unpipelined() -> Any:
        return staging.staged("allreduce", (x, outs["staged_unpipelined"], "sum"),
                              host_call, comm=comm, copies=dev.copies, pipeline=False,
                              chunk_bytes=nbytes, staging_limit=max(3 * nbytes,
                                                                    staging.NSLOTS))

    def host() -> Any:
        np.copyto(host_buf, data)  # same input every time (not timed apart: a copy of
        return mpicoll.allreduce(IN_PLACE, host_buf, comm=comm)  # the size, in cache)

    return ({"staged_pipelined": pipelined, "staged_unpipelined": unpipelined,
             "host": host}, outs)


def _time(comm: Any, dev: Device, fns: dict[str, Callable[[], Any]], warmup: int,
          iters: int) -> dict[str, list[float]]:
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(warmup + iters):
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            dev.synchronize()
            comm.Barrier()
            t0 = time.perf_counter()
            fns[name]()
            dev.synchronize()
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    return times


def run(args: argparse.Namespace) -> int:
    MPI = common.start_mpi(args.thread_level)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    dev = Device(args.device)
    lo, hi = args.message_size
    sizes = [s for s in common.power_of_two_sizes(max(lo, 4), hi, args.step)]
    meta = common.run_meta(MPI, n, "gpu", args.argv)
    meta.update({"dtype": "float32", "op": "sum", "device": dev.name,
                 "device_kind": args.device, "world_size": n})
    try:
        from mpicoll.gpu import detect  # noqa: PLC0415

        meta["cuda_aware"] = list(detect.cuda_aware())
    except ValueError as exc:
        meta["cuda_aware"] = [False, str(exc)]
    rows: list[common.Row] = []
    failures: list[str] = []
    progress = common.Progress(rank == 0 and not args.quiet, "gpu", len(sizes))
    header = (f"# mpicoll GPU all-reduce: staged pipelined vs unpipelined vs host arrays\n"
              f"# {meta['mpi_library']}, {meta['thread_level']}, {n} ranks, device "
              f"{dev.name}\n" + common.osu_column_header("collective", args.full))
    if rank == 0 and args.format == "osu" and not args.output:
        sys.stdout.write(header)
    for i, nbytes in enumerate(sizes):
        count = nbytes // 4
        fns, outs = _variants(dev, comm, count)
        warmup, iters = common.iterations_for(args, nbytes)
        times = _time(comm, dev, fns, warmup, iters)
        medians = {k: statistics.median(v) for k, v in times.items()}
        stats = {k: common.rank_stats(comm, v) for k, v in medians.items()}
        if args.validate:
            want = sum(((np.arange(count) + r) % 7).astype(np.float32) for r in range(n))
            for name, out in outs.items():
                if not np.array_equal(dev.asnumpy(out), want):
                    failures.append(f"{name} at {nbytes} bytes on rank {rank}")
        for name in VARIANTS:
            st = stats[name]
            algbw = nbytes / st.max / 1e9 if st.max > 0 else None
            rows.append(common.Row(
                test="gpu_allreduce", size=nbytes, algorithm=name, avg_us=st.avg * 1e6,
                min_us=st.min * 1e6, max_us=st.max * 1e6, iterations=iters, world_size=n,
                bytes=nbytes, algbw=algbw,
                busbw=None if algbw is None else algbw * common.BUS_FACTOR["allreduce"](n),
                ratio=st.max / stats["host"].max if stats["host"].max > 0 else None,
                validated=True if args.validate else None,
                extra={"vs_unpipelined": st.max / stats["staged_unpipelined"].max}))
        if rank == 0 and args.format == "osu" and not args.output:
            sys.stdout.write(common.format_osu_rows(rows[-3:], full=args.full,
                                                    kind="collective"))
            sys.stdout.flush()
        progress.step(i + 1, f"{common.human_bytes(nbytes)}")
        del fns, outs
    failures = [f for part in comm.allgather(failures) for f in part]
    meta["targets"] = targets(rows)
    if rank == 0:
        osu = header + common.format_osu_rows(rows, full=args.full, kind="collective")
        common.write_results(args, meta, rows, osu)
        for line in meta["targets"]["lines"]:
            print(f"# {line}")
        common.report_validation(failures, args.validate)
    return 1 if failures else 0


def targets(rows: list[common.Row]) -> dict:
    """The issue's targets, checked on the measured rows."""
    by = {(r.size, r.algorithm): r.max_us for r in rows}
    sizes = sorted({r.size for r in rows})
    lines, ok = [], True
    big = [s for s in sizes if s >= 16 * MiB]
    for s in big:
        ratio = by[(s, "staged_pipelined")] / by[(s, "staged_unpipelined")]
        good = ratio <= 0.8
        ok &= good
        lines.append(f"{common.human_bytes(s)}: pipelined / unpipelined = {ratio:.2f} "
                     f"({'meets' if good else 'misses'} <= 0.80)")
    if 256 * MiB in sizes:
        ratio = by[(256 * MiB, "staged_pipelined")] / by[(256 * MiB, "host")]
        good = ratio <= 1.25
        ok &= good
        lines.append(f"256 MiB: pipelined / host = {ratio:.2f} "
                     f"({'meets' if good else 'misses'} <= 1.25)")
    if not lines:
        lines.append("no size >= 16 MiB measured: targets not checked")
        ok = None
    return {"met": ok, "lines": lines}


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args(build_parser(), argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
