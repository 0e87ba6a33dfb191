"""Parameter-server benchmarks: aggregation throughput vs all-reduce; loss vs wall time.

Two parts, each a driver that launches its own ``mpirun`` runs (with timeouts):

``throughput``
    Every worker pushes ``S`` bytes of float32 gradient and pulls the aggregate back
    (``optimizer="sum"``, ``bsp``: one ``push_pull``), against ``mpicoll.allreduce`` and the
    MPI library's ``Allreduce`` of the same ``S`` bytes among the same workers, interleaved
    iteration by iteration. Throughput is ``S / time`` (nccl-tests' algbw) of the slowest
    worker; ``ratio`` = PS throughput / mpicoll all-reduce throughput.

``training``
    ``examples/ps_train.py`` under ``bsp``, ``ssp`` (several bounds) and ``asp`` with one
    straggling worker (sleeps every step); records the first worker's test loss against
    wall time and plots it.

A config is ``SERVERSxWORKERS`` (separate server ranks), ``cxWORKERS``: the co-located
layout (``num_servers="colocated"``: every one of the WORKERS ranks is also the server of
its shard), or ``caxWORKERS``: co-located with ``keep_aggregate=False`` (the aggregate goes
straight into ``out`` and is not kept). From the repository root::

    python -m bench.bench_ps throughput --configs 1x2,2x2,cx2,1x3,3x3,cx3 -m 16M -i 10
    python -m bench.bench_ps training --workers 3 --straggler-delay 0.01
    python -m bench.bench_ps all --out docs        # both, JSON + PNG into docs/

The JSON records the date, the command relative to the repository root (``python -m
bench.bench_ps ...``) and no absolute path of the machine; docs/results/ps.md shows the
results with their commands.

The rank programs (``_throughput_rank``) are what the drivers run under ``mpirun``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import command_line, relative_paths  # noqa: E402

MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def mpirun(n: int) -> list[str]:
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        raise SystemExit("mpirun not found")
    cmd = [exe, "-n", str(n)]
    if "Open MPI" in subprocess.run([exe, "--version"], capture_output=True, text=True).stdout:
        cmd.insert(1, "--oversubscribe")
    return cmd


def launch(n: int, args: list[str], timeout: float) -> tuple[int, str]:
    cmd = mpirun(n) + [sys.executable, "-m", "mpi4py", *args]
    print("+", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, PYTHONPATH=ROOT), start_new_session=True)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        return 124, f"timeout after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"


def launch_json(n: int, args: list[str], label: str, timeout: float) -> dict | None:
    """Launch ``args --json FILE`` on ``n`` ranks; the JSON it wrote, or None if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        rc, text = launch(n, [*args, "--json", out], timeout)
        if rc != 0:
            print(f"# {label} failed (rc={rc}):\n{text[-2000:]}")
            return None
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


# ---------------------------------------------------------------------- rank programs
def throughput_rank(argv: list[str]) -> int:
    import numpy as np
    from mpi4py import MPI

    import mpicoll
    from mpicoll.ps import ParameterServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", required=True, help="a number, or 'colocated'")
    ap.add_argument("-m", "--size", default="16M")
    ap.add_argument("-i", "--iters", type=int, default=10)
    ap.add_argument("-x", "--warmup", type=int, default=2)
    ap.add_argument("--json", required=True)
    ap.add_argument("--max-sleep", type=float, default=1e-3)
    ap.add_argument("--chunk-bytes", default="4M")
    ap.add_argument("--no-keep", action="store_true", help="keep_aggregate=False")
    a = ap.parse_args(argv)
    nbytes = parse_size(a.size)
    count = nbytes // 4
    comm = MPI.COMM_WORLD
    servers = a.servers if a.servers == "colocated" else int(a.servers)
    ps = ParameterServer({"x": np.zeros(count, np.float32)}, comm=comm,
                         num_servers=servers, optimizer="sum", split_bytes=1 << 16,
                         max_sleep=a.max_sleep, chunk_bytes=parse_size(a.chunk_bytes),
                         keep_aggregate=not a.no_keep)
    if ps.is_server:
        ps.serve()
        ps.free()
        return 0
    wc = ps.worker_comm
    g = ((np.arange(count) % 1000) + ps.worker_index).astype(np.float32)   # exact sums
    out = {"x": np.empty(count, np.float32)}
    ar = np.empty(count, np.float32)
    nat = np.empty(count, np.float32)
    times = {"ps": [], "allreduce": [], "native": []}
    for it in range(a.warmup + a.iters):
        wc.Barrier()
        t0 = time.perf_counter()
        ps.push_pull({"x": g}, out=out)
        t1 = time.perf_counter()
        wc.Barrier()
        t2 = time.perf_counter()
        mpicoll.allreduce(g, ar, comm=wc)
        t3 = time.perf_counter()
        wc.Barrier()
        t4 = time.perf_counter()
        wc.Allreduce(g, nat, op=MPI.SUM)
        t5 = time.perf_counter()
        if it >= a.warmup:
            times["ps"].append(t1 - t0)
            times["allreduce"].append(t3 - t2)
            times["native"].append(t5 - t4)
    valid = bool(np.array_equal(out["x"], ar) and np.array_equal(ar, nat))
    valid = wc.allreduce(valid, op=MPI.LAND)
    worst = {k: wc.allreduce(float(np.mean(v)), op=MPI.MAX) for k, v in times.items()}
    best = {k: wc.allreduce(float(np.min(v)), op=MPI.MAX) for k, v in times.items()}
    stats = ps.stats()
    ps.close()
    if ps.worker_index == 0:
        row = {"servers": servers, "workers": ps.num_workers,
               "keep_aggregate": not a.no_keep, "bytes": nbytes, "iters": a.iters,
               "valid": valid, "avg_s": worst, "min_s": best,
               "gbps": {k: nbytes / v / 1e9 for k, v in worst.items()},
               "bytes_per_server": stats["bytes_per_server"]}
        row["ratio_vs_allreduce"] = row["gbps"]["ps"] / row["gbps"]["allreduce"]
        row["ratio_vs_native"] = row["gbps"]["ps"] / row["gbps"]["native"]
        with open(a.json, "w") as f:
            json.dump(row, f)
    ps.free()
    return 0


# ---------------------------------------------------------------------- drivers
def parse_config(text: str) -> tuple[int | str, int, bool]:
    """``"2x3"`` -> (2, 3, True); ``"cx3"`` -> ("colocated", 3, True); ``"cax3"`` ->
    ("colocated", 3, False) (servers, workers, keep_aggregate)."""
    servers, _, workers = text.strip().lower().partition("x")
    if servers in ("c", "ca"):
        return "colocated", int(workers), servers == "c"
    return int(servers), int(workers), True


def config_label(servers: int | str, keep: bool = True) -> str:
    """Short name of a config for tables and plots."""
    if servers == "colocated":
        return "coloc" if keep else "coloc-a"
    return f"{servers}s"


def run_throughput(configs: list[tuple[int, int]], size: str, iters: int, warmup: int,
                   timeout: float) -> list[dict]:
    rows = []
    print(f"# mpicoll.ps push_pull vs all-reduce, {size} float32 per worker, {iters} iters")
    print(f"# {'servers':>7} {'workers':>7} {'PS GB/s':>9} {'allreduce':>9} {'native':>9} "
          f"{'PS/allr':>7} {'PS/nat':>7} valid")
    for servers, workers, keep in configs:
        ranks = workers if servers == "colocated" else servers + workers
        row = launch_json(ranks,
                          [__file__, "_throughput_rank", "--servers", str(servers), "-m", size,
                           "-i", str(iters), "-x", str(warmup)] + ([] if keep else ["--no-keep"]),
                          f"{servers}x{workers}", timeout)
        if row is None:
            continue
        rows.append(row)
        g = row["gbps"]
        print(f"  {config_label(servers, keep):>7} {workers:>7} {g['ps']:>9.2f} "
              f"{g['allreduce']:>9.2f} {g['native']:>9.2f} {row['ratio_vs_allreduce']:>7.2f} "
              f"{row['ratio_vs_native']:>7.2f} {row['valid']}", flush=True)
    return rows


def portable_record(res: dict) -> dict:
    """A ps_train.py result as stored: without the temporary file it was written to, and
    with any path its arguments name relative to the repository (no machine paths)."""
    args = {k: relative_paths(v) if isinstance(v, str) else v
            for k, v in res.get("args", {}).items() if k != "json"}
    return {**res, "args": args}


def run_training(workers: int, servers: int, modes: list[str], steps: int,
                 delay: float, timeout: float) -> dict:
    results = {}
    n = servers + workers
    straggler = n - 1
    for mode in modes:
        consistency, _, s = mode.partition(":")
        args = [os.path.join(ROOT, "examples", "ps_train.py"), "--servers", str(servers),
                "--consistency", consistency, "--staleness", s or "0", "--steps", str(steps),
                "--log-every", "10", "--straggler-rank", str(straggler),
                "--straggler-delay", str(delay)]
        res = launch_json(n, args, mode, timeout)
        if res is None:
            continue
        results[mode] = portable_record(res)
        st = res["stats"]["worker"]
        print(f"  {mode:8s} {res['seconds']:7.2f} s  final loss {res['final'][0]:.4f}  "
              f"acc {res['final'][1]:.3f}  staleness max {st['staleness_max']} "
              f"mean {st['staleness_mean']:.2f}", flush=True)
    return results


def plot(training: dict, throughput: list[dict], outdir: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    if training:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, res in training.items():
            log = res["log"]
            ax.plot([r[0] for r in log], [r[2] for r in log], marker=".", label=mode)
        ax.set_xlabel("wall time of the first worker (s)")
        ax.set_ylabel("test loss")
        ax.set_yscale("log")
        ax.set_title("ps_train.py with one straggling worker")
        ax.legend()
        fig.tight_layout()
        p = os.path.join(outdir, "ps_loss_vs_time.png")
        fig.savefig(p, dpi=100)
        paths.append(p)
    if throughput:
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(throughput)), 4))
        labels = [f"{config_label(r['servers'], r.get('keep_aggregate', True))} x "
                  f"{r['workers']}w" for r in throughput]
        xs = range(len(throughput))
        for i, key in enumerate(("ps", "allreduce", "native")):
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r["gbps"][key] for r in throughput],
                   width=0.27, label=key)
        ax.set_xticks(list(xs), labels, rotation=30, ha="right")
        ax.set_ylabel("GB/s (bytes per worker / time)")
        ax.set_title(f"push_pull vs all-reduce, {throughput[0]['bytes'] // MiB} MiB per worker")
        ax.legend()
        fig.tight_layout()
        p = os.path.join(outdir, "ps_throughput.png")
        fig.savefig(p, dpi=100)
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_throughput_rank":
        return throughput_rank(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["throughput", "training", "all"])
    ap.add_argument("--configs", default="1x2,2x2,1x3,3x3",
                    help="servers x workers, comma-separated")
    ap.add_argument("-m", "--size", default="16M")
    ap.add_argument("-i", "--iters", type=int, default=10)
    ap.add_argument("-x", "--warmup", type=int, default=2)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--modes", default="bsp,ssp:1,ssp:3,asp")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--straggler-delay", type=float, default=0.01)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", help="directory for ps_bench.json and plots")
    a = ap.parse_args(argv)
    result = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
              "python": platform.python_version(),
              "command": command_line(None, "bench_ps", argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        from mpi4py import MPI  # noqa: PLC0415  (library name only; MPI initialised here)
        result["mpi"] = MPI.Get_library_version().splitlines()[0]
    except Exception:  # noqa: BLE001
        pass
    if a.what in ("throughput", "all"):
        configs = [parse_config(c) for c in a.configs.split(",")]
        result["throughput"] = run_throughput(configs, a.size, a.iters, a.warmup, a.timeout)
    if a.what in ("training", "all"):
        print(f"# ps_train.py, {a.servers} server(s), {a.workers} workers, last worker "
              f"sleeps {a.straggler_delay} s per step, {a.steps} steps")
        result["training"] = run_training(a.workers, a.servers, a.modes.split(","), a.steps,
                                          a.straggler_delay, a.timeout)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "ps_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        for p in plot(result.get("training", {}), result.get("throughput", []), a.out):
            print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
