"""Train a small MLP classifier through the parameter server (synthetic data, no download).

    mpirun -n 4 python examples/ps_train.py --servers 1
    mpirun -n 5 python -m mpi4py examples/ps_train.py --servers 2 --consistency ssp --staleness 2
    mpirun -n 2 python -m mpi4py examples/ps_train.py --servers colocated
    mpirun --with-ft ulfm -n 5 python examples/ps_train.py --servers 3 --replicas 1 \
        --crash-rank 0 --crash-mode kill --crash-step 10      # Open MPI: failover
    mpirun -n 4 python -m mpi4py examples/ps_train.py --backup-workers 1 --slow-rank 3 --slow-factor 3

Ranks ``0 .. servers-1`` serve; the others are workers (with ``--servers colocated`` every
rank is a worker and serves its own shards), each training on its own slice of a
synthetic 4-class problem (noisy concentric rings in 2-D lifted to 8 features). Every step a
worker computes the gradient of the cross-entropy on a minibatch and calls ``push_pull``;
the servers apply the optimizer. The first worker prints test loss and accuracy.

Training runs until the worker's clock (the round it pushes next) has advanced ``--steps``
rounds: with ``--backup-workers`` a worker whose pushes were dropped skips rounds, so it
gets there in fewer steps. A worker's minibatch depends only on (seed, worker index,
clock), so a run restored from a checkpoint takes the same next step as an uninterrupted
one (``--save DIR --save-every K`` checkpoints every K rounds; ``--dump FILE`` writes the
first worker's parameters at every clock).

Launch with ``python -m mpi4py`` so that an exception on any rank aborts the whole job
(MPI_Abort) instead of leaving the others waiting; ``--crash-rank`` injects one to show it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mpicoll.ps import ParameterServer  # noqa: E402

CLASSES = 4
FEATURES = 8


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy concentric rings (class = ring), lifted to FEATURES dims by a fixed map."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    radius = 1.0 + y + rng.normal(0, 0.18, n)
    angle = rng.uniform(0, 2 * np.pi, n)
    xy = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    lift = np.random.default_rng(1234).normal(0, 1, (2, FEATURES))
    x = np.concatenate([xy, np.tanh(xy @ lift[:, 2:])], axis=1) / 2.0
    return x.astype(np.float32), y


def init_params(hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w1": (rng.normal(0, 1, (FEATURES, hidden)) / np.sqrt(FEATURES)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.normal(0, 1, (hidden, CLASSES)) / np.sqrt(hidden)).astype(np.float32),
            "b2": np.zeros(CLASSES, np.float32)}


def forward(p: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    prob = np.exp(logits)
    prob /= prob.sum(axis=1, keepdims=True)
    return h, prob


def loss_and_accuracy(p: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    _, prob = forward(p, x)
    loss = -np.mean(np.log(prob[np.arange(len(y)), y] + 1e-12))
    return float(loss), float(np.mean(prob.argmax(axis=1) == y))


def gradients(p: dict, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    h, prob = forward(p, x)
    d = prob
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    dh = (d @ p["w2"].T) * (1 - h * h)
    return {"w1": (x.T @ dh).astype(np.float32), "b1": dh.sum(0).astype(np.float32),
            "w2": (h.T @ d).astype(np.float32), "b2": d.sum(0).astype(np.float32)}


def servers_arg(text: str) -> int | str:
    """``--servers``: an int, or ``colocated``."""
    return text if text == "colocated" else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=servers_arg, default=1,
                    help="number of server ranks, or 'colocated' (every rank trains and "
                         "serves its shards; bsp only)")
    ap.add_argument("--consistency", default="bsp", choices=["bsp", "asp", "ssp"])
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--backup-workers", type=int, default=0,
                    help="bsp: a round closes once all but this many workers have pushed")
    ap.add_argument("--replicas", type=int, default=0,
                    help="1: every shard on a primary and a backup server rank (needs "
                         "--servers >= 2); under ULFM a dead server fails over to its backup")
    ap.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "adam"])
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--compression", default=None,
                    help="codec of pushes and pulls: fp16, bf16, int8, onebit, topk:0.01, ...")
    ap.add_argument("--steps", type=int, default=300, help="steps per worker")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--straggler-rank", type=int, default=-1,
                    help="this rank sleeps --straggler-delay seconds every step")
    ap.add_argument("--straggler-delay", type=float, default=0.0)
    ap.add_argument("--slow-rank", type=int, default=-1,
                    help="this worker's compute is --slow-factor times slower (it sleeps "
                         "(factor - 1) x its measured gradient time every step)")
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--json", help="the first worker writes [(seconds, step, loss, acc)] here")
    ap.add_argument("--save", help="checkpoint directory, written at the end of training")
    ap.add_argument("--save-every", type=int, default=0,
                    help="also checkpoint into --save every this many rounds")
    ap.add_argument("--dump", help="the first worker writes its parameters at every clock "
                                   "here (npz, keys '<clock>/<name>')")
    ap.add_argument("--restore", help="start from this checkpoint")
    ap.add_argument("--reshard", action="store_true",
                    help="allow restoring a checkpoint saved with another layout")
    ap.add_argument("--split-bytes", type=int, default=512,
                    help="tensors of at least this many bytes are split over all servers")
    ap.add_argument("--crash-rank", type=int, default=-1, help="inject a failure on this rank")
    ap.add_argument("--crash-step", type=int, default=5,
                    help="worker: the step that fails; server: fails after this many x 0.1 s")
    ap.add_argument("--crash-mode", default="raise", choices=["raise", "exit", "kill", "leave"],
                    help="raise an exception, exit the process without MPI_Finalize, "
                         "SIGKILL it (with --replicas 1 under ULFM the others go on), or "
                         "leave: a clean sys.exit(0) without closing the worker")
    return ap.parse_args(argv)


def crash(mode: str, where: str) -> None:
    if mode == "exit":
        print(f"injected crash: {where} exits", file=sys.stderr, flush=True)
        os._exit(3)
    if mode == "leave":
        print(f"injected crash: {where} leaves without close()", file=sys.stderr, flush=True)
        sys.exit(0)
    if mode == "kill":
        print(f"injected crash: {where} is killed at {time.time():.6f}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected crash: {where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    params = init_params(args.hidden, args.seed)
    ps = ParameterServer(params, comm=comm, num_servers=args.servers,
                         consistency=args.consistency, staleness=args.staleness,
                         optimizer=args.optimizer, lr=args.lr, restore=args.restore,
                         reshard=args.reshard, split_bytes=args.split_bytes,
                         backup_workers=args.backup_workers, compression=args.compression,
                         replicas=args.replicas)
    # the constructor has returned on every rank: collective calls before serve() are fine
    roles = comm.allgather("server" if ps.is_server else "worker")
    if rank == 0:
        print(f"ranks: {roles}", flush=True)
    if ps.is_server:
        if rank == args.crash_rank:
            def on_alarm(signum, frame):  # noqa: ANN001
                crash(args.crash_mode, f"server rank {rank}")
            signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, 0.1 * args.crash_step)
        ps.serve()
        ps.free()
        return 0

    result = train(ps, args)
    stats = ps.stats()
    ps.close()
    if ps.worker_index == 0:
        report(ps, args, result, stats)
    ps.free()
    return 0


def worker_data(seed: int, samples: int, worker: int, workers: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s slice of the training set (every ``workers``-th sample)."""
    x, y = make_data(samples, seed=seed + 1)
    return x[worker::workers], y[worker::workers]


def minibatch(seed: int, worker: int, clock: int, n: int, batch: int) -> np.ndarray:
    """Indices of a worker's minibatch at ``clock``: a function of (seed, worker, clock)
    only, so a restored run draws what the uninterrupted one drew."""
    return np.random.default_rng([seed, 100 + worker, clock]).integers(0, n, batch)


def compute_step(args: argparse.Namespace, ps: ParameterServer, w: dict, data: tuple
                 ) -> dict[str, np.ndarray]:
    """This worker's gradient at its clock; the slow rank then sleeps (factor - 1) x the
    time it took."""
    x, y = data
    idx = minibatch(args.seed, ps.worker_index, ps.clock, len(y), args.batch)
    t0 = time.perf_counter()
    g = gradients(w, x[idx], y[idx])
    if ps.rank == args.slow_rank and args.slow_factor > 1:
        time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))
    if ps.rank == args.straggler_rank:
        time.sleep(args.straggler_delay)
    return g


def train(ps: ParameterServer, args: argparse.Namespace) -> dict:
    """Push and pull until the clock has advanced ``args.steps`` rounds; checkpoint and
    record on the way. Returns the first worker's record (log, step times, dump)."""
    data = worker_data(args.seed, args.samples, ps.worker_index, ps.num_workers)
    test = make_data(2000, seed=args.seed + 2)
    first = ps.worker_index == 0
    rec: dict = {"log": [], "step_seconds": [], "dump": {}}
    start = time.perf_counter()
    w = ps.pull()
    end = ps.clock + args.steps
    step = 0
    while ps.clock < end:
        if ps.rank == args.crash_rank and step == args.crash_step:
            crash(args.crash_mode, f"worker rank {ps.rank} at step {step}")
        t0 = time.perf_counter()
        before = ps.clock
        if first and args.dump:
            rec["dump"].update({f"{before}/{k}": v.copy() for k, v in w.items()})
        w = ps.push_pull(compute_step(args, ps, w, data), out=w)
        rec["step_seconds"].append(time.perf_counter() - t0)
        if args.save_every and ps.clock // args.save_every > before // args.save_every:
            ps.save(args.save)
        if first and (step % args.log_every == 0 or ps.clock >= end):
            loss, acc = loss_and_accuracy(w, *test)
            rec["log"].append((time.perf_counter() - start, step, loss, acc))
            print(f"step {step:5d}  test loss {loss:.4f}  accuracy {acc:.3f}", flush=True)
        step += 1
    if first and args.dump:
        rec["dump"].update({f"{ps.clock}/{k}": v.copy() for k, v in w.items()})
        np.savez(args.dump, **rec.pop("dump"))
    if args.save:
        ps.save(args.save)
    rec.update(seconds=time.perf_counter() - start, steps=step,
               final=list(loss_and_accuracy(w, *test)))
    return rec


def report(ps: ParameterServer, args: argparse.Namespace, rec: dict, stats: dict) -> None:
    """The first worker's summary line, and the JSON record with ``--json``."""
    loss, acc = rec["final"]
    s = stats["worker"]
    dropped = sum(v.get("late_pushes_dropped", 0) for v in stats["servers"])
    print(f"final: test loss {loss:.4f}  accuracy {acc:.3f}  "
          f"({args.consistency}, {ps.num_servers} server(s), {ps.num_workers} workers, "
          f"{rec['seconds']:.2f} s, {rec['steps']} steps to clock {ps.clock}, "
          f"staleness max {s['staleness_max']} mean {s['staleness_mean']:.2f}, "
          f"late pushes dropped {dropped}, bytes per server {stats['bytes_per_server']}, "
          f"replicas {stats['replicas']})",
          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "log": rec["log"], "final": rec["final"],
                       "seconds": rec["seconds"], "steps": rec["steps"],
                       "step_seconds": rec["step_seconds"], "stats": stats}, f)


if __name__ == "__main__":
    sys.exit(main())
