"""Shared machinery of the benchmarks: OSU-style options, MPI start-up at a chosen thread
level, sizes, timing statistics across ranks, headers, output formats and progress.

Nothing here imports ``mpi4py.MPI`` at module import: :func:`start_mpi` does, after
``mpi4py.rc.thread_level`` has been set from ``--thread-level``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = ["THREAD_LEVELS", "mpirun_command", "add_common_options", "parse_size",
           "parse_size_range", "power_of_two_sizes", "start_mpi", "thread_level_name",
           "library_version", "machine_description", "memcpy_bandwidth", "Row", "RankStats",
           "rank_stats", "write_rows", "format_osu_rows", "Progress", "iterations_for",
           "human_bytes", "BUS_FACTOR", "REPO_ROOT", "relative_paths", "command_line", "run_meta",
           "parse_args", "report_validation", "write_results"]

#: ``--thread-level`` choices -> mpi4py rc values.
THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")

KiB, MiB = 1024, 1024 * 1024

#: The repository checkout the benchmarks run from (paths in results are relative to it).
REPO_ROOT = Path(__file__).resolve().parent.parent

# an installed-packages folder (site- or dist-packages), with everything before it
_PACKAGES_DIR = re.compile(r"(?<![\w.-])/[^\s:'\"()]*?/(?:site|dist)-packages/")

#: nccl-tests bus-bandwidth factor: busbw = algbw * BUS_FACTOR[collective](n).
BUS_FACTOR = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def mpirun_command(n: int) -> list[str]:
    """The launcher words a driver puts before ``python ...`` to run ``n`` ranks.

    ``MPICOLL_BENCH_MPIRUN`` (a command prefix, split like a shell line) replaces the
    ``mpirun`` next to this Python: ``MPICOLL_BENCH_MPIRUN="cluster/cluster mpirun -ppn 1"``
    runs the driver's launches across the namespace test bed (docs/cluster.md). Open MPI's
    ``mpirun`` gets ``--oversubscribe``.

    Raises:
        SystemExit: no ``mpirun`` found.
    """
    prefix = os.environ.get("MPICOLL_BENCH_MPIRUN", "").strip()
    if prefix:
        return [*shlex.split(prefix), "-n", str(n)]
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        raise SystemExit("mpirun not found")
    cmd = [exe, "-n", str(n)]
    if "Open MPI" in subprocess.run([exe, "--version"], capture_output=True, text=True).stdout:
        cmd.insert(1, "--oversubscribe")
    return cmd


def parse_size(text: str) -> int:
    """``"64"``, ``"4K"``, ``"16M"``, ``"1G"`` (binary units) -> bytes.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", 1024 * MiB)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0: {text!r}")
    return value


def parse_size_range(text: str) -> tuple[int, int]:
    """OSU's ``-m``: ``MIN:MAX``, ``MAX`` or ``MIN:`` (binary suffixes allowed)."""
    if ":" in text:
        lo, hi = text.split(":", 1)
        lo_b = parse_size(lo) if lo else 1
        hi_b = parse_size(hi) if hi else 1 * MiB
    else:
        lo_b, hi_b = 1, parse_size(text)
    if lo_b > hi_b:
        raise argparse.ArgumentTypeError(f"-m {text}: MIN is larger than MAX")
    return lo_b, hi_b


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (an iteration or call count,
    a window), refused by the parser on every rank alike."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def power_of_two_sizes(lo: int, hi: int, step: int = 2) -> list[int]:
    """Powers of ``step`` from the first one >= ``lo`` up to ``hi`` (OSU's rows)."""
    sizes, s = [], 1
    while s < max(lo, 1):
        s *= 2
    while s <= hi:
        sizes.append(s)
        s *= step
    return sizes


def human_bytes(n: int) -> str:
    """``8 B``, ``64 KiB``, ``16 MiB``."""
    for unit, m in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def add_common_options(parser: argparse.ArgumentParser, *, default_range: str,
                       iterations: int, warmup: int, iterations_large: int = 20,
                       output: str | None = None) -> None:
    """The OSU options plus mpicoll's output options."""
    parser.add_argument("-m", "--message-size", type=parse_size_range, default=default_range,
                        metavar="MIN:MAX",
                        help=f"message sizes in bytes, powers of two (default {default_range};"
                             " K/M/G suffixes allowed)")
    parser.add_argument("-i", "--iterations", type=at_least(1), default=iterations,
                        help=f"timed iterations per size (default {iterations})")
    parser.add_argument("-x", "--warmup", type=at_least(0), default=warmup,
                        help=f"warm-up iterations per size (default {warmup})")
    parser.add_argument("--iterations-large", type=at_least(1), default=iterations_large,
                        help=f"iterations above --large-size (default {iterations_large}; "
                             f"OSU's -i large)")
    parser.add_argument("--large-size", type=parse_size, default=MiB,
                        help="sizes above this use --iterations-large (default 1M)")
    parser.add_argument("-f", "--full", action="store_true",
                        help="full statistics: min/avg/max over ranks")
    parser.add_argument("-c", "--validate", action="store_true",
                        help="validate results against an independently computed reference")
    parser.add_argument("--thread-level", choices=THREAD_LEVELS, default=None,
                        help="MPI thread level to request (default: mpi4py's, MULTIPLE "
                             "unless MPI4PY_RC_THREAD_LEVEL says otherwise)")
    parser.add_argument("--format", choices=("osu", "csv", "json"), default="osu",
                        help="output format (default osu)")
    parser.add_argument("--output", metavar="FILE", default=output,
                        help="write the --format output here (stdout still shows the table)"
                             + (f"; default {output}" if output else ""))
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def iterations_for(args: argparse.Namespace, nbytes: int) -> tuple[int, int]:
    """(warm-up, timed iterations) for ``nbytes``."""
    if nbytes > args.large_size:
        return min(args.warmup, 2), min(args.iterations, args.iterations_large)
    return args.warmup, args.iterations


def start_mpi(thread_level: str | None) -> Any:
    """Set ``mpi4py.rc.thread_level`` (when given) and return ``mpi4py.MPI``.

    Raises:
        RuntimeError: MPI was already imported at a different level than asked.
    """
    import mpi4py  # noqa: PLC0415

    if thread_level is not None:
        if "mpi4py.MPI" in sys.modules:
            from mpi4py import MPI  # noqa: PLC0415

            if thread_level_name(MPI.Query_thread()).lower() != f"mpi_thread_{thread_level}":
                raise RuntimeError("mpi4py.MPI was imported before --thread-level was applied")
        mpi4py.rc.thread_level = thread_level
    from mpi4py import MPI  # noqa: PLC0415

    return MPI


def thread_level_name(level: int) -> str:
    """``MPI.THREAD_MULTIPLE`` -> ``"MPI_THREAD_MULTIPLE"``."""
    from mpi4py import MPI  # noqa: PLC0415

    return {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
            MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
            MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}.get(level, str(level))


def library_version() -> str:
    """First line of ``MPI.Get_library_version()`` plus the mpi4py version."""
    import mpi4py  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    first = MPI.Get_library_version().strip().splitlines()[0].strip()
    return f"{first} (mpi4py {mpi4py.__version__})"


def machine_description() -> str:
    """Host CPU model and core count, e.g. ``"x86_64, 2 cores, Intel(R) Xeon(R) ..."``."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores, {model}"


def relative_paths(text: str) -> str:
    """``text`` with this machine's absolute path prefixes removed, for recorded results.

    The repository root goes (``<root>/mpicoll/ops.py`` -> ``mpicoll/ops.py``), so do
    the folders of installed packages (everything up to and including a ``site-packages``
    or ``dist-packages`` folder) and of the standard library (``-> "<stdlib>/"``);
    anything else is kept.
    """
    text = _PACKAGES_DIR.sub("", text)
    for root in {str(REPO_ROOT), os.path.realpath(REPO_ROOT)}:
        text = text.replace(root + os.sep, "")
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        text = text.replace(stdlib.rstrip(os.sep) + os.sep, "<stdlib>/")
    return text


def command_line(n: int | None, module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reruns this benchmark from the repository root.

    ``mpirun -n N python -m bench.MODULE ARGS`` (``n`` ``None``: without ``mpirun``) with
    ``argv`` (default: ``sys.argv[1:]``);
    paths inside the repository are written relative to its root (see
    :func:`relative_paths`), so results record no machine-specific prefix.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parts = ([] if n is None else [f"mpirun -n {n}"]) + [f"python -m bench.{module}"]
    for a in args:
        path = Path(a)
        if path.is_absolute():
            try:
                a = str(path.resolve().relative_to(REPO_ROOT))
            except ValueError:
                a = relative_paths(a)
        parts.append(a)
    return " ".join(parts)


def parse_args(parser: argparse.ArgumentParser,
               argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` (default ``sys.argv[1:]``), keeping ``argv`` in
    ``args.argv`` for the command the results record (:func:`command_line`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def report_validation(failures: Sequence[str], validate: bool, what: str = "results") -> None:
    """Rank 0's last lines: each validation failure (stderr), or that all ``what`` were
    correct (when ``-c`` asked for validation)."""
    for f in failures:
        print(f"# VALIDATION FAILED: {f}", file=sys.stderr)
    if validate and not failures:
        sys.stdout.write(f"# validation: all {what} correct\n")


def run_meta(MPI: Any, n: int, module: str, argv: Sequence[str] | None = None) -> dict:
    """What every result records about its run: library, thread level, machine, date,
    exact command (see :func:`command_line`)."""
    return {
        "mpi_library": library_version(),
        "thread_level": thread_level_name(MPI.Query_thread()),
        "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command_line(n, module, argv),
    }


def memcpy_bandwidth(nbytes: int = 64 * MiB, repeats: int = 5) -> float:
    """One core's ``np.copyto`` bandwidth (GB/s, 1e9 bytes) on ``nbytes``: best of repeats.

    Counts the bytes copied once (as a copy benchmark does), not read + written.
    """
    import numpy as np  # noqa: PLC0415

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


@dataclass
class RankStats:
    """One statistic (seconds) of one timing over all ranks."""

    min: float
    avg: float
    max: float


def rank_stats(comm: Any, value: float) -> RankStats:
    """Min/avg/max of ``value`` over the ranks of ``comm`` (collective)."""
    values = comm.allgather(float(value))
    return RankStats(min(values), sum(values) / len(values), max(values))


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return statistics.median(values)


@dataclass
class Row:
    """One measured (size, algorithm) point; times in microseconds, bandwidths in GB/s."""

    test: str
    size: int
    algorithm: str
    avg_us: float
    min_us: float
    max_us: float
    iterations: int
    world_size: int
    bytes: int = 0
    algbw: float | None = None
    busbw: float | None = None
    ratio: float | None = None
    bandwidth_MBps: float | None = None
    validated: bool | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def _fmt(value: float | None, width: int, prec: int = 2) -> str:
    if value is None:
        return " " * (width - 1) + "-"
    return f"{value:{width}.{prec}f}"


def format_osu_rows(rows: Iterable[Row], *, full: bool, kind: str) -> str:
    """Rows in OSU's layout; ``kind`` is ``"latency"``, ``"bandwidth"`` or ``"collective"``."""
    out = io.StringIO()
    for r in rows:
        if kind == "bandwidth":
            out.write(f"{r.size:<10d}{_fmt(r.bandwidth_MBps, 20)}\n")
        elif kind == "latency":
            if full:
                out.write(f"{r.size:<10d}{_fmt(r.avg_us, 18)}{_fmt(r.min_us, 18)}"
                          f"{_fmt(r.max_us, 18)}{r.iterations:12d}\n")
            else:
                out.write(f"{r.size:<10d}{_fmt(r.avg_us, 18)}\n")
        else:
            line = f"{r.size:<10d} {r.algorithm:<20s}{_fmt(r.avg_us, 16)}"
            if full:
                line += f"{_fmt(r.min_us, 16)}{_fmt(r.max_us, 16)}{r.iterations:8d}"
            line += (f"{_fmt(r.algbw, 12, 3)}{_fmt(r.busbw, 12, 3)}{_fmt(r.ratio, 10)}"
                     f"{'  ok' if r.validated else ''}")
            out.write(line + "\n")
    return out.getvalue()


def osu_column_header(kind: str, full: bool) -> str:
    """The ``# Size ...`` line of OSU's table."""
    if kind == "bandwidth":
        return f"{'# Size':<10s}{'Bandwidth (MB/s)':>20s}\n"
    if kind == "latency":
        if full:
            return (f"{'# Size':<10s}{'Avg Latency(us)':>18s}{'Min Latency(us)':>18s}"
                    f"{'Max Latency(us)':>18s}{'Iterations':>12s}\n")
        return f"{'# Size':<10s}{'Avg Latency(us)':>18s}\n"
    line = f"{'# Size':<10s} {'Algorithm':<20s}{'Avg Latency(us)':>16s}"
    if full:
        line += f"{'Min Latency(us)':>16s}{'Max Latency(us)':>16s}{'Iters':>8s}"
    return line + f"{'algbw(GB/s)':>12s}{'busbw(GB/s)':>12s}{'vs MPI':>10s}\n"


def write_rows(path: str | None, fmt: str, meta: dict, rows: list[Row], osu_text: str) -> None:
    """Write the results to ``path`` (``None``: stdout) in ``fmt``."""
    if fmt == "osu":
        text = osu_text
    elif fmt == "json":
        text = json.dumps({"meta": meta, "results": [r.as_dict() for r in rows]}, indent=1) + "\n"
    else:
        buf = io.StringIO()
        dicts = [r.as_dict() for r in rows]
        keys: list[str] = []
        for d in dicts:
            keys.extend(k for k in d if k not in keys)
        metakeys = ["mpi_library", "thread_level", "dtype", "op"]
        writer = csv.DictWriter(buf, fieldnames=keys + [k for k in metakeys if k in meta])
        writer.writeheader()
        for d in dicts:
            writer.writerow({**d, **{k: meta[k] for k in metakeys if k in meta}})
        text = buf.getvalue()
    if path is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)


def write_results(args: argparse.Namespace, meta: dict, rows: list[Row], osu_text: str) -> None:
    """Rank 0's results as the options ask: ``--output`` in ``--format`` (``osu_text`` for
    ``osu``), or a non-OSU ``--format`` on stdout (the OSU table was printed as it grew)."""
    if args.output:
        write_rows(args.output, args.format, meta, rows, osu_text)
    elif args.format != "osu":
        write_rows(None, args.format, meta, rows, "")


class Progress:
    """Progress lines on stderr (rank 0 only) for long sweeps: at most one every ``every`` s."""

    def __init__(self, enabled: bool, label: str, total: int, every: float = 5.0) -> None:
        self.enabled, self.label, self.total, self.every = enabled, label, total, every
        self.start = self.last = time.monotonic()

    def step(self, done: int, what: str) -> None:
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every or done == self.total):
            self.last = now
            print(f"[{self.label}] {done}/{self.total} {what} "
                  f"({now - self.start:.1f} s elapsed)", file=sys.stderr, flush=True)
