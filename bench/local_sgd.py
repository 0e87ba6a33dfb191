"""Local SGD and hierarchical SGD against every-step synchronous training, to accuracy.

``examples/train.py``'s model and data (a small CNN on scikit-learn's 8x8 digits, global
batch 64 split over the ranks, SGD lr 0.05 momentum 0.9) trained with
``DistributedOptimizer(..., sync_every=H, node_sync_every=M, warmup_steps=K)`` for each
``--variants`` entry: ``sync`` (every step, the baseline), ``H2``, ``H4``, ``H8``,
``H8M1`` (hierarchical: the node every step, every rank every 8th), ``H8M2``, ``...K23``
for a warm-up of 23 steps (one epoch at 4 ranks), and a final ``P`` to average the
parameters only (``average_state=False``: the momentum buffers stay per rank). Seeds are the outer loop and variants
the inner one, all variants of a seed in one launch (in an order rotated per seed), so
the variants interleave and share the machine's load. ``--step-times BLOCKS`` instead
times steps of every variant taking turns block by block in one launch.

Each run records, on rank 0: the training wall time (steps only; the evaluations are
excluded) and the test accuracy every 8 steps (right after a world average for every
variant here: 8 is a multiple of every ``H``), the time and step at which the test accuracy
first reaches ``--target``, the final test accuracy, and the bytes that cross nodes per
step, counted from the schedule: every average over all ranks is a ring all-reduce
(``MPICOLL_ALLREDUCE_ALGORITHM=ring`` is set for the baseline's gradient all-reduce too),
in which each rank sends ``2 (n - 1) / n`` of the vector to its ring successor, and the
successor of the last rank of a node is on another node. From the repository root::

    python -m bench.local_sgd --ranks 4 --ranks-per-node 2 --seeds 1,2 --out docs/results

Under ``MPICOLL_BENCH_MPIRUN="cluster/cluster mpirun -ppn 2"`` the launches run on the
test bed (docs/cluster.md) instead (leave ``--ranks-per-node 0`` there: real nodes).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

from bench import training_runs
from bench.bench_ps import launch_json

DEFAULT_VARIANTS = "sync,H2,H4,H8,H8M1"
VARIANT = re.compile(r"^(?:sync|H(\d+))(?:M(\d+))?(?:K(\d+))?(P?)$")


def parse_variant(name: str) -> dict:
    """``"H8M1K23"`` -> ``{"sync_every": 8, "node_sync_every": 1, "warmup_steps": 23,
    "average_state": True}``; a final ``P`` averages the parameters only
    (``average_state=False``)."""
    m = VARIANT.match(name)
    if m is None:
        raise argparse.ArgumentTypeError(f"variant {name!r}: sync, H<n>, H<n>M<m>, ...K<k>, "
                                         f"...P")
    h, node, k, params_only = m.groups()
    return {"sync_every": int(h or 1), "node_sync_every": int(node) if node else None,
            "warmup_steps": int(k or 0), "average_state": not params_only}


def cross_node_ring_senders(node_sizes: list[int]) -> int:
    """How many ranks' ring successors (``r + 1 mod n``) are on another node (nodes hold
    consecutive ranks, ``node_sizes`` of them in order)."""
    node = [i for i, k in enumerate(node_sizes) for _ in range(k)]
    return sum(1 for r in range(len(node)) if node[r] != node[(r + 1) % len(node)])


def _train_run(train, hvd, a: argparse.Namespace, variant: str, seed: int, data) -> dict:
    """Train one variant from scratch; rank 0's record (None elsewhere)."""
    import torch

    settings = parse_variant(variant)
    per_rank = max(1, a.batch // hvd.size())
    xtr, ytr, xte, yte, desc = data
    torch.manual_seed(seed)
    model = train.DigitsCNN()
    inner = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   **settings)
    train_seconds, step, log, reached = training_runs.train_to_target(
        train, a, seed, model, opt, xtr, ytr, per_rank,
        lambda: train.evaluate(model, xte, yte))
    accuracy = train.evaluate(model, xte, yte)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = params if (settings["sync_every"] > 1 and a.momentum
                       and settings["average_state"]) else 0   # momentum buffers
    stats = opt.local_sgd.stats() if opt.local_sgd is not None else None
    from mpi4py import MPI
    from mpicoll.context import get_context
    node_sizes = get_context(MPI.COMM_WORLD).topology.node_sizes
    return {"variant": variant, "seed": seed, "settings": settings, "ranks": hvd.size(),
            "steps": step, "train_seconds": train_seconds, "final_accuracy": accuracy,
            "reached": reached, "log": log, "param_bytes": params, "state_bytes": state,
            "data": desc, "local_sgd": stats, "node_sizes": node_sizes}


def _step_times(train, hvd, a: argparse.Namespace, variants: list[str], data) -> dict:
    """Milliseconds per step of each variant, in blocks of ``a.eval_every`` steps that take
    turns (one model and optimizer per variant, all in this process)."""
    import torch

    xtr, ytr = data[0], data[1]
    per_rank = max(1, a.batch // hvd.size())
    runs = []
    for v in variants:
        torch.manual_seed(1)
        model = train.DigitsCNN()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum),
            named_parameters=model.named_parameters(), **parse_variant(v))
        runs.append((v, model, opt))
    times: dict[str, list[float]] = {v: [] for v in variants}
    idx = train.shard(len(ytr), 0, 1)[:per_rank]
    for block in range(a.step_times + 1):
        for v, model, opt in runs:
            t0 = time.perf_counter()
            for _ in range(a.eval_every):
                train.train_step(model, opt, xtr, ytr, idx)
            if block:                      # the first block warms up
                times[v].append(1e3 * (time.perf_counter() - t0) / a.eval_every)
    return {v: {"median_ms": statistics.median(t), "mean_ms": statistics.mean(t)}
            for v, t in times.items()}


def worker(a: argparse.Namespace) -> int:
    """One process of a launch (under mpirun): every variant, in the order given; rank 0
    writes the records to ``a.json``."""
    variants = a.variant.split(",")

    def results(train, hvd, data):
        if a.step_times:
            return _step_times(train, hvd, a, variants, data)
        return [_train_run(train, hvd, a, v, a.seed, data) for v in variants]

    return training_runs.worker(a, results)


def cross_bytes_per_step(record: dict) -> float:
    """Bytes crossing nodes per step (all ranks together), from the averages done."""
    ranks = record["ranks"]
    senders = cross_node_ring_senders(record["node_sizes"])
    ring = senders * 2 * (ranks - 1) / ranks     # vectors crossing per world all-reduce
    stats = record["local_sgd"]
    if stats is None:                                 # every step: gradients, world
        return ring * record["param_bytes"]
    world_grads = stats["grads.world"] * record["param_bytes"]
    world_params = stats["params.world"] * (record["param_bytes"] + record["state_bytes"])
    return ring * (world_grads + world_params) / record["steps"]


def summarize(records: list[dict]) -> dict:
    """Per variant: medians over seeds, and ratios to ``sync``."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        mine = [r for r in records if r["variant"] == variant]
        reached = [r["reached"][1] for r in mine if r["reached"]]
        out[variant] = {
            "runs": len(mine),
            "final_accuracy_mean": statistics.mean(r["final_accuracy"] for r in mine),
            "train_seconds_median": statistics.median(r["train_seconds"] for r in mine),
            "time_to_target_median": statistics.median(reached) if len(reached) == len(mine)
            else None,
            "steps_to_target": [r["reached"][0] if r["reached"] else None for r in mine],
            "reached": f"{len(reached)}/{len(mine)}",
            "cross_node_bytes_per_step": cross_bytes_per_step(mine[0]),
            "node_sizes": mine[0]["node_sizes"],
        }
    base = out.get("sync")
    for row in out.values():
        if base and base["time_to_target_median"] and row["time_to_target_median"]:
            row["time_to_target_vs_sync"] = row["time_to_target_median"] / \
                base["time_to_target_median"]
        if base:
            row["accuracy_vs_sync_points"] = 100 * (row["final_accuracy_mean"] -
                                                    base["final_accuracy_mean"])
            row["train_seconds_vs_sync"] = row["train_seconds_median"] / \
                base["train_seconds_median"]
    return out


def print_summary(summary: dict, target: float) -> None:
    print(f"# variant  reached  time-to-{target:.2f}(s)  vs-sync  steps  final-acc  "
          f"d-acc(pts)  train(s)  vs-sync  cross-node B/step")
    for name, row in summary.items():
        ttt = row["time_to_target_median"]
        print(f"{name:9s} {row['reached']:>7s}  {ttt if ttt is None else round(ttt, 2)!s:>8s}"
              f"  {row.get('time_to_target_vs_sync', float('nan')):7.2f}  "
              f"{row['steps_to_target']!s:>10s}  {row['final_accuracy_mean']:.4f}  "
              f"{row.get('accuracy_vs_sync_points', float('nan')):+7.2f}  "
              f"{row['train_seconds_median']:8.2f}  {row.get('train_seconds_vs_sync', 0):5.2f}"
              f"  {row['cross_node_bytes_per_step']:12.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_runs.add_run_options(p, variants=DEFAULT_VARIANTS, epochs=15)
    training_runs.add_target_options(p, eval_every=8, timeout=600)
    p.add_argument("--step-times", type=int, default=0, metavar="BLOCKS",
                   help="instead: time BLOCKS blocks of --eval-every steps per variant, the "
                        "variants taking turns in one launch")
    p.add_argument("--out", default=None, help="write local_sgd.json (and --name) here")
    p.add_argument("--name", default="local_sgd")
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        parse_variant(v)
    env = training_runs.environment(a)
    records = []
    common = training_runs.forwarded(a, "epochs", "batch", "lr", "momentum", "target",
                                     "eval-every", "step-times")
    if a.step_times:
        summary = launch_json(a.ranks, ["-m", "bench.local_sgd", "--worker", "--variant",
                                        ",".join(variants), *common], "step times",
                              a.timeout, env)
        if summary is None:
            return 1
        base = summary.get("sync", {}).get("median_ms")
        print("# variant  median ms/step  mean ms/step  median vs sync")
        for v, row in summary.items():
            print(f"{v:9s} {row['median_ms']:14.2f} {row['mean_ms']:12.2f} "
                  f"{row['median_ms'] / base if base else float('nan'):14.2f}")
    else:
        records = training_runs.launch_seeds(a, "local_sgd", variants, common, env)
        if records is None:
            return 1
        summary = summarize(records)
        print_summary(summary, a.target)
    if a.out:
        training_runs.write_results(a, "local_sgd", argv, env, summary, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
