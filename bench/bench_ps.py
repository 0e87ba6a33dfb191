"""Parameter-server benchmarks: aggregation throughput vs all-reduce; loss vs wall time.

Three parts, each a driver that launches its own ``mpirun`` runs (with timeouts):

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

``stragglers``
    ``examples/ps_train.py`` with one worker's compute ``--slow-factor`` times slower
    (``--slow-rank``: it sleeps (factor - 1) x its measured gradient time) under each of
    ``--modes`` (``bsp``, ``bsp:b1`` = bsp with 1 backup worker, ``ssp:2``, ``asp``);
    records per mode the first worker's step times (median; rounds per second of wall
    time), the server's updates, the late pushes dropped, and test loss against wall time.
    Written to ``--out-json`` and plotted to ``--plot``.

``compression``
    Per codec (``--codecs``): the bytes one worker pushes and pulls per step (from
    ``stats()``; ``optimizer="sum"``, ``-m`` bytes of float32, config ``--configs``) and the
    push_pull time against uncompressed; then ``examples/ps_train.py`` (adam on one server,
    ``--workers`` workers, ``--steps`` rounds) for each of ``--train-codecs``: final test
    loss and accuracy, wall time and bytes per step. Written to ``--out-json``.

A config is ``SERVERSxWORKERS`` (separate server ranks), ``cxWORKERS``: the co-located
layout (``num_servers="colocated"``: every one of the WORKERS ranks is also the server of
its shard), or ``caxWORKERS``: co-located with ``keep_aggregate=False`` (the aggregate goes
straight into ``out`` and is not kept). From the repository root::

    python -m bench.bench_ps throughput --configs 1x2,2x2,cx2,1x3,3x3,cx3 -m 16M -i 10
    python -m bench.bench_ps training --workers 3 --straggler-delay 0.01
    python -m bench.bench_ps all --out docs/results   # both, JSON + PNG into docs/results/
    python -m bench.bench_ps stragglers --out-json docs/results/ps_stragglers.json \
        --plot docs/results/ps_stragglers.png
    python -m bench.bench_ps compression --configs 1x2 -m 4M -i 10 --workers 2 --steps 300

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
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import command_line, mpirun_command, relative_paths  # noqa: E402

MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def launch(n: int, args: list[str], timeout: float,
           env: dict[str, str] | None = None) -> tuple[int, str]:
    cmd = mpirun_command(n) + [sys.executable, "-m", "mpi4py", *args]
    print("+", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})),
                           start_new_session=True)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        return 124, f"timeout after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"


def launch_json(n: int, args: list[str], label: str, timeout: float,
                env: dict[str, str] | None = None) -> dict | None:
    """Launch ``args --json FILE`` on ``n`` ranks; the JSON it wrote, or None if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        rc, text = launch(n, [*args, "--json", out], timeout, env)
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
    ap.add_argument("--compression", default=None, help="codec of pushes and pulls")
    ap.add_argument("--local-aggregation", default="auto", choices=LOCAL_AGGREGATION,
                    help="the PS's local_aggregation; 'both': a node-aware PS (True) and a "
                    "flat one (False), interleaved with the all-reduces")
    a = ap.parse_args(argv)
    nbytes = parse_size(a.size)
    count = nbytes // 4
    comm = MPI.COMM_WORLD
    servers = a.servers if a.servers == "colocated" else int(a.servers)
    modes = {"ps": LOCAL_AGGREGATION[a.local_aggregation]}
    if a.local_aggregation == "both":
        if servers != "colocated":
            raise SystemExit("--local-aggregation both needs the co-located layout (server "
                             "ranks serve one ParameterServer at a time); run 'on' and "
                             "'off' separately")
        modes = {"ps": True, "ps_flat": False}
    servers_of = {}
    for key, la in modes.items():
        servers_of[key] = ParameterServer(
            {"x": np.zeros(count, np.float32)}, comm=comm, num_servers=servers,
            optimizer="sum", split_bytes=1 << 16, max_sleep=a.max_sleep,
            chunk_bytes=parse_size(a.chunk_bytes), keep_aggregate=not a.no_keep,
            compression=a.compression, local_aggregation=la)
    ps = servers_of["ps"]
    if ps.is_server:
        ps.serve()
        ps.free()
        return 0
    wc = ps.worker_comm
    if a.compression is None:
        g = ((np.arange(count) % 1000) + ps.worker_index).astype(np.float32)   # exact sums
    else:   # gradient-like data (repeated values would make top-k's selection degenerate)
        g = np.random.default_rng(ps.worker_index).standard_normal(count).astype(np.float32)
    out = {"x": np.empty(count, np.float32)}
    ar = np.empty(count, np.float32)
    nat = np.empty(count, np.float32)
    times = {"ps": [], "allreduce": [], "native": []}
    outs = {key: out if key == "ps" else {"x": np.empty(count, np.float32)}
            for key in servers_of}
    for key in servers_of:
        times[key] = []
    counted = ps.worker_counters()
    for it in range(a.warmup + a.iters):
        if it == a.warmup:
            counted = ps.worker_counters()          # bytes of the timed steps only
        for key, other in servers_of.items():
            wc.Barrier()
            t0 = time.perf_counter()
            other.push_pull({"x": g}, out=outs[key])
            t1 = time.perf_counter()
            if it >= a.warmup:
                times[key].append(t1 - t0)
        wc.Barrier()
        t2 = time.perf_counter()
        mpicoll.allreduce(g, ar, comm=wc)
        t3 = time.perf_counter()
        wc.Barrier()
        t4 = time.perf_counter()
        wc.Allreduce(g, nat, op=MPI.SUM)
        t5 = time.perf_counter()
        if it >= a.warmup:
            times["allreduce"].append(t3 - t2)
            times["native"].append(t5 - t4)
    valid = bool(all(np.array_equal(o["x"], ar) for o in outs.values())
                 and np.array_equal(ar, nat))
    valid = wc.allreduce(valid, op=MPI.LAND) if a.compression is None else None  # lossy
    worst = {k: wc.allreduce(float(np.mean(v)), op=MPI.MAX) for k, v in times.items()}
    best = {k: wc.allreduce(float(np.min(v)), op=MPI.MAX) for k, v in times.items()}
    counted = {k: v - counted[k] for k, v in ps.worker_counters().items()
               if k.startswith("bytes_")}
    stats = ps.stats()
    crossing = {key: cross_node_bytes(other) for key, other in servers_of.items()}
    for other in servers_of.values():
        other.close()
    load = os.getloadavg()[0]
    if ps.worker_index == 0:
        row = {"servers": servers, "workers": ps.num_workers,
               "keep_aggregate": not a.no_keep, "bytes": nbytes, "iters": a.iters,
               "valid": valid, "avg_s": worst, "min_s": best,
               "gbps": {k: nbytes / v / 1e9 for k, v in worst.items()},
               "bytes_per_server": stats["bytes_per_server"],
               "compression": stats["compression"],
               "worker_bytes": counted, "steps": a.iters,
               "local_aggregation": {k: o.local_aggregation for k, o in servers_of.items()},
               "node_groups": ps.node_groups, "cross_node_bytes_per_step": crossing,
               "load_average": load}
        row["ratio_vs_allreduce"] = row["gbps"]["ps"] / row["gbps"]["allreduce"]
        if "ps_flat" in servers_of:
            row["flat_ratio_vs_allreduce"] = row["gbps"]["ps_flat"] / row["gbps"]["allreduce"]
        row["ratio_vs_native"] = row["gbps"]["ps"] / row["gbps"]["native"]
        with open(a.json, "w") as f:
            json.dump(row, f)
    for other in servers_of.values():
        other.free()
    return 0


#: ``--local-aggregation`` values and what the rank passes (``both``: two servers)
LOCAL_AGGREGATION = {"auto": "auto", "on": True, "off": False, "both": None}


def cross_node_bytes(ps) -> int:
    """Payload bytes that cross between nodes in one push_pull of every worker
    (uncompressed; from the placement, the node layout and who pushes): each contribution
    to a shard whose owner is on another node, and its pull back."""
    if ps.colocated and ps.local_aggregation:
        owners = [g[0] for g in ps.node_groups]          # engine rank k: node k's leader
    elif ps.colocated:
        owners = ps.worker_ranks
    else:
        owners = ps.server_ranks
    pushers = [g[0] for g in ps.node_groups] if ps.local_aggregation else ps.worker_ranks
    total = 0
    for shards in ps.placement.shards.values():
        for sh in shards:
            owner = owners[sh.server]
            total += 2 * sh.nbytes * sum(1 for r in pushers
                                         if ps.node_of[r] != ps.node_of[owner])
    return total


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
                   timeout: float, local_aggregation: str = "auto") -> list[dict]:
    rows = []
    print(f"# mpicoll.ps push_pull vs all-reduce, {size} float32 per worker, {iters} iters")
    print(f"# {'servers':>7} {'workers':>7} {'PS GB/s':>9} {'allreduce':>9} {'native':>9} "
          f"{'PS/allr':>7} {'PS/nat':>7} valid")
    for servers, workers, keep in configs:
        ranks = workers if servers == "colocated" else servers + workers
        row = launch_json(ranks,
                          [__file__, "_throughput_rank", "--servers", str(servers), "-m", size,
                           "-i", str(iters), "-x", str(warmup),
                           "--local-aggregation", local_aggregation]
                          + ([] if keep else ["--no-keep"]),
                          f"{servers}x{workers}", timeout)
        if row is None:
            continue
        rows.append(row)
        g = row["gbps"]
        print(f"  {config_label(servers, keep):>7} {workers:>7} {g['ps']:>9.2f} "
              f"{g['allreduce']:>9.2f} {g['native']:>9.2f} {row['ratio_vs_allreduce']:>7.2f} "
              f"{row['ratio_vs_native']:>7.2f} {row['valid']}", flush=True)
        if "ps_flat" in g:
            print(f"  {'(flat)':>7} {workers:>7} {g['ps_flat']:>9.2f} {'':>9} {'':>9} "
                  f"{row['flat_ratio_vs_allreduce']:>7.2f}", flush=True)
        print(f"    local aggregation {row['local_aggregation']}, nodes {row['node_groups']}, "
              f"bytes crossing nodes per step {row['cross_node_bytes_per_step']}, "
              f"load {row['load_average']:.1f}", flush=True)
    return rows


def portable_record(res: dict) -> dict:
    """A ps_train.py result as stored: without the temporary file it was written to, and
    with any path its arguments name relative to the repository (no machine paths)."""
    args = {k: relative_paths(v) if isinstance(v, str) else v
            for k, v in res.get("args", {}).items() if k != "json"}
    return {**res, "args": args}


def mode_args(mode: str) -> list[str]:
    """``ps_train.py`` options of a mode: ``bsp``, ``asp``, ``ssp:S`` (bound S) or
    ``bsp:bB`` (B backup workers)."""
    consistency, _, extra = mode.partition(":")
    args = ["--consistency", consistency]
    if extra.startswith("b"):
        return args + ["--backup-workers", extra[1:]]
    return args + ["--staleness", extra or "0"]


def run_training(workers: int, servers: int, modes: list[str], steps: int,
                 delay: float, timeout: float) -> dict:
    results = {}
    n = servers + workers
    straggler = n - 1
    for mode in modes:
        args = [os.path.join(ROOT, "examples", "ps_train.py"), "--servers", str(servers),
                *mode_args(mode), "--steps", str(steps),
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


def run_compression(a: argparse.Namespace) -> dict:
    """Bytes per step and push_pull time per codec; then the training example per codec."""
    out: dict = {"bytes": [], "training": {}}
    print(f"# bytes one worker pushes + pulls per step, {a.size} float32, optimizer='sum'")
    print(f"# {'config':>7} {'codec':>13} {'pushed':>10} {'pulled':>10} {'ratio':>7} "
          f"{'push_pull ms':>12} {'x none':>7}")
    for servers, workers, keep in [parse_config(c) for c in a.configs.split(",")]:
        ranks = workers if servers == "colocated" else servers + workers
        base = None
        for codec in [c for c in a.codecs.split(",") if c]:
            row = launch_json(ranks, [__file__, "_throughput_rank", "--servers", str(servers),
                                      "-m", a.size, "-i", str(a.iters), "-x", str(a.warmup),
                                      "--compression", codec], f"{servers}x{workers} {codec}",
                              a.timeout)
            if row is None:
                continue
            b, steps = row["worker_bytes"], row["steps"]
            row.update(codec=codec, pushed_per_step=b["bytes_sent"] / steps,
                       pulled_per_step=b["bytes_received"] / steps,
                       ratio=(b["bytes_sent_uncompressed"] + b["bytes_received_uncompressed"])
                       / max(1, b["bytes_sent"] + b["bytes_received"]))
            base = base or row["avg_s"]["ps"]
            out["bytes"].append(row)
            print(f"  {config_label(servers, keep):>7} {codec:>13} {row['pushed_per_step']:>10.0f} "
                  f"{row['pulled_per_step']:>10.0f} {row['ratio']:>7.2f} "
                  f"{row['avg_s']['ps'] * 1e3:>12.2f} {row['avg_s']['ps'] / base:>7.2f}",
                  flush=True)
    n = a.servers + a.workers
    print(f"# ps_train.py, adam, {a.servers} server(s), {a.workers} workers, {a.steps} steps")
    for codec in [c for c in a.train_codecs.split(",") if c]:
        args = [os.path.join(ROOT, "examples", "ps_train.py"), "--servers", str(a.servers),
                "--steps", str(a.steps), "--log-every", "50"]
        res = launch_json(n, args + ([] if codec == "none" else ["--compression", codec]),
                          codec, a.timeout)
        if res is None:
            continue
        st = res["stats"]["worker"]
        res = portable_record(res)
        res["bytes_per_step"] = (st["bytes_sent"] + st["bytes_received"]) / res["steps"]
        res["uncompressed_bytes_per_step"] = (st["bytes_sent_uncompressed"] +
                                              st["bytes_received_uncompressed"]) / res["steps"]
        out["training"][codec] = res
        print(f"  {codec:>13} final loss {res['final'][0]:.4f} acc {res['final'][1]:.3f}  "
              f"{res['seconds']:6.2f} s  {res['bytes_per_step']:8.0f} B/step "
              f"(uncompressed {res['uncompressed_bytes_per_step']:.0f})", flush=True)
    return out


#: test losses whose first crossing (first worker's wall time) the stragglers summary gives
LOSS_TARGETS = (0.3, 0.1)


def straggler_summary(res: dict) -> dict:
    """One mode's numbers: the first worker's step times (median), rounds per second of
    its wall time (its clock advance: with backup workers it may skip a round whose push
    was dropped), the servers' updates and late pushes dropped (per shard), final loss."""
    import statistics
    steps = res["step_seconds"]
    servers = res["stats"]["servers"]
    shards = sum(s["shards"] for s in servers)
    return {"steps": res["steps"], "seconds": res["seconds"],
            "median_step_ms": 1e3 * statistics.median(steps),
            "rounds": res["args"]["steps"],   # the clock advance: rounds it took part in
            "rounds_per_s": res["args"]["steps"] / res["seconds"],
            "server_updates": sum(s["updates"] for s in servers) / shards,
            "late_pushes_dropped": sum(s["late_pushes_dropped"] for s in servers) / shards,
            "short_rounds": sum(s["short_rounds"] for s in servers) / shards,
            "seconds_to_loss": {str(t): next((r[0] for r in res["log"] if r[2] <= t), None)
                                for t in LOSS_TARGETS},
            "staleness_max": res["stats"]["worker"]["staleness_max"],
            "final_loss": res["final"][0], "final_accuracy": res["final"][1]}


def run_stragglers(a: argparse.Namespace) -> dict:
    """Every mode with one slow worker; returns {mode: {"summary", "record"}}."""
    n = a.servers + a.workers
    slow = n - 1 if a.slow_rank < 0 else a.slow_rank
    print(f"# ps_train.py, {a.servers} server(s), {a.workers} workers, rank {slow}'s "
          f"compute {a.slow_factor}x slower, {a.steps} rounds, hidden {a.hidden}, "
          f"batch {a.batch}")
    print(f"# {'mode':8s} {'median ms':>9} {'rounds/s':>8} {'seconds':>7} {'dropped':>7} "
          f"{'loss':>7}  seconds to loss {LOSS_TARGETS}")
    results = {}
    for mode in a.modes.split(","):
        args = [os.path.join(ROOT, "examples", "ps_train.py"), "--servers", str(a.servers),
                *mode_args(mode), "--steps", str(a.steps), "--log-every", "10",
                "--hidden", str(a.hidden), "--batch", str(a.batch),
                "--slow-rank", str(slow), "--slow-factor", str(a.slow_factor)]
        res = launch_json(n, args, mode, a.timeout, env=STRAGGLER_ENV)
        if res is None:
            continue
        summary = straggler_summary(res)
        results[mode] = {"summary": summary, "record": portable_record(res)}
        print(f"  {mode:8s} {summary['median_step_ms']:9.2f} {summary['rounds_per_s']:8.1f} "
              f"{summary['seconds']:7.2f} {summary['late_pushes_dropped']:7.0f} "
              f"{summary['final_loss']:7.4f}  {list(summary['seconds_to_loss'].values())}",
              flush=True)
    return results


#: one BLAS thread per rank: 4 ranks share 2 cores (threads only fight over them)
STRAGGLER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_loss(training: dict, path: str, title: str) -> str | None:
    """Test loss against the first worker's wall time, one line per mode."""
    plt = _pyplot()
    if plt is None or not training:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, res in training.items():
        log = res["log"]
        ax.plot([r[0] for r in log], [r[2] for r in log], marker=".", label=mode)
    ax.set_xlabel("wall time of the first worker (s)")
    ax.set_ylabel("test loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot(training: dict, throughput: list[dict], outdir: str) -> list[str]:
    plt = _pyplot()
    if plt is None:
        return []
    paths = [p for p in [plot_loss(training, os.path.join(outdir, "ps_loss_vs_time.png"),
                                   "ps_train.py with one straggling worker")] if p]
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
    ap.add_argument("what", choices=["throughput", "training", "all", "stragglers",
                                     "compression"])
    ap.add_argument("--configs", default="1x2,2x2,1x3,3x3",
                    help="servers x workers, comma-separated")
    ap.add_argument("-m", "--size", default="16M")
    ap.add_argument("-i", "--iters", type=int, default=10)
    ap.add_argument("-x", "--warmup", type=int, default=2)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--modes", default=None,
                    help="training: bsp,ssp:1,ssp:3,asp; stragglers: bsp,bsp:b1,ssp:2,asp")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--straggler-delay", type=float, default=0.01)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", help="directory for ps_bench.json and plots "
                    "(the documented ones: docs/results)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="stragglers: default the last")
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out-json", help="stragglers: the JSON file to write")
    ap.add_argument("--plot", help="stragglers: the loss-vs-time PNG to write")
    ap.add_argument("--local-aggregation", default="auto", choices=sorted(LOCAL_AGGREGATION),
                    help="throughput: the PS's local_aggregation (on/off/auto), or 'both': "
                    "node-aware and flat interleaved in one run (co-located configs)")
    ap.add_argument("--codecs", default="none,fp16,bf16,int8,onebit,topk:0.01,randomk:0.01",
                    help="compression: codecs of the bytes table")
    ap.add_argument("--train-codecs", default="none,int8,onebit,topk:0.01",
                    help="compression: codecs of the training runs")
    a = ap.parse_args(argv)
    if a.modes is None:
        a.modes = "bsp,bsp:b1,ssp:2,asp" if a.what == "stragglers" else "bsp,ssp:1,ssp:3,asp"
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
        result["throughput"] = run_throughput(configs, a.size, a.iters, a.warmup, a.timeout,
                                              a.local_aggregation)
    if a.what == "compression":
        result["compression"] = run_compression(a)
        if a.out_json:
            os.makedirs(os.path.dirname(os.path.abspath(a.out_json)), exist_ok=True)
            with open(a.out_json, "w") as f:
                json.dump(result, f, indent=1)
            print("wrote", a.out_json)
        return 0
    if a.what == "stragglers":
        result["environment"] = STRAGGLER_ENV
        result["stragglers"] = run_stragglers(a)
        write_stragglers(result, a)
        return 0
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


def write_stragglers(result: dict, a: argparse.Namespace) -> None:
    """The stragglers JSON and its loss-vs-time plot, where asked for."""
    if a.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(a.out_json)), exist_ok=True)
        with open(a.out_json, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", a.out_json)
    if a.plot:
        records = {m: r["record"] for m, r in result["stragglers"].items()}
        title = f"one worker's compute {a.slow_factor:g}x slower ({a.workers} workers)"
        if plot_loss(records, a.plot, title):
            print("wrote", a.plot)


if __name__ == "__main__":
    sys.exit(main())
