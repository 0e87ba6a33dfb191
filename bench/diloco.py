"""DiLoCo and Streaming DiLoCo against every-step sync and local SGD, to accuracy.

``examples/train.py``'s model and data (DigitsCNN, 13,706 float32 parameters, scikit-learn's
8x8 digits, global batch 64 split over the ranks, inner SGD lr 0.05 momentum 0.9), or with
``--workload markov`` a longer one (``bench.workloads``: next-symbol prediction on a
synthetic Markov language, 103,184 parameters), one model per ``--variants`` entry:

- ``sync``: ``DistributedOptimizer``, gradients all-reduced every step (a ring:
  ``MPICOLL_ALLREDUCE_ALGORITHM=ring``);
- ``ddp``: torch's ``DistributedDataParallel`` on the "mpicoll" backend (every step,
  bucketed, overlapping the backward pass; the same ring);
- ``none``: no communication at all: each rank trains alone with the inner optimizer
  (the time bound; its accuracy is the ranks' models scored on their slices of the test
  set, their mean);
- ``L<H>``: local SGD, ``DistributedOptimizer(sync_every=H)`` (parameters and momentum
  averaged every ``H`` steps);
- ``D<H>``: ``DiLoCo(sync_every=H)``;
- ``S<H>F<F>T<tau>``: Streaming DiLoCo, ``DiLoCo(sync_every=H, fragments=F, overlap=tau)``;
- a DiLoCo variant may end in ``:codec`` (``S100F4T1:int4``): ``compression=codec``.

DiLoCo's outer optimizer is SGD with Nesterov momentum (``--outer-lr`` 0.7,
``--outer-momentum`` 0.5; see docs/results/diloco.md for why not 0.9 here). Seeds are the outer
loop and variants the inner one, all variants of a seed in one launch (the order rotated
per seed), so variants share the machine's load.

Each run records on rank 0: the training wall time (steps only; evaluations excluded),
every ``--eval-every`` steps the test accuracy (of the global parameters for DiLoCo, of
the replicas for the others), rank 0's mean training loss since the previous evaluation
and the bytes crossed between nodes so far (all ranks together), the step and time at
which the accuracy first reaches ``--target``, and the final accuracy. Bytes crossing
nodes: ``sync`` and ``L<H>`` computed from the ring schedule (``bench.local_sgd``); DiLoCo's
from its ``stats()`` summed over the ranks (computed from the placement without a codec,
the codec collective's payload count with one); DDP's as ``sync``'s. With ``--wire-iface
eth0`` on the test bed they are also **measured**: each node's transmit counter of its
``eth0`` (``bench.training_runs.WireBytes``: frames with their headers, the launcher's
control traffic included, evaluations excluded), summed over the nodes. From the
repository root::

    python -m bench.diloco --ranks 4 --ranks-per-node 2 --seeds 1,2 --out docs/results

Under ``MPICOLL_BENCH_MPIRUN="cluster/cluster mpirun -ppn 2"`` the launches run on the
test bed (docs/cluster.md; give ``--ranks-per-node 0 --wire-iface eth0`` there).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import textwrap

from bench import training_runs
from bench.bench_ps import _pyplot
from bench.common import command_line
from bench.local_sgd import cross_node_ring_senders
from bench.training_runs import ROOT

DEFAULT_VARIANTS = "sync,ddp,none,L8,D10,D50,D100,S100F4T1:int4"
VARIANT = re.compile(r"^(?:(sync|ddp|none)|L(\d+)|D(\d+)|S(\d+)F(\d+)T(\d+))(?::(.+))?$")
WORKLOADS = ("digits", "markov")


def parse_variant(name: str) -> dict:
    """``"S100F4T1:int4"`` -> ``{"kind": "diloco", "sync_every": 100, "fragments": 4,
    "overlap": 1, "compression": "int4"}``; ``"L8"`` -> ``{"kind": "local", "sync_every":
    8}``; ``"sync"``, ``"ddp"``, ``"none"`` -> ``{"kind": name}``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    m = VARIANT.match(name)
    if m is None:
        raise argparse.ArgumentTypeError(f"variant {name!r}: sync, ddp, none, L<H>, D<H>, "
                                         f"S<H>F<F>T<tau>, a DiLoCo one with :codec")
    sync, local, d, s, f, t, codec = m.groups()
    if sync or local:
        if codec:
            raise argparse.ArgumentTypeError(f"variant {name!r}: a codec only with DiLoCo")
        return {"kind": sync} if sync else {"kind": "local", "sync_every": int(local)}
    return {"kind": "diloco", "sync_every": int(d or s), "fragments": int(f or 1),
            "overlap": int(t or 0), "compression": codec}


def _ring_cross_bytes(hvd, param_bytes: int, node_sizes: list[int]) -> float:
    """Bytes crossing nodes (all ranks) in one ring all-reduce of ``param_bytes``."""
    n = hvd.size()
    return cross_node_ring_senders(node_sizes) * 2 * (n - 1) / n * param_bytes


def _model(train, workload: str):
    if workload == "markov":
        from bench.workloads import MarkovLM

        return MarkovLM()
    return train.DigitsCNN()


def _data(train, workload: str) -> tuple:
    if workload == "markov":
        from bench.workloads import markov_data

        return markov_data()
    return train.load_data("digits")


def _train_run(train, hvd, a: argparse.Namespace, variant: str, seed: int, data) -> dict:
    """Train one variant from scratch; rank 0's record."""
    import copy

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpicoll.context import get_context

    settings = parse_variant(variant)
    per_rank = max(1, a.batch // hvd.size())
    xtr, ytr, xte, yte, _ = data
    node_sizes = get_context(MPI.COMM_WORLD).topology.node_sizes
    torch.manual_seed(seed)
    model = _model(train, a.workload)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    inner = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    diloco, trained, opt = None, model, inner
    if settings["kind"] == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=a.outer_lr, momentum=a.outer_momentum,
                                nesterov=a.outer_momentum > 0)
        diloco = hvd.DiLoCo(model, inner, outer, sync_every=settings["sync_every"],
                            fragments=settings["fragments"], overlap=settings["overlap"],
                            compression=settings["compression"])
        opt = diloco
        scratch = copy.deepcopy(model)
    elif settings["kind"] == "ddp":
        if not dist.is_initialized():
            dist.init_process_group("mpicoll")
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        trained = torch.nn.parallel.DistributedDataParallel(model)
    elif settings["kind"] in ("sync", "local"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(),
            **({"sync_every": settings["sync_every"]} if settings["kind"] == "local" else {}))
    ring = _ring_cross_bytes(hvd, param_bytes, node_sizes)
    wire = training_runs.WireBytes(hvd, a.wire_iface)

    def crossed(step: int) -> float:
        if diloco is not None:
            mine = torch.tensor([float(diloco.stats()["bytes_sent"]["inter_node"])])
            return float(hvd.allreduce(mine, op=hvd.Sum, name=f"bench.diloco.bytes.{step}"))
        if settings["kind"] in ("sync", "ddp"):
            return ring * step
        if settings["kind"] == "none":
            return 0.0
        # local SGD: parameters and momentum buffers every H steps
        return ring * 2 * (step // settings["sync_every"])

    def evaluated() -> torch.nn.Module:
        if diloco is None:
            return model
        with torch.no_grad():
            for p, theta in zip(scratch.parameters(), diloco.global_parameters()):
                p.copy_(theta)
        return scratch

    def evaluate() -> float:
        wire.pause()                     # resumed after the row's columns
        return train.evaluate(evaluated(), xte, yte)

    def columns(step: int, losses: list[float]) -> list:
        row = [statistics.mean(losses), crossed(step), wire.total(f"bench.diloco.wire.{step}")]
        wire.resume()
        return row

    train_seconds, step, log, reached = training_runs.train_to_target(
        train, a, seed, trained, opt, xtr, ytr, per_rank, evaluate, columns=columns,
        reached_columns=(4, 5))
    wire.pause()
    accuracy = train.evaluate(evaluated(), xte, yte)
    total_crossed, total_wire = crossed(step), wire.total("bench.diloco.wire.end")
    stats = None
    if diloco is not None:
        stats = diloco.stats()
        diloco.close()
    return {"variant": variant, "seed": seed, "settings": settings, "ranks": hvd.size(),
            "workload": a.workload, "steps": step, "train_seconds": train_seconds,
            "final_accuracy": accuracy, "reached": reached, "log": log,
            "param_bytes": param_bytes, "cross_node_bytes": total_crossed,
            "wire_bytes": total_wire, "node_sizes": node_sizes, "diloco": stats,
            "log_columns": ["step", "train_seconds", "accuracy", "loss", "cross_node_bytes",
                            "wire_bytes"]}


def worker(a: argparse.Namespace) -> int:
    """One process of a launch (under mpirun): every variant in the order given; rank 0
    writes the records to ``a.json``."""
    import torch.distributed as dist

    def results(train, hvd, _digits):
        data = _data(train, a.workload)
        records = [_train_run(train, hvd, a, v, a.seed, data) for v in a.variant.split(",")]
        if dist.is_initialized():
            dist.destroy_process_group()
        return records

    return training_runs.worker(a, results, shutdown=True)


def summarize(records: list[dict]) -> dict:
    """Per variant: medians over seeds, ratios to ``sync`` (and of the training time per
    step to ``none``'s, the same steps without communication)."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        mine = [r for r in records if r["variant"] == variant]
        reached = [r["reached"] for r in mine if r["reached"]]
        complete = len(reached) == len(mine)
        out[variant] = {
            "runs": len(mine),
            "reached": f"{len(reached)}/{len(mine)}",
            "steps_to_target": [r["reached"][0] if r["reached"] else None for r in mine],
            "time_to_target_median": statistics.median(x[1] for x in reached)
            if complete else None,
            "bytes_to_target_median": statistics.median(x[2] for x in reached)
            if complete else None,
            "wire_bytes_to_target_median": statistics.median(x[3] for x in reached)
            if complete and all(x[3] is not None for x in reached) else None,
            "final_accuracy_mean": statistics.mean(r["final_accuracy"] for r in mine),
            "train_seconds_median": statistics.median(r["train_seconds"] for r in mine),
            "cross_node_bytes_per_step": statistics.median(r["cross_node_bytes"] / r["steps"]
                                                           for r in mine),
            "wire_bytes_per_step": statistics.median(r["wire_bytes"] / r["steps"]
                                                     for r in mine)
            if all(r.get("wire_bytes") is not None for r in mine) else None,
            "seconds_per_step_median": statistics.median(r["train_seconds"] / r["steps"]
                                                         for r in mine),
            "node_sizes": mine[0]["node_sizes"],
        }
    base = out.get("sync")
    for row in out.values():
        if not base:
            break
        for key in ("time_to_target_median", "bytes_to_target_median",
                    "wire_bytes_to_target_median", "train_seconds_median",
                    "cross_node_bytes_per_step", "wire_bytes_per_step"):
            if base.get(key) and row.get(key) is not None:
                row[key.replace("_median", "") + "_vs_sync"] = row[key] / base[key]
        row["accuracy_vs_sync_points"] = 100 * (row["final_accuracy_mean"] -
                                                base["final_accuracy_mean"])
    alone = out.get("none")
    for row in out.values():
        if alone:
            row["seconds_per_step_vs_none"] = (row["seconds_per_step_median"] /
                                               alone["seconds_per_step_median"])
    return out


def print_summary(summary: dict, target: float) -> None:
    print(f"# variant        reached  steps-to-{target:.2f}        time(s)  vs-sync  "
          f"bytes-to-{target:.2f}  vs-sync  final-acc  d-acc(pts)  cross-node B/step  "
          f"wire-to-{target:.2f}  vs-sync  wire B/step  s/step-vs-none")
    for name, row in summary.items():
        ttt, btt = row["time_to_target_median"], row["bytes_to_target_median"]
        print(f"{name:15s} {row['reached']:>7s}  {row['steps_to_target']!s:>18s}  "
              f"{'-' if ttt is None else f'{ttt:.2f}':>7s}  "
              f"{row.get('time_to_target_vs_sync', float('nan')):7.3f}  "
              f"{'-' if btt is None else f'{btt:.0f}':>14s}  "
              f"{row.get('bytes_to_target_vs_sync', float('nan')):7.4f}  "
              f"{row['final_accuracy_mean']:.4f}  "
              f"{row.get('accuracy_vs_sync_points', float('nan')):+9.2f}  "
              f"{row['cross_node_bytes_per_step']:14.0f}  "
              f"{_num(row['wire_bytes_to_target_median'], '.0f'):>12s}  "
              f"{row.get('wire_bytes_to_target_vs_sync', float('nan')):7.4f}  "
              f"{_num(row['wire_bytes_per_step'], '.0f'):>11s}  "
              f"{row.get('seconds_per_step_vs_none', float('nan')):6.2f}")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown_table(summary: dict) -> str:
    """The summary as the Markdown table docs/diloco.md shows."""
    rows = ["| variant | reached | steps to target (per seed) | time to target, median (s) "
            "| vs sync | bytes between nodes to target, measured (computed) | vs sync "
            "| final accuracy (mean) | vs sync (points) | seconds per step vs none |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in summary.items():
        steps = ", ".join("-" if s is None else str(s) for s in row["steps_to_target"])
        wire, computed = row["wire_bytes_to_target_median"], row["bytes_to_target_median"]
        ratio = row.get("wire_bytes_to_target_vs_sync", row.get("bytes_to_target_vs_sync"))
        rows.append(
            f"| {name} | {row['reached']} | {steps} "
            f"| {_num(row['time_to_target_median'], '.2f')} "
            f"| {_num(row.get('time_to_target_vs_sync'), '.2f')} "
            f"| {_num(wire, ',.0f')} ({_num(computed, ',.0f')}) "
            f"| {_ratio(ratio)} | {row['final_accuracy_mean']:.4f} "
            f"| {_num(row.get('accuracy_vs_sync_points'), '+.2f')} "
            f"| {_num(row.get('seconds_per_step_vs_none'), '.2f')} |")
    return "\n".join(rows)


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value >= 0.1 or value == 0 else f"{value:.4f} (1/{1 / value:.0f})"


def plot(records: list[dict], path: str, title: str, seed: int | None = None
         ) -> str | None:
    """One seed's (default: the first) training loss and test accuracy of every variant against training time
    and against bytes crossing nodes (log scale), as a PNG at ``path`` (``None`` without
    matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    seed = min(r["seed"] for r in records) if seed is None else seed
    mine = [r for r in records if r["seed"] == seed]
    measured = all(r.get("wire_bytes") is not None for r in mine)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    for rec in mine:
        log = rec["log"]
        t = [row[1] for row in log]
        b = [max(row[5 if measured else 4], 1.0) for row in log]
        for row_axes, column in ((axes[0], 3), (axes[1], 2)):
            row_axes[0].plot(t, [row[column] for row in log], label=rec["variant"])
            row_axes[1].plot(b, [row[column] for row in log], label=rec["variant"])
    axes[0][0].set_ylabel("training loss (rank 0, mean since last point)")
    axes[1][0].set_ylabel("test accuracy")
    axes[1][0].set_xlabel("training time (s)")
    axes[1][1].set_xlabel("bytes sent between nodes, all nodes, measured on the wire (log)"
                          if measured else "bytes crossing nodes, all ranks, computed (log)")
    for ax in axes[:, 1]:
        ax.set_xscale("log")
    axes[0][0].set_yscale("log")
    if mine[0].get("workload", "digits") == "digits":
        for ax in axes[1]:
            ax.set_ylim(0.8, 1.0)
    axes[0][1].legend(fontsize=8)
    fig.suptitle(textwrap.fill(f"{title} (seed {seed})", 120), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_runs.add_run_options(p, variants=DEFAULT_VARIANTS, epochs=30)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--workload", choices=WORKLOADS, default="digits",
                   help="digits: examples/train.py's DigitsCNN; markov: bench.workloads' "
                   "language model (longer)")
    p.add_argument("--wire-iface", default=None, metavar="IFACE",
                   help="also measure the bytes each node sends on IFACE (eth0 on the bed)")
    training_runs.add_target_options(p, eval_every=10, timeout=900)
    p.add_argument("--out", default=None, help="write <name>.json here")
    p.add_argument("--name", default="diloco")
    p.add_argument("--plot-only", default=None, metavar="JSON",
                   help="only draw the PNG of an earlier run's JSON (beside it)")
    p.add_argument("--table-only", default=None, metavar="JSON",
                   help="only print the Markdown table of an earlier run's JSON")
    p.add_argument("--plot-seed", type=int, default=None,
                   help="the seed whose runs the PNG shows (default: the first)")
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.table_only:
        with open(a.table_only) as f:
            print(markdown_table(json.load(f)["summary"]))
        return 0
    if a.plot_only:
        with open(a.plot_only) as f:
            saved = json.load(f)
        png = plot(saved["records"], a.plot_only[:-len(".json")] + ".png",
                   saved["command"], a.plot_seed)
        print(f"wrote {png}" if png else "no matplotlib: nothing drawn")
        return 0 if png else 1
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        parse_variant(v)
    env = training_runs.environment(a)
    common = training_runs.forwarded(a, "epochs", "batch", "lr", "momentum", "outer-lr",
                                     "outer-momentum", "target", "eval-every", "workload")
    if a.wire_iface:
        common += ["--wire-iface", a.wire_iface]
    records = training_runs.launch_seeds(a, "diloco", variants, common, env)
    if records is None:
        return 1
    summary = summarize(records)
    print_summary(summary, a.target)
    if a.out:
        path = training_runs.write_results(a, "diloco", argv, env, summary, records)
        png = plot(records, path[:-len(".json")] + ".png",
                   command_line(None, "diloco", argv), a.plot_seed)
        if png:
            print(f"wrote {os.path.relpath(png, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
