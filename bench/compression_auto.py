"""``compression="auto"`` judged: its model's predictions against measured times.

::

    mpirun -n 2 python -m bench.compression_auto [-m 64K:64M] [-i 7] [-x 1] \\
        [--candidates none,bf16,int8,topk:0.01] [--output results.json]

For each size (powers of four from ``-m``), ``mpicoll.compression.allreduce`` with each
fixed candidate codec and with ``compression="auto"`` (error feedback on, an
``ErrorFeedback`` per option, as in training), interleaved: each of the ``-i`` rounds
(``--iterations-small``, default three times as many, up to 1 MiB) runs
every option once, in a random order (the same on every rank); each call's time is the
slowest rank's (a barrier before, ``Allreduce(MAX)`` of the times after). It prints, per
size, the model's predicted time and the measured median of each option, what ``auto``
chose, the fastest fixed option, and

- ``picked fastest``: whether the chosen codec is the fastest fixed option by the medians
  (or within the noise: ``--tolerance``, default 3%, of it);
- ``auto/best``: ``auto``'s own median time over the best fixed option's median;
- ``chosen/best``: the chosen codec's median (run as a fixed option) over the best one's;
- ``auto/chosen``: the median over rounds of ``auto``'s time over the chosen codec's in
  the same round (``auto``'s own cost, and the noise that ``auto/best`` also carries).

then the summary: how often ``auto`` picked the fastest option, the worst ``auto/best``,
and the same against the best single fixed codec over the whole sweep (the sum of its
medians). ``--output`` writes everything as JSON (inputs, predictions, every round's time);
``python -m bench.compression_auto --render FILE.json ...`` prints saved results as
Markdown tables. Options: ``--help``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if not __package__:  # run as a script: find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import (human_bytes, median, parse_args, parse_size_range,  # noqa: E402
                          power_of_two_sizes, run_meta)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compression_auto",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--message-size", default="64K:64M",
                   help="MIN:MAX bytes of float32 (powers of four between)")
    p.add_argument("-i", "--iterations", type=int, default=9, help="timed rounds")
    p.add_argument("--iterations-small", type=int, default=None,
                   help="timed rounds for sizes up to 1 MiB (default: 3x --iterations; "
                        "they are cheap and noisier)")
    p.add_argument("-x", "--warmup", type=int, default=1, help="untimed rounds")
    p.add_argument("--candidates", default="none,bf16,int8,topk:0.01",
                   help="comma-separated codecs auto chooses among (and that are timed)")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="a choice within this fraction of the fastest counts as fastest")
    p.add_argument("--output", help="write the results as JSON here (rank 0)")
    return p


def _round(comm, options, x, feedbacks, out) -> dict[str, float]:
    """One call of each option, in the given order; the slowest rank's seconds."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpicoll import compression  # noqa: PLC0415

    times = []
    chosen = None
    for name, spec in options:
        comm.Barrier()
        t0 = MPI.Wtime()
        compression.allreduce(x, out, compression=spec, feedback=feedbacks[name], key="g")
        times.append(MPI.Wtime() - t0)
        if name == "auto":
            chosen = compression.last_stats()
    worst = np.empty(len(times))
    comm.Allreduce(np.array(times), worst, op=MPI.MAX)
    return {name: float(t) for (name, _), t in zip(options, worst)}, chosen


def run(args: argparse.Namespace) -> dict:
    """Measure (every rank); the results (complete on rank 0)."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpicoll import compression  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    auto = compression.Auto(candidates)
    lo, hi = parse_size_range(args.message_size)
    sizes = power_of_two_sizes(lo, hi, 4)
    rows = []
    for size in sizes:
        count = size // 4
        rng = np.random.default_rng([rank, size])
        x = rng.standard_normal(count).astype(np.float32)
        out = np.empty_like(x)
        options = [(c, c) for c in candidates] + [("auto", auto)]
        feedbacks = {name: compression.ErrorFeedback() for name, _ in options}
        samples: dict[str, list[float]] = {name: [] for name, _ in options}
        stats = None
        order_rng = np.random.default_rng(size)          # the same orders on every rank
        rounds = args.iterations if size > (1 << 20) else (
            args.iterations_small if args.iterations_small is not None else 3 * args.iterations)
        for r in range(args.warmup + rounds):
            order = [options[i] for i in order_rng.permutation(len(options))]
            times, chosen = _round(comm, order, x, feedbacks, out)
            stats = chosen
            if r >= args.warmup:
                for name, t in times.items():
                    samples[name].append(t)
        med = {name: median(v) for name, v in samples.items()}
        paired = median([a / c for a, c in zip(samples["auto"], samples[stats.codec])])
        fixed = {c: med[c] for c in candidates}
        best = min(fixed, key=fixed.get)
        choice = stats.choice
        rows.append({
            "bytes": size, "count": count, "chosen": stats.codec, "fastest": best,
            "predicted_s": dict(choice.predicted), "measured_s": med,
            "samples_s": samples, "reason": choice.reason,
            "picked_fastest": fixed[stats.codec] <= fixed[best] * (1 + args.tolerance),
            "auto_over_best": med["auto"] / fixed[best],
            "chosen_over_best": fixed[stats.codec] / fixed[best],
            "auto_over_chosen_paired": paired,
        })
        inputs = choice.inputs
    totals = {c: sum(r["measured_s"][c] for r in rows) for c in candidates}
    best_fixed = min(totals, key=totals.get)
    summary = {
        "sizes": len(rows),
        "picked_fastest": sum(r["picked_fastest"] for r in rows),
        "worst_auto_over_best": max(r["auto_over_best"] for r in rows),
        "worst_chosen_over_best": max(r["chosen_over_best"] for r in rows),
        "auto_over_chosen_paired": [round(r["auto_over_chosen_paired"], 3) for r in rows],
        "best_single_fixed": best_fixed,
        "worst_auto_over_best_single_fixed": max(
            r["measured_s"]["auto"] / r["measured_s"][best_fixed] for r in rows),
        "tolerance": args.tolerance,
    }
    meta = run_meta(MPI, n, "compression_auto", args.argv)
    return {"meta": meta, "world_size": n, "candidates": candidates, "inputs": inputs,
            "rows": rows, "summary": summary}


def report(res: dict) -> str:
    """The results as text (what rank 0 prints)."""
    cands = res["candidates"]
    inp = res["inputs"]
    lines = [f"# compression='auto' vs fixed codecs, n = {res['world_size']}",
             f"# {res['meta']['command']}",
             f"# {res['meta']['mpi_library']}; {res['meta']['thread_level']}; "
             f"{res['meta']['machine']}; {res['meta']['date']}",
             f"# link ({inp['link_source']}): latency {inp['latency_s'] * 1e6:.1f} us, "
             f"bandwidth {inp['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s; CPU share while "
             f"measuring the codecs {inp['cpu_share']:.2f} (applied to their speeds)",
             "# codec GB/s (encode/decode): " + ", ".join(
                 f"{c} {inp['encode'][c]['bytes_per_s'] / 1e9:.2f}/"
                 f"{inp['decode'][c]['bytes_per_s'] / 1e9:.2f}" for c in cands),
             "# times in ms: predicted / measured median (slowest rank)"]
    head = f"{'size':>8} " + " ".join(f"{c:>15}" for c in cands) + \
        f" {'auto':>8} {'chosen':>10} {'fastest':>10} {'auto/best':>9} {'chosen/best':>11}"
    lines.append(head)
    for r in res["rows"]:
        cells = " ".join(f"{r['predicted_s'][c] * 1e3:7.2f}/{r['measured_s'][c] * 1e3:7.2f}"
                         for c in cands)
        lines.append(f"{human_bytes(r['bytes']):>8} {cells} {r['measured_s']['auto'] * 1e3:8.2f}"
                     f" {r['chosen']:>10} {r['fastest']:>10} {r['auto_over_best']:9.3f}"
                     f" {r['chosen_over_best']:11.3f}"
                     + ("" if r["picked_fastest"] else "  (not fastest)"))
    s = res["summary"]
    lines.append(f"# picked the fastest (within {s['tolerance']:.0%}): "
                 f"{s['picked_fastest']}/{s['sizes']}; worst auto/best {s['worst_auto_over_best']:.3f}"
                 f", worst chosen/best {s['worst_chosen_over_best']:.3f}; best single fixed "
                 f"codec {s['best_single_fixed']}, worst auto/it "
                 f"{s['worst_auto_over_best_single_fixed']:.3f}")
    lines.append(f"# auto / its chosen codec, median of the rounds' ratios (auto's own cost "
                 f"and noise): {s['auto_over_chosen_paired']}")
    return "\n".join(lines) + "\n"


def markdown(res: dict) -> str:
    """The results as a Markdown table (for docs/results/compression_auto.md)."""
    cands = res["candidates"]
    inp = res["inputs"]
    s = res["summary"]
    out = [f"`{res['meta']['command']}` ({res['meta']['date']}; {res['meta']['mpi_library']}, "
           f"{res['meta']['thread_level']}). Link ({inp['link_source']}): latency "
           f"{inp['latency_s'] * 1e6:.0f} us, bandwidth {inp['bandwidth_bytes_per_s'] / 1e9:.3f}"
           f" GB/s; CPU share {inp['cpu_share']:.2f}; codec GB/s encode/decode: " + ", ".join(
               f"{c} {inp['encode'][c]['bytes_per_s'] / 1e9:.2f}/"
               f"{inp['decode'][c]['bytes_per_s'] / 1e9:.2f}" for c in cands) + ".", "",
           "| size | " + " | ".join(f"{c} pred / meas (ms)" for c in cands)
           + " | auto (ms) | chosen | fastest | chosen/best | auto/best | auto/chosen |",
           "|---|" + "---|" * (len(cands) + 6)]
    for r in res["rows"]:
        cells = " | ".join(f"{r['predicted_s'][c] * 1e3:.1f} / {r['measured_s'][c] * 1e3:.1f}"
                           for c in cands)
        out.append(f"| {human_bytes(r['bytes'])} | {cells} | {r['measured_s']['auto'] * 1e3:.1f}"
                   f" | {r['chosen']} | {r['fastest']} | {r['chosen_over_best']:.3f} | "
                   f"{r['auto_over_best']:.3f} | {r['auto_over_chosen_paired']:.3f} |")
    out += ["", f"Picked the fastest (within {s['tolerance']:.0%}): {s['picked_fastest']} of "
            f"{s['sizes']} sizes; worst chosen/best {s['worst_chosen_over_best']:.3f}, worst "
            f"auto/best {s['worst_auto_over_best']:.3f}; best single fixed codec "
            f"{s['best_single_fixed']} (auto / it at worst "
            f"{s['worst_auto_over_best_single_fixed']:.3f})."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point (every rank); ``--render FILE.json`` prints a saved result as Markdown
    (no MPI run)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--render"]:
        for path in argv[1:]:
            with open(path, encoding="utf-8") as fh:
                sys.stdout.write(markdown(json.load(fh)) + "\n")
        return 0
    args = parse_args(_parser(), argv)
    res = run(args)
    from mpi4py import MPI  # noqa: PLC0415

    if MPI.COMM_WORLD.Get_rank() == 0:
        sys.stdout.write(report(res))
        if args.output:
            with open(args.output, "w", encoding="utf-8") as fh:
                json.dump(res, fh, indent=1, default=float)
                fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
