"""Where one DDP step on "mpicoll" goes, measured inside the step: each layer of the
backend's path is wrapped with a timer (wall and the calling thread's CPU time), and the
step's forward, backward and optimizer phases are timed, over ``--steps`` steps after
``--warmup``. Rank 0 prints, for every rank, the median per call (ms, wall/CPU) and the
calls per step.

The layers, outermost first: ``MPIProcessGroup.allreduce`` (the call DDP's reducer makes
for a bucket, with its argument checks, the ``Work`` and future), the lane's ``submit``
(the hand-over, or the run on the caller's thread for the pass's last bucket), the
agreement step (``checked.agree``; on one node through the node window's ``exchange``),
and mpicoll's all-reduce itself (``collectives.allreduce``). A layer's time includes the
layers inside it and, for a collective, the wait for the last rank to arrive. The
wrappers add a few microseconds per call.

    mpirun -n 2 python -m bench.ddp_inside --model cnn --steps 200
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

from bench.bench_torch import MODELS, data, make_model, mpicoll_default_group


def _layers() -> list[tuple[Any, str, str]]:
    """(module or class, attribute, label): the layers timed, outermost first."""
    from mpicoll import node_window
    from mpicoll.runtime import progress
    from mpicoll.torch.distributed import process_group as pg

    return [(pg.MPIProcessGroup, "allreduce", "backend allreduce"),
            (progress.Lane, "submit", "lane submit"),
            (pg, "agree", "agreement"),
            (node_window.NodeWindow, "exchange", "node window exchange"),
            (pg.collectives, "allreduce", "mpicoll allreduce")]


def wrap(owner: Any, name: str, label: str, record: dict[str, list]) -> Callable[[], None]:
    """Replace ``owner.name`` by a timed call recording (wall, thread CPU) under ``label``;
    returns what puts the original back."""
    inner: Callable = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            record.setdefault(label, []).append((time.perf_counter() - start,
                                                 time.thread_time() - cpu))
    setattr(owner, name, timed)
    return lambda: setattr(owner, name, inner)


def timed_steps(args: argparse.Namespace, record: dict[str, list]) -> None:
    """DDP on the default ("mpicoll") group: ``--warmup`` steps, then ``--steps`` steps
    whose phases go into ``record``."""
    model = torch.nn.parallel.DistributedDataParallel(make_model(args.model),
                                                      bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data(args.batch, dist.get_rank())
    clock = time.perf_counter
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            record.clear()
        start, cpu = clock(), time.thread_time()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        forward = clock()
        loss.backward()
        backward = clock()
        opt.step()
        end = clock()
        if step >= args.warmup:
            for label, value in (("step: forward", (forward - start, None)),
                                 ("step: backward", (backward - forward, None)),
                                 ("step: optimizer", (end - backward, None)),
                                 ("step", (end - start, time.thread_time() - cpu))):
                record.setdefault(label, []).append(value)


def main(argv: list[str] | None = None) -> dict[str, tuple]:
    """Run it; returns this rank's rows: label -> (median wall s, median CPU s or
    ``None``, calls per step)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = mpicoll_default_group("bench.ddp_inside")
    record: dict[str, list] = {}
    layers = _layers()
    restore = [wrap(owner, name, label, record) for owner, name, label in layers]
    try:
        timed_steps(args, record)
    finally:
        for undo in restore:
            undo()
    order = [label for _, _, label in layers] + ["step: forward", "step: backward",
                                                 "step: optimizer", "step"]
    rows = {label: (statistics.median(w for w, _ in record[label]),
                    None if record[label][0][1] is None else
                    statistics.median(c for _, c in record[label]),
                    len(record[label]) / args.steps) for label in order if label in record}
    everyone = MPI.COMM_WORLD.gather(rows)
    if dist.get_rank() == 0:
        print(f"# {args.model}, {dist.get_world_size()} ranks, median ms per call "
              f"(wall/CPU of the calling thread; phases: wall), calls per step")
        for label in rows:
            cells = "  ".join("-" if label not in r else f"{r[label][0] * 1e3:7.3f}/" + (
                "     -" if r[label][1] is None else f"{r[label][1] * 1e3:6.3f}")
                for r in everyone)
            print(f"{label:22s} {cells}  x{rows[label][2]:g}")
    if started:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
