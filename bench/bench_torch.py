"""Training throughput: mpicoll.torch's DistributedOptimizer vs torch DDP (gloo) vs the loop
a user would hand-roll (one mpi4py ``Allreduce`` per gradient after backward).

Run under mpirun; every mode runs in the same launch, interleaved over ``--repeats``::

    mpirun -n 2 python bench/bench_torch.py --steps 60 --repeats 3

Each rank trains the same small CNN (``--model cnn``: 1x28x28 input, 412k
parameters) on synthetic data with ``--batch`` samples per rank and one torch thread per
rank. Throughput = ranks x batch x steps / (slowest rank's time). Rank 0 prints one row per
mode (best and median over repeats) and the scaling efficiency against ``--single`` (the
samples/s of one process, measured with ``-n 1``), or writes ``--format csv|json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN()


def data(batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def run_mpicoll(args: argparse.Namespace, comm: MPI.Intracomm, variant: str = "mpicoll") -> float:
    import mpicoll.torch as hvd

    hvd.shutdown()
    for key in ("MPICOLL_OVERLAP", "MPICOLL_ALLREDUCE_ALGORITHM"):
        os.environ.pop(key, None)
    os.environ.update(VARIANTS[variant])
    hvd.init(comm)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    x, y = data(args.batch, comm.rank)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return timed(step, args, comm)


_ddp_ready = False


def run_ddp(args: argparse.Namespace, comm: MPI.Intracomm) -> float:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    global _ddp_ready
    if not _ddp_ready:
        port = comm.bcast(29500 + (os.getpid() % 2000) if comm.rank == 0 else None)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
        _ddp_ready = True
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data(args.batch, comm.rank)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return timed(step, args, comm)


def run_handrolled(args: argparse.Namespace, comm: MPI.Intracomm) -> float:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data(args.batch, comm.rank)
    size = comm.size

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
            p.grad.div_(size)
        opt.step()
    return timed(step, args, comm)


def timed(step, args: argparse.Namespace, comm: MPI.Intracomm) -> float:
    for _ in range(args.warmup):
        step()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    slowest = comm.allreduce(elapsed, op=MPI.MAX)
    return comm.size * args.batch * args.steps / slowest


RUNNERS = {"ddp": run_ddp, "handrolled": run_handrolled}
for _variant in VARIANTS:
    RUNNERS[_variant] = (lambda v: lambda args, comm: run_mpicoll(args, comm, v))(_variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {sorted(set(MODES) | set(VARIANTS))}")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--single", type=float, default=0.0,
                        help="one-process samples/s, for the scaling efficiency column")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(RUNNERS[mode](args, comm))
    if comm.rank != 0:
        return
    nparams = sum(p.numel() for p in make_model().parameters())
    rows = []
    for mode in modes:
        best, median = max(results[mode]), statistics.median(results[mode])
        eff = best / (comm.size * args.single) if args.single else None
        rows.append(dict(mode=mode, ranks=comm.size, batch=args.batch, params=nparams,
                         best=round(best, 1), median=round(median, 1),
                         all=[round(v, 1) for v in results[mode]],
                         efficiency=None if eff is None else round(eff, 3)))
    if args.format == "json":
        print(json.dumps(rows, indent=1))
        return
    if args.format == "csv":
        print("mode,ranks,batch,params,best,median,efficiency")
        for r in rows:
            print(f"{r['mode']},{r['ranks']},{r['batch']},{r['params']},{r['best']},"
                  f"{r['median']},{r['efficiency'] if r['efficiency'] is not None else ''}")
        return
    print(f"# mpicoll.torch training throughput: SmallCNN ({nparams} parameters), "
          f"{comm.size} ranks, batch {args.batch}/rank, {args.threads} thread(s)/rank, "
          f"{args.steps} steps x {args.repeats} repeats, MPI thread level "
          f"{MPI.Query_thread()}")
    base = {r["mode"]: r["best"] for r in rows}
    print(f"{'# mode':<12}{'best samples/s':>16}{'median':>10}{'vs ddp':>9}"
          f"{'vs hand':>9}{'scaling':>9}")
    for r in rows:
        vs_ddp = r["best"] / base["ddp"] if "ddp" in base else float("nan")
        vs_hand = r["best"] / base["handrolled"] if "handrolled" in base else float("nan")
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        print(f"{r['mode']:<12}{r['best']:>16.1f}{r['median']:>10.1f}{vs_ddp:>9.2f}"
              f"{vs_hand:>9.2f}{eff:>9}")


if __name__ == "__main__":
    main()
