"""Training throughput: mpicoll.torch's DistributedOptimizer vs torch DDP (gloo) vs the loop
a user would hand-roll (one mpi4py ``Allreduce`` per gradient after backward).

Run under mpirun; every mode runs in the same launch, interleaved over ``--repeats``::

    mpirun -n 2 python bench/bench_torch.py --steps 60 --repeats 3

Each rank trains the same small CNN (``--model cnn``: 1x28x28 input, 412k
parameters) on synthetic data with ``--batch`` samples per rank and one torch thread per
rank. The timed loop (after ``--warmup`` steps) is timed as a whole and step by step (the
slowest rank's); the headline throughput is **wall**: total samples / total wall time of
the timed loops, what a user sees. The median and 10th-percentile step times are shown
beside it (robust to load spikes on a shared machine). Rank 0 prints one row per mode and the scaling efficiency against
``--single`` (the median samples/s of one process, measured with ``-n 1``), or writes
``--format csv|json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = ("mpicoll", "ddp", "handrolled")
#: mpicoll variants: extra environment for hvd.init() (re-initialized per run).
VARIANTS = {"mpicoll": {}, "mpicoll-overlap": {"MPICOLL_OVERLAP": "1"},
            "mpicoll-defer": {"MPICOLL_OVERLAP": "0"},
            "mpicoll-native": {"MPICOLL_ALLREDUCE_ALGORITHM": "native"}}


class SmallCNN(nn.Module):
    """conv(1->8,3) pool conv(8->16,3) pool fc(400->1000) fc(1000->10): 412k parameters,
    most of them in fc1 (so communication is not negligible next to compute)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc1 = nn.Linear(16 * 5 * 5, 1000)
        self.fc2 = nn.Linear(1000, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class MLP(nn.Module):
    """fc(784->2048) fc(2048->1024) fc(1024->10): 3.7M parameters and little compute per
    byte of gradient (communication-bound where SmallCNN is compute-bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 2048)
        self.fc2 = nn.Linear(2048, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


#: ``--model`` choices.
MODELS = {"cnn": SmallCNN, "mlp": MLP}


def make_model(name: str = "cnn", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def data(batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def run_mpicoll(args: argparse.Namespace, comm: MPI.Intracomm,
                variant: str = "mpicoll") -> Timing:
    import mpicoll.torch as hvd

    hvd.shutdown()
    for key in ("MPICOLL_OVERLAP", "MPICOLL_ALLREDUCE_ALGORITHM"):
        os.environ.pop(key, None)
    os.environ.update(VARIANTS[variant])
    hvd.init(comm)
    model = make_model(args.model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    return time_sgd_steps(model, opt, args, comm)


_ddp_ready = False


def run_ddp(args: argparse.Namespace, comm: MPI.Intracomm) -> Timing:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    global _ddp_ready
    if not _ddp_ready:
        port = comm.bcast(29500 + (os.getpid() % 2000) if comm.rank == 0 else None)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
        _ddp_ready = True
    model = DDP(make_model(args.model))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return time_sgd_steps(model, opt, args, comm)


def run_handrolled(args: argparse.Namespace, comm: MPI.Intracomm) -> Timing:
    model = make_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    size = comm.size

    def average_gradients() -> None:
        for p in model.parameters():
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
            p.grad.div_(size)
    return time_sgd_steps(model, opt, args, comm, average_gradients)


def time_sgd_steps(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace,
                   comm: MPI.Intracomm, after_backward=None) -> Timing:
    """Time SGD steps of ``model`` on this rank's batch (``after_backward`` runs before step)."""
    x, y = data(args.batch, comm.rank)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
    return timed(step, args, comm)


class Timing(NamedTuple):
    """One timed run: per-step seconds (the slowest rank's, step by step), the wall
    time of the whole loop (the slowest rank's), after ``--warmup`` steps, and the CPU
    time the ranks' processes spent in it (every thread, summed over the ranks: on a
    machine shared with another job, throughput follows it rather than the wall)."""

    steps: list[float]
    wall: float
    cpu: float = 0.0


def timed(step, args: argparse.Namespace, comm: MPI.Intracomm) -> Timing:
    """Run ``--warmup`` steps, then time ``--steps`` steps: each one and the whole loop."""
    for _ in range(args.warmup):
        step()
    comm.Barrier()
    times = []
    cpu = time.process_time()
    begin = time.perf_counter()
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    wall = time.perf_counter() - begin
    cpu = time.process_time() - cpu
    gathered = comm.allgather((times, wall, cpu))
    return Timing(list(map(max, zip(*(t for t, _, _ in gathered)))),
                  max(w for _, w, _ in gathered), sum(c for _, _, c in gathered))


def interleaved_times(calls: dict, steps: int, repeats: int, comm: MPI.Intracomm,
                      before_round=None) -> dict:
    """Seconds per call of each of ``calls`` (key -> function of no arguments), the
    slowest rank's mean over ``steps`` calls after one untimed call, in ``repeats`` rounds
    that interleave the calls; ``before_round`` (if given) runs before each round."""
    times: dict = {key: [] for key in calls}
    for _ in range(repeats):
        if before_round is not None:
            before_round()
        for key, fn in calls.items():
            fn()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[key].append(comm.allreduce((time.perf_counter() - start) / steps,
                                             op=MPI.MAX))
    return times


def mpicoll_default_group(tool: str) -> bool:
    """Start the default torch.distributed group on "mpicoll" unless a group is there
    (which must then be "mpicoll"; else ``SystemExit`` naming ``tool``); returns whether
    this call started it."""
    import torch.distributed as dist

    import mpicoll.torch  # noqa: F401  (registers "mpicoll")

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("mpicoll")
    if dist.get_backend() != "mpicoll":
        raise SystemExit(f"{tool} needs the default group on 'mpicoll', not "
                         f"{dist.get_backend()!r}")
    return started


def run_local(args: argparse.Namespace, comm: MPI.Intracomm) -> Timing:
    """Every rank trains alone, no communication: the ceiling for ``comm.size`` ranks
    sharing this machine (what scaling efficiency cannot exceed here)."""
    model = make_model(args.model)
    return time_sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), args, comm)


RUNNERS = {"ddp": run_ddp, "handrolled": run_handrolled, "local": run_local}
for _variant in VARIANTS:
    RUNNERS[_variant] = (lambda v: lambda args, comm: run_mpicoll(args, comm, v))(_variant)


def fusion_sweep(args: argparse.Namespace, comm: MPI.Intracomm) -> None:
    """Time one step's worth of gradient all-reduces (the SmallCNN's tensors plus
    ``--sweep-tensors`` small ones, submitted together) at several fusion thresholds."""
    import mpicoll.torch as hvd

    shapes = [tuple(p.shape) for p in make_model(args.model).parameters()]
    shapes += [(args.sweep_tensors_size,)] * args.sweep_tensors
    thresholds = [int(t) for t in args.fusion_sweep.split(",")]
    results: dict[int, list[float]] = {t: [] for t in thresholds}
    for _ in range(args.repeats):
        for threshold in thresholds:
            hvd.shutdown()
            os.environ["MPICOLL_FUSION_THRESHOLD"] = str(threshold)
            hvd.init(comm)
            tensors = [torch.ones(s) for s in shapes]
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    comm.Barrier()
                    start = time.perf_counter()
                hs = [hvd.allreduce_async_(t, name=f"g{j}") for j, t in enumerate(tensors)]
                for h in hs:
                    hvd.synchronize(h)
            results[threshold].append((time.perf_counter() - start) / args.steps)
    hvd.shutdown()
    if comm.rank == 0:
        total = sum(torch.Size(s).numel() for s in shapes) * 4
        print(f"# fusion sweep: {len(shapes)} float32 tensors, {total} bytes per step, "
              f"{comm.size} ranks; ms per step (best, median of {args.repeats})")
        print(f"{'# threshold':<14}{'best ms':>10}{'median ms':>11}")
        for t in thresholds:
            print(f"{t:<14}{min(results[t]) * 1e3:>10.3f}"
                  f"{statistics.median(results[t]) * 1e3:>11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {sorted(set(MODES) | set(VARIANTS) | {'local'})}"
                             " (local: no communication, the machine's ceiling)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn",
                        help="cnn: SmallCNN, 412k parameters; mlp: 784-2048-1024-10, 3.7M")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--single", type=float, default=0.0,
                        help="one-process samples/s, for the scaling efficiency column")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument("--fusion-sweep", default="",
                        help="instead of training, time all-reduces at these comma-separated "
                             "MPICOLL_FUSION_THRESHOLD values (bytes)")
    parser.add_argument("--sweep-tensors", type=int, default=64,
                        help="extra small tensors in the fusion sweep")
    parser.add_argument("--sweep-tensors-size", type=int, default=4096,
                        help="elements of each extra tensor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    if args.fusion_sweep:
        fusion_sweep(args, comm)
        return
    modes = [m for m in args.modes.split(",") if m]
    steps: dict[str, list[float]] = {m: [] for m in modes}
    totals: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, float] = {m: 0.0 for m in modes}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for mode in modes:
            timing = RUNNERS[mode](args, comm)
            steps[mode] += timing.steps
            walls[mode] += timing.wall
            totals[mode].append(comm.size * args.batch * len(timing.steps) / timing.wall)
    load.append(os.getloadavg()[0])
    if comm.rank != 0:
        return
    nparams = sum(p.numel() for p in make_model(args.model).parameters())
    rows = []
    for mode in modes:
        ordered = sorted(steps[mode])
        p50 = ordered[len(ordered) // 2]
        p10 = ordered[len(ordered) // 10]
        per_step = comm.size * args.batch
        median = per_step / p50
        eff = median / (comm.size * args.single) if args.single else None
        wall = per_step * len(steps[mode]) / walls[mode]  # total samples / total time
        rows.append(dict(mode=mode, ranks=comm.size, batch=args.batch, params=nparams,
                         wall=round(wall, 1),
                         median=round(median, 1), p10=round(per_step / p10, 1),
                         runs=[round(v, 1) for v in totals[mode]],
                         efficiency=None if eff is None else round(eff, 3)))
    if args.format == "json":
        print(json.dumps(dict(load=load, rows=rows), indent=1))
        return
    if args.format == "csv":
        print("mode,ranks,batch,params,wall,median,p10,efficiency")
        for r in rows:
            print(f"{r['mode']},{r['ranks']},{r['batch']},{r['params']},{r['wall']},{r['median']},"
                  f"{r['p10']},{r['efficiency'] if r['efficiency'] is not None else ''}")
        return
    print(f"# mpicoll.torch training throughput: SmallCNN ({nparams} parameters), "
          f"{comm.size} ranks, batch {args.batch}/rank, {args.threads} thread(s)/rank, "
          f"{args.steps} steps x {args.repeats} repeats, MPI thread level "
          f"{MPI.Query_thread()}, load average {load[0]:.1f} -> {load[1]:.1f}")
    print("# samples/s: wall = total samples / total wall time of the timed loops (the"
          " slowest rank's, warm-up excluded);")
    print("# also from the median and the 10th-percentile step time; ratios use wall")
    base = {r["mode"]: r["wall"] for r in rows}
    print(f"{'# mode':<17}{'wall':>10}{'median':>10}{'p10':>10}{'vs ddp':>9}{'vs hand':>9}"
          f"{'scaling':>9}")
    for r in rows:
        vs_ddp = r["wall"] / base["ddp"] if "ddp" in base else float("nan")
        vs_hand = r["wall"] / base["handrolled"] if "handrolled" in base else float("nan")
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        print(f"{r['mode']:<17}{r['wall']:>10.1f}{r['median']:>10.1f}{r['p10']:>10.1f}"
              f"{vs_ddp:>9.2f}{vs_hand:>9.2f}{eff:>9}")


if __name__ == "__main__":
    main()
