"""DDP training throughput on the "mpicoll" torch.distributed backend against DDP on
"gloo" and against mpicoll.torch's ``DistributedOptimizer`` (Horovod-style), all in one
launch, interleaved::

    mpirun -n 2 python -m bench.ddp --steps 50 --warmup 10 --repeats 5
    mpirun -n 2 python -m bench.ddp --modes ddp-mpicoll,ddp-gloo --profile

Every mode trains bench_torch's ``--model`` (``cnn``: SmallCNN, 412k parameters, compute-bound;
``mlp``: 784-2048-1024-10, 3.7M parameters, communication-bound; ``--batch`` samples per
rank, ``--threads`` torch threads per rank) with plain SGD on synthetic data. Modes:

- ``ddp-mpicoll``: ``DistributedDataParallel`` on the default group, backend "mpicoll";
- ``ddp-mpicoll-first``: the same on a group that agrees only on the first call of each
  kind (``Options(check="first")``; the default group agrees on every call);
  ``ddp-mpicoll-native``: that, with MPI's own all-reduce (``algorithm="native"``);
- ``ddp-mpicoll-<codec>`` (``ddp-mpicoll-int8``, ``-bf16``...): DDP on the default group
  with :mod:`mpicoll.torch.hooks`' codec hook;
- ``ddp-gloo``: ``DistributedDataParallel`` on a gloo group of the same ranks
  (``dist.new_group(backend="gloo")``);
- ``ddp-none``: DDP on the gloo group with a communication hook that returns each bucket
  untouched at once: DDP's own cost (bucket copies, hooks, the reducer's bookkeeping)
  without any communication, the ceiling of DDP on any backend;
- ``hvd``: ``mpicoll.torch.DistributedOptimizer`` (``hvd.init()`` per run);
- ``local``: no communication (the machine's ceiling).

Each repeat runs every mode once, in order (``--repeats`` rounds, interleaved); a run is
``--warmup`` steps then ``--steps`` timed ones. The headline is **wall**: total samples /
total wall time of the timed loops (the slowest rank's), over all repeats; the median of
the repeats' rates is shown beside it, and the CPU time all ranks' processes spent per
timed step (every thread: what throughput follows on a machine shared with another job).
``--profile`` adds, per DDP mode, DDP's own
timers (average forward, backward compute, backward communication, their overlap) and
its bucket sizes. Rank 0 prints a table or writes ``--format json`` to ``--output``.

``--accuracy`` trains examples/train.py's model instead (DigitsCNN on scikit-learn's
digits, its defaults: 15 epochs, global batch 64 split over the ranks, SGD lr 0.05,
momentum 0.9) under DDP on "mpicoll" with each of ``--hooks`` (``none``: DDP's
all-reduce; ``powersgd``: torch's ``powerSGD_hook``, rank ``--powersgd-rank`` after
``--powersgd-start`` iterations; an mpicoll codec name: :func:`mpicoll.torch.hooks.codec_hook`),
for each of ``--seeds``, and reports the final test accuracy of each and its difference
from ``none`` (the issue's target: within 0.5 points)::

    mpirun -n 2 python -m bench.ddp --accuracy --seeds 1,2,3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402

from bench import common  # noqa: E402
from bench.bench_torch import (MODELS, Timing, interleaved_times,  # noqa: E402
                               make_model, mpicoll_default_group, run_local, run_mpicoll,
                               time_sgd_steps)

DEFAULT_MODES = ("ddp-mpicoll", "ddp-gloo", "hvd")

_groups: dict[str, Any] = {}
#: The "mpicoll" groups beside the default one (which agrees on every call, "auto").
GROUP_OPTIONS = {"mpicoll-first": {"check": "first"},
                 "mpicoll-native": {"check": "first", "algorithm": "native"}}


def setup_groups() -> bool:
    """The "mpicoll" default group (rank and size from MPI) and a gloo group beside it;
    returns whether this call started the default group."""
    started = mpicoll_default_group("bench.ddp")
    _groups["mpicoll"] = dist.group.WORLD
    _groups["gloo"] = dist.new_group(backend="gloo")
    from mpicoll.torch.distributed import Options  # noqa: PLC0415

    for name, options in GROUP_OPTIONS.items():
        _groups[name] = dist.new_group(backend="mpicoll", pg_options=Options(**options))
    return started


def teardown(started: bool, modes: list[str]) -> None:
    """Undo :func:`setup_groups` and ``hvd.init()`` (so callers in one process, such as
    the smoke tests, find things as they were)."""
    if "hvd" in modes:
        import mpicoll.torch as hvd  # noqa: PLC0415

        hvd.shutdown()
    if started:
        dist.destroy_process_group()
    else:
        for name in ("gloo", *GROUP_OPTIONS):
            dist.destroy_process_group(_groups[name])
    _groups.clear()


def _no_communication(_state, bucket):  # noqa: ANN001, ANN202  (DDP checks annotations)
    """A DDP communication hook that communicates nothing (``ddp-none``)."""
    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def run_ddp(args: argparse.Namespace, comm: Any, backend: str, hook: str | None = None
            ) -> tuple[Timing, dict]:
    """Time DDP on ``backend``'s group (with mpicoll's ``hook`` codec, if any; ``"none"``:
    the no-communication hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    model = DDP(make_model(args.model), process_group=_groups[backend],
                bucket_cap_mb=args.bucket_cap_mb)
    if hook == "none":
        model.register_comm_hook(None, _no_communication)
    elif hook is not None:
        import mpicoll.torch.hooks as hooks  # noqa: PLC0415

        model.register_comm_hook(hooks.CompressionState(), hooks.codec_hook(hook))
    timing = time_sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), args, comm)
    return timing, (ddp_profile(model) if args.profile else {})


def ddp_profile(model: Any) -> dict:
    """DDP's own timers (ns averages over its sampled iterations) and bucket sizes."""
    data_ = model._get_ddp_logging_data()
    keys = ("avg_forward_compute_time", "avg_backward_compute_time",
            "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")
    out = {k.removeprefix("avg_").removesuffix("_time"): data_.get(k, 0) / 1e6 for k in keys}
    out["bucket_sizes"] = data_.get("bucket_sizes", "")
    return out


def runner(mode: str) -> Callable[[argparse.Namespace, Any], tuple[Timing, dict]]:
    """The function that times ``mode`` (``ValueError`` for an unknown one)."""
    if mode == "ddp-gloo":
        return lambda args, comm: run_ddp(args, comm, "gloo")
    if mode == "ddp-none":
        return lambda args, comm: run_ddp(args, comm, "gloo", "none")
    if mode in ("ddp-mpicoll", *(f"ddp-{g}" for g in GROUP_OPTIONS)):
        return lambda args, comm: run_ddp(args, comm, mode.removeprefix("ddp-"))
    if mode.startswith("ddp-mpicoll-"):
        codec = mode.removeprefix("ddp-mpicoll-")
        from mpicoll.compression import get_codec  # noqa: PLC0415

        get_codec(codec, "mode")
        return lambda args, comm: run_ddp(args, comm, "mpicoll", codec)
    if mode == "hvd":
        def hvd_run(args: argparse.Namespace, comm: Any) -> tuple[Timing, dict]:
            import mpicoll.torch as hvd  # noqa: PLC0415

            timing = run_mpicoll(args, comm)
            hvd.shutdown()      # its engine thread must not run beside the next modes
            return timing, {}
        return hvd_run
    if mode == "local":
        return lambda args, comm: (run_local(args, comm), {})
    raise ValueError(f"unknown mode {mode!r}: choose ddp-mpicoll, ddp-mpicoll-first, "
                     f"ddp-mpicoll-<codec>, ddp-gloo, ddp-none, hvd or local")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated: ddp-mpicoll, ddp-mpicoll-first, ddp-mpicoll-native, "
                        "ddp-mpicoll-<codec>, ddp-gloo, ddp-none, hvd, local "
                        "(default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--model", choices=sorted(MODELS), default="cnn",
                   help="cnn: SmallCNN, 412k parameters (compute-bound); mlp: "
                        "784-2048-1024-10, 3.7M (communication-bound)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (0: leave torch's default, which "
                        "mpicoll's MPICOLL_TORCH_THREADS=auto may then fit to the node)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--profile", action="store_true",
                   help="DDP's timers and bucket sizes per DDP mode")
    p.add_argument("--layers", action="store_true",
                   help="time one bucket's all-reduce through each layer instead")
    p.add_argument("--layers-bytes", type=int, default=0,
                   help="--layers: bytes per all-reduce (default: the model's 412k floats)")
    p.add_argument("--accuracy", action="store_true",
                   help="train examples/train.py's model with each of --hooks instead")
    p.add_argument("--hooks", default="none,powersgd,int8",
                   help="--accuracy: none, powersgd, or mpicoll codecs (default: %(default)s)")
    p.add_argument("--seeds", default="1,2,3", help="--accuracy: comma-separated seeds")
    p.add_argument("--epochs", type=int, default=15, help="--accuracy: epochs")
    p.add_argument("--powersgd-rank", type=int, default=2)
    p.add_argument("--powersgd-start", type=int, default=23,
                   help="iterations before PowerSGD starts (23: one epoch at n x batch 64)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", default=None, help="write the json here (rank 0)")
    return p


def summarize(mode: str, timings: list[Timing], profiles: list[dict], n: int,
              batch: int) -> dict:
    """One mode's row: wall (total samples / total time), the repeats' rates and median."""
    samples = [n * batch * len(t.steps) for t in timings]
    rates = [s / t.wall for s, t in zip(samples, timings)]
    row = {"mode": mode, "wall": sum(samples) / sum(t.wall for t in timings),
           "median": statistics.median(rates), "runs": rates,
           "cpu_ms_per_step": 1e3 * sum(t.cpu for t in timings) / sum(len(t.steps)
                                                                 for t in timings)}
    if any(profiles):
        keys = [k for k in profiles[0] if k != "bucket_sizes"]
        row["profile_ms"] = {k: statistics.median(p[k] for p in profiles) for k in keys}
        row["bucket_sizes"] = profiles[-1]["bucket_sizes"]
    return row


def format_table(rows: list[dict], meta: dict) -> str:
    base = {r["mode"]: r["wall"] for r in rows}
    lines = [f"# DDP training throughput: {meta.get('model', 'cnn')}, {meta['ranks']} ranks, batch "
             f"{meta['batch']}/rank, {meta['steps']} steps x {meta['repeats']} repeats "
             f"(interleaved), {meta['thread_level']}, "
             f"{meta.get('torch_threads', '?')} torch threads per rank",
             f"# {meta['mpi_library']}; {meta['machine']}; load {meta['load'][0]:.1f} -> "
             f"{meta['load'][1]:.1f}",
             "# samples/s: wall = total samples / total time; median of the repeats' rates;"
             " cpu: CPU ms per step, all ranks' processes together",
             f"{'# mode':<22}{'wall':>10}{'median':>10}{'vs gloo':>9}{'cpu':>9}"]
    for r in rows:
        ratio = r["wall"] / base["ddp-gloo"] if "ddp-gloo" in base else float("nan")
        lines.append(f"{r['mode']:<22}{r['wall']:>10.1f}{r['median']:>10.1f}{ratio:>9.2f}"
                     f"{r.get('cpu_ms_per_step', float('nan')):>9.1f}")
    profiled = [r for r in rows if "profile_ms" in r]
    if profiled:
        lines.append("# DDP's timers, ms per step (median over repeats): forward, backward "
                     "compute, backward comm, overlap; bucket sizes (bytes)")
        for r in profiled:
            p = r["profile_ms"]
            lines.append(f"# {r['mode']:<20} " + " ".join(f"{k}={v:.2f}" for k, v in p.items())
                         + f" buckets={r['bucket_sizes']}")
    return "\n".join(lines)


# --- --layers: one bucket's all-reduce through each layer ----------------------------------
def layer_times(args: argparse.Namespace, comm: Any) -> list[dict]:
    """Median time of one all-reduce of the model's gradient bucket (``--layers-bytes``, by
    default all 412k float32 parameters: DDP's one bucket) through each layer, interleaved
    over ``--repeats`` rounds of ``--steps`` calls: MPI's ``Allreduce`` on numpy,
    ``mpicoll.allreduce`` on numpy (``algorithm="auto"``, unchecked), the compressed
    all-reduce of the int8 and bf16 hooks (without error feedback), ``dist.all_reduce`` on
    the "mpicoll" groups (every call agreed on / first only: the call, its agreement and
    the hand-over to the group's thread) and on gloo, and ``async_op=True`` then ``wait``."""
    import mpicoll  # noqa: PLC0415
    from mpicoll import compression  # noqa: PLC0415

    count = args.layers_bytes // 4 if args.layers_bytes else \
        sum(p.numel() for p in make_model(args.model).parameters())
    gen = torch.Generator().manual_seed(comm.rank)
    start_values = torch.randn(count, generator=gen)
    buffers: list[torch.Tensor] = []

    def fresh() -> torch.Tensor:
        """Each layer its own buffer, refilled before each round (sums grow n-fold per
        call: at n = 4, 4^(steps + 1) stays finite in float32 up to 62 steps a round)."""
        buffers.append(start_values.clone())
        return buffers[-1]

    def on_numpy(fn: Callable[[Any], Any]) -> Callable[[], Any]:
        a = fresh().numpy()
        return lambda: fn(a)

    def on_tensor(fn: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        t = fresh()
        return lambda: fn(t)

    def codec(name: str) -> Callable[[], Any]:
        return on_numpy(lambda a: compression.allreduce(
            a, a, op="average", comm=comm, compression=name, feedback=False, check=False))

    layers: dict[str, Callable[[], Any]] = {
        "MPI Allreduce (numpy)": on_numpy(lambda a: comm.Allreduce(MPI.IN_PLACE, a,
                                                                   op=MPI.SUM)),
        "mpicoll.allreduce (numpy)": on_numpy(lambda a: mpicoll.allreduce(
            mpicoll.IN_PLACE, a, comm=comm, check=False)),
        "compression.allreduce int8": codec("int8"),
        "compression.allreduce bf16": codec("bf16"),
        **{f"dist.all_reduce {g}": on_tensor(lambda t, g=g: dist.all_reduce(t, group=_groups[g]))
           for g in ("mpicoll", *GROUP_OPTIONS, "gloo")},
        **{f"async {g} + wait": on_tensor(lambda t, g=g: dist.all_reduce(
            t, group=_groups[g], async_op=True).wait()) for g in ("mpicoll", "gloo")},
    }
    def refill() -> None:
        for buf in buffers:
            buf.copy_(start_values)

    times = interleaved_times(layers, args.steps, args.repeats, comm, refill)
    return [{"layer": k, "bytes": 4 * count, "median_ms": 1e3 * statistics.median(v),
             "runs_ms": [1e3 * x for x in v]} for k, v in times.items()]


# --- --accuracy: examples/train.py's model under each hook --------------------------------
def register_hook(model: Any, hook: str, args: argparse.Namespace) -> Any:
    """Register ``hook`` on the DDP ``model``; return its state (``None`` for ``none``)."""
    if hook == "none":
        return None
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import (  # noqa: PLC0415
            powerSGD_hook as powersgd)

        state = powersgd.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=args.powersgd_start)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return state
    import mpicoll.torch.hooks as hooks  # noqa: PLC0415

    state = hooks.CompressionState()
    model.register_comm_hook(state, hooks.codec_hook(hook))
    return state


def train_digits(hook: str, seed: int, args: argparse.Namespace, comm: Any) -> dict:
    """examples/train.py's run (model, data, sharding, optimizer) under DDP with ``hook``;
    the final test accuracy (the same on every rank: the models are equal)."""
    import math  # noqa: PLC0415
    import time  # noqa: PLC0415

    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    from examples.train import DigitsCNN, load_data  # noqa: PLC0415

    xtr, ytr, xte, yte, _ = load_data("digits")
    torch.manual_seed(seed)
    model = DDP(DigitsCNN(), process_group=_groups["mpicoll"])
    register_hook(model, hook, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n, rank, per_rank = comm.size, comm.rank, 64 // comm.size
    started = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(seed + epoch))
        total = math.ceil(len(ytr) / n) * n
        mine = torch.cat([perm, perm[:total - len(ytr)]])[rank::n]
        for i in range(0, len(mine), per_rank):
            idx = mine[i:i + per_rank]
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    seconds = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        accuracy = float((model(xte).argmax(1) == yte).float().mean())
    return {"hook": hook, "seed": seed, "accuracy": accuracy, "seconds": seconds}


def accuracy_table(runs: list[dict], meta: dict) -> str:
    hooks_ = list(dict.fromkeys(r["hook"] for r in runs))
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    acc = {(r["hook"], r["seed"]): 100 * r["accuracy"] for r in runs}
    lines = [f"# examples/train.py's DigitsCNN under DDP on 'mpicoll', {meta['ranks']} ranks, "
             f"{meta['epochs']} epochs, global batch 64; final test accuracy (%)",
             f"{'# hook':<12}" + "".join(f"{'seed ' + str(s):>10}" for s in seeds)
             + f"{'mean':>9}{'vs none':>9}"]
    base = statistics.mean(acc["none", s] for s in seeds) if "none" in hooks_ else None
    for h in hooks_:
        mean = statistics.mean(acc[h, s] for s in seeds)
        diff = f"{mean - base:+9.2f}" if base is not None else f"{'-':>9}"
        lines.append(f"{h:<12}" + "".join(f"{acc[h, s]:>10.2f}" for s in seeds)
                     + f"{mean:>9.2f}{diff}")
    return "\n".join(lines)


def run_accuracy(args: argparse.Namespace, comm: Any) -> None:
    hooks_ = [h for h in args.hooks.split(",") if h]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    started = setup_groups()
    runs = [train_digits(h, s, args, comm) for s in seeds for h in hooks_]
    teardown(started, [])
    if comm.rank == 0:
        meta = {**common.run_meta(MPI, comm.size, "ddp", args.argv), "ranks": comm.size,
                "epochs": args.epochs}
        write_or_print(args, {"meta": meta, "runs": runs}, accuracy_table(runs, meta))


def write_or_print(args: argparse.Namespace, data_: dict, table: str) -> None:
    """Rank 0's output: ``data_`` as JSON (to ``--output`` or stdout), or ``table``."""
    if args.format != "json":
        print(table)
        return
    text = json.dumps(data_, indent=1)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args(parser(), argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    if args.accuracy:
        run_accuracy(args, comm)
        return 0
    if args.layers:
        started = setup_groups()
        rows = layer_times(args, comm)
        teardown(started, [])
        if comm.rank == 0:
            meta = {**common.run_meta(MPI, comm.size, "ddp", args.argv), "ranks": comm.size}
            write_or_print(args, {"meta": meta, "layers": rows},
                           "\n".join([f"# one all-reduce of {rows[0]['bytes']} bytes, "
                                       f"{comm.size} ranks, median ms over {args.repeats} "
                                       f"rounds of {args.steps} calls"] +
                                      [f"{r['layer']:<32}{r['median_ms']:>9.3f}"
                                       for r in rows]))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    runners = {m: runner(m) for m in modes}
    started = setup_groups()
    timings: dict[str, list[Timing]] = {m: [] for m in modes}
    profiles: dict[str, list[dict]] = {m: [] for m in modes}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for mode in modes:
            timing, profile = runners[mode](args, comm)
            timings[mode].append(timing)
            profiles[mode].append(profile)
    load.append(os.getloadavg()[0])
    teardown(started, modes)
    rows = [summarize(m, timings[m], profiles[m], comm.size, args.batch) for m in modes]
    if comm.rank == 0:
        meta = {**common.run_meta(MPI, comm.size, "ddp", args.argv), "ranks": comm.size,
                "batch": args.batch, "steps": args.steps, "repeats": args.repeats,
                "torch_threads": torch.get_num_threads(), "model": args.model,
                "params": sum(p.numel() for p in make_model(args.model).parameters()), "load": load}
        write_or_print(args, {"meta": meta, "rows": rows}, format_table(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
