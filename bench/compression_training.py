"""Training with gradient compression: ``examples/train.py`` per compressor, loss against
wall time.

For each seed (outer loop) and each ``--compressions`` entry (inner loop, so the
compressors interleave and share the machine's load), one ``mpirun -n RANKS`` run of
``examples/train.py --compression C --seed S --json FILE`` with the same epochs and batch
(an entry ``C-noef`` adds ``--no-error-feedback``, ``C-mom``/``C-nomom``
``--compress-momentum yes``/``no``, ``C-warmN``/``C-warmNep`` ``--compress-warmup N``/``Nep``:
the first N steps or epochs uncompressed; ``C-cosine``/``C-step`` ``--lr-schedule
cosine``/``step``; ``C-flush`` ``--flush-residuals``; ``C-nofusion`` runs with ``MPICOLL_FUSION_THRESHOLD=0``, one reduction
per parameter, so no codec chunk holds two parameters; suffixes combine, e.g.
``onebit:two-cosine``; onebit compresses the local momentum by default);
then a summary per compressor (final test accuracy per seed and its difference from
``none`` under the same learning-rate schedule (``none-cosine`` for ``-cosine`` entries),
bytes rank 0 sent per step, samples per second = total samples / total time of
the training steps over every seed), written to ``--out/compression_training.json``, and
the mean training loss of each epoch against the training wall time and against epochs
(first seed) plotted to ``--out/compression_training.png`` (``--name`` changes the file
names, ``--no-plot`` skips the plot). From the repository root::

    python -m bench.compression_training --ranks 2 --seeds 1,2,3 --out docs/results
    python -m bench.compression_training --ranks 2 --seeds 1,2,3,4,5,6 \
        --compressions none,onebit,onebit-warm1ep --out docs/results --name compression_warmup
    python -m bench.compression_training --replot docs/results/compression_training.json
    python -m bench.compression_training --merge a.json,b.json --out docs/results --name c
    python -m bench.compression_training --step-times 200 --ranks 2
    python -m bench.compression_training --simulate ring --compressions onebit --seeds 1

``--simulate MODE`` replays the training in one process, ``--ranks`` workers, with the
compressed reduction written out in numpy (see :func:`simulate`): it separates what the
algorithm does from what the implementation does (the ``ring`` mode reproduces
``mpirun -n 2 examples/train.py --compression onebit --compress-momentum no`` epoch by
epoch).

``--step-times ITERS`` instead times ``optimizer.step()`` (the gradient reduction) of
``examples/train.py``'s model, one model and ``DistributedOptimizer`` per compressor,
the compressors taking turns step by step in one ``mpirun`` (so they share the machine's
load): median and mean milliseconds per step (rank 0) and the ratio to ``none``.

``--merge A.json,B.json`` writes the records of several earlier runs as one JSON (their
``command`` lines kept in ``commands``) and prints the summary of them all.

Paths written into the JSON are relative to the repository.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from bench.bench_ps import launch_json
from bench.common import command_line, machine_description

DEFAULT_COMPRESSIONS = "none,fp16,int8,onebit,topk:0.01"

#: Suffix of a ``--compressions`` entry that turns error feedback off (``onebit-noef``).
NO_FEEDBACK = "-noef"


#: Suffixes forcing ``examples/train.py --compress-momentum yes`` / ``no`` (default: auto,
#: which compresses the local momentum for onebit only).
MOMENTUM, NO_MOMENTUM = "-mom", "-nomom"


#: Suffix of a ``--compressions`` entry with an uncompressed warm-up: ``-warm46`` (optimizer
#: steps) or ``-warm2ep`` (epochs).
WARMUP = re.compile(r"-warm(\d+(?:ep)?)$")


#: Suffixes choosing ``examples/train.py --lr-schedule`` (default ``constant``).
LR_SCHEDULES = {"-cosine": "cosine", "-step": "step"}


#: Suffix of an entry that ends with the residuals applied (``--flush-residuals``).
FLUSH = "-flush"


#: Suffix running with one reduction per parameter (no fusion): its environment.
NO_FUSION, NO_FUSION_ENV = "-nofusion", {"MPICOLL_FUSION_THRESHOLD": "0"}


def label(rec: dict) -> str:
    """A run's compressor, with ``-noef`` when it ran without error feedback, ``-mom``
    when it compressed the ranks' local momentum instead of their gradients and ``-warmN``
    when its first N optimizer steps ran uncompressed."""
    return (rec["compression"] + ("" if rec.get("error_feedback", True) else NO_FEEDBACK)
            + (MOMENTUM if rec.get("compress_momentum") else "")
            + (f"-warm{rec['compress_warmup']}" if rec.get("compress_warmup") else "")
            + (FLUSH if rec.get("flush_residuals") else "") + protocol(rec))


def protocol(rec: dict) -> str:
    """The suffix of a run's training protocol (``-cosine``...; empty for the default),
    shared by the ``none`` run it is compared with; then ``-nofusion`` if it ran so."""
    schedule = rec.get("lr_schedule", "constant")
    suffix = next((k for k, v in LR_SCHEDULES.items() if v == schedule), "")
    return suffix + (NO_FUSION if rec.get("env") == NO_FUSION_ENV else "")


def baseline(rec: dict) -> str:
    """The label of the ``none`` run a run is compared with: same learning-rate schedule."""
    return "none" + protocol(dict(rec, env=None))


def parse_entry(comp: str) -> tuple[str, list[str], dict[str, str]]:
    """``(codec spec, extra examples/train.py arguments, extra environment)`` of a
    ``--compressions`` entry (suffixes in any order).

    Raises:
        ValueError: a suffix given twice.
    """
    extra: list[str] = []
    env: dict[str, str] = {}
    suffixes = [(NO_MOMENTUM, ["--compress-momentum", "no"]),
                (MOMENTUM, ["--compress-momentum", "yes"]),
                (NO_FEEDBACK, ["--no-error-feedback"]),
                (FLUSH, ["--flush-residuals"])] + \
        [(k, ["--lr-schedule", v]) for k, v in LR_SCHEDULES.items()]
    entry, found = comp, True
    while found:
        found = False
        warm = WARMUP.search(comp)
        if warm:
            comp, found = comp[:warm.start()], True
            extra += ["--compress-warmup", warm.group(1)]
        if comp.endswith(NO_FUSION):
            comp, found = comp[:-len(NO_FUSION)], True
            env.update(NO_FUSION_ENV)
        for suffix, args in suffixes:
            if comp.endswith(suffix):
                comp, found = comp[:-len(suffix)], True
                extra += args
    options = [a for a in extra if a.startswith("--")]
    if len(options) != len(set(options)):
        raise ValueError(f"--compressions entry {entry!r}: an option given twice")
    return comp, extra, env


def run(ranks: int, compressions: list[str], seeds: list[int], epochs: int,
        timeout: float) -> list[dict]:
    """Every (seed, compression) run's record (``None`` entries for failed runs dropped)."""
    records = []
    for seed in seeds:
        for comp in compressions:
            spec, extra, env = parse_entry(comp)
            args = ["examples/train.py", "--compression", spec, "--seed", str(seed),
                    "--epochs", str(epochs), "--min-accuracy", "0"] + extra
            rec = launch_json(ranks, args, f"{comp} seed {seed}", timeout, env or None)
            if rec is not None:
                if env:
                    rec["env"] = env
                records.append(rec)
                print(f"# {label(rec)} seed {seed}: accuracy {rec['final_accuracy']:.4f}, "
                      f"{rec['samples_per_second']:.0f} samples/s, "
                      f"{rec['bytes_per_step']} B/step", flush=True)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per compressor, in first-seen order."""
    rows: dict[str, dict] = {}
    for rec in records:
        row = rows.setdefault(label(rec), {"compression": label(rec),
                                           "baseline": baseline(rec),
                                           "accuracy": {}, "samples": 0, "seconds": 0.0})
        row["accuracy"][rec["seed"]] = rec["final_accuracy"]
        row["samples"] += rec["samples"]
        row["seconds"] += rec["train_seconds"]
        row["bytes_per_step"] = rec["bytes_per_step"]
        row["dense_bytes_per_step"] = rec["dense_bytes_per_step"]
    for row in rows.values():
        base = rows.get(row["baseline"], {}).get("accuracy", {})
        accs = row["accuracy"]
        row["mean_accuracy"] = sum(accs.values()) / len(accs)
        row["pp_vs_none"] = {s: round(100 * (a - base[s]), 2) for s, a in accs.items()
                             if s in base}
        row["samples_per_second"] = row["samples"] / max(row["seconds"], 1e-9)
    return list(rows.values())


def table(rows: list[dict]) -> str:
    """A markdown table of the summary: accuracy per seed (points vs its ``none``: the
    same learning-rate schedule), the mean over seeds and its difference from that
    ``none``'s mean over the same seeds."""
    seeds = sorted({s for row in rows for s in row["accuracy"]})
    accuracy = {row["compression"]: row["accuracy"] for row in rows}
    head = ("| compression | " + " | ".join(f"accuracy seed {s} (pp vs none)" for s in seeds)
            + " | mean | mean vs none (pp) | bytes/step (rank 0) | x fewer | samples/s |")
    lines = [head, "|---|" + "---:|" * (len(seeds) + 5)]
    for row in rows:
        base = accuracy.get(row.get("baseline", "none"), {})
        cells = [f"{100 * row['accuracy'][s]:.2f}% ({row['pp_vs_none'].get(s, 0):+.2f})"
                 if s in row["accuracy"] else "-" for s in seeds]
        shared = [s for s in row["accuracy"] if s in base]
        versus = (f"{100 * sum(row['accuracy'][s] - base[s] for s in shared) / len(shared):+.2f}"
                  if shared else "-")
        ratio = row["dense_bytes_per_step"] / max(row["bytes_per_step"], 1)
        lines.append(f"| {row['compression']} | " + " | ".join(cells) +
                     f" | {100 * row['mean_accuracy']:.2f}% | {versus} | "
                     f"{row['bytes_per_step']} | {ratio:.1f} | "
                     f"{row['samples_per_second']:.0f} |")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """The records of several earlier JSONs as one result: ``commands`` (every file's
    command lines, in order), ``machine`` (the first's), ``records`` (a run repeated in
    a later file, the same label and seed, is kept once: runs are deterministic) and
    their ``summary``.

    Raises:
        SystemExit: the files mix world sizes or epoch counts.
    """
    commands, records, seen, machine = [], [], set(), None
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        commands += result.get("commands") or [result["command"]]
        machine = machine or result.get("machine")
        for rec in result["records"]:
            if (label(rec), rec["seed"]) not in seen:
                seen.add((label(rec), rec["seed"]))
                records.append(rec)
    if len({(r["ranks"], r["epochs"]) for r in records}) > 1:
        raise SystemExit("--merge: the files mix world sizes or epoch counts")
    return {"commands": commands, "machine": machine, "records": records,
            "summary": summarize(records)}


def plot(records: list[dict], path: str) -> str | None:
    """Mean training loss per epoch against training wall time and against epochs (first
    seed), one line per compressor."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib missing: no plot", file=sys.stderr)
        return None
    if not records:
        return None
    seed = records[0]["seed"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for rec in records:
        if rec["seed"] != seed:
            continue
        log = rec["log"]
        ax.plot([r[0] for r in log], [r[2] for r in log], marker=".", label=label(rec))
        ax2.plot([r[1] for r in log], [r[2] for r in log], marker=".", label=label(rec))
    ax.set_xlabel("training wall time, rank 0 (s; steps only; shared, noisy machine)")
    ax.set_ylabel("mean training loss of the epoch")
    ax.set_yscale("log")
    ax.set_title(f"examples/train.py, {records[0]['ranks']} ranks, seed {seed}")
    ax2.set_xlabel("epoch")
    ax2.set_title("the same runs against epochs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def step_times_rank(argv: list[str]) -> int:
    """Rank program of ``--step-times`` (run under mpirun): ``ITERS COMPRESSIONS --json F``."""
    import time

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    import train  # noqa: PLC0415  (the example's model and compressor names)

    iters, comps, out = int(argv[0]), argv[1].split(","), argv[3]
    torch.set_num_threads(1)
    hvd = train.hvd
    hvd.init()
    x = torch.rand(32, 1, 8, 8)
    y = torch.randint(0, 10, (32,))
    runs = []
    for comp in comps:
        torch.manual_seed(0)
        model = train.DigitsCNN()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       compression=train.compressor(comp))
        runs.append((comp, model, opt, []))
    for it in range(iters + 5):                    # the first 5 are warm-up
        for comp, model, opt, times in runs:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            t0 = time.perf_counter()
            opt.step()
            if it >= 5:
                times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        rows = []
        for comp, _, _, times in runs:
            times.sort()
            rows.append({"compression": comp, "median_ms": 1e3 * times[len(times) // 2],
                         "mean_ms": 1e3 * sum(times) / len(times)})
        with open(out, "w") as f:
            json.dump({"ranks": hvd.size(), "iters": iters, "rows": rows}, f)
    hvd.shutdown()
    return 0


def step_times(ranks: int, iters: int, compressions: str, timeout: float) -> dict | None:
    """Interleaved ``optimizer.step()`` times per compressor (see the module's docstring)."""
    res = launch_json(ranks, [os.path.abspath(__file__), "--rank-steps", str(iters),
                              compressions], "step times", timeout)
    if res is not None:
        base = res["rows"][0]["median_ms"]
        print(f"# optimizer.step() at n={ranks}, {iters} interleaved steps (rank 0)")
        print("| compression | median ms | mean ms | median vs " + res["rows"][0]["compression"]
              + " |\n|---|---:|---:|---:|")
        for row in res["rows"]:
            print(f"| {row['compression']} | {row['median_ms']:.3f} | {row['mean_ms']:.3f} | "
                  f"{row['median_ms'] / base:.2f}x |")
    return res


# ---------------------------------------------------------------------------------------
# one-process simulation (what the compression does, without MPI or mpicoll.torch)

class _TwoLevelSign:
    """Seide et al.'s 1-bit quantizer (for ``--simulate`` only): the sign per element and
    two values per chunk, the mean of the non-negative and of the negative elements."""

    def __init__(self, chunk: int = 256) -> None:
        self.chunk = chunk

    def roundtrip(self, x):
        import numpy as np
        n, c = x.size, self.chunk
        xp = np.concatenate([x, np.zeros(-n % c, x.dtype)]).reshape(-1, c)
        neg = np.signbit(xp)
        pad = np.zeros(xp.shape, bool)
        pad.reshape(-1)[n:] = True
        pos = ~neg & ~pad
        mp = np.where(pos, xp, 0).sum(1) / np.maximum(pos.sum(1), 1)
        mn = np.where(neg, xp, 0).sum(1) / np.maximum(neg.sum(1), 1)
        return np.where(neg, mn[:, None], mp[:, None]).astype(x.dtype).reshape(-1)[:n]


def simulate(mode: str, spec: str, ranks: int, seed: int, epochs: int, lr: float,
             momentum: float, local_momentum: bool, probes: list[str] = ()) -> list[tuple]:
    """``examples/train.py``'s training with ``ranks`` workers in one process, reducing the
    gradients (or, with ``local_momentum``, each worker's momentum ``m = momentum m + g``,
    the optimizer then getting ``M - momentum M_prev``) by ``mode``:

    - ``exact``: the average;
    - ``ring``: the compressed all-reduce's dense ring replayed (each block encoded by its
      first rank, then decoded, added and re-encoded by the next ones; every encoding's
      loss kept as that rank's residual): the same arithmetic as
      ``mpicoll.compression.allreduce``;
    - ``direct``: every worker encodes its input plus residual once, the decoded payloads
      are summed exactly (one level of error feedback, as with an uncompressed server);
    - ``noef``: the ring without error feedback.

    Returns one ``(epoch, mean loss, test accuracy, |reduced gradient|, [|residual| per
    worker])`` per epoch. ``spec``: a codec name, or ``seide[:C]`` (two values per chunk).

    ``probes`` (codec names, ``NAME@param`` for chunks that restart at every parameter):
    every vector the run encodes is also encoded with each probe, which changes nothing in
    the run; each epoch prints the relative squared error ``sum |v - Q(v)|^2 / sum |v|^2``
    over the epoch's encodings for the run's codec and each probe.
    """
    import math

    import numpy as np
    import torch
    import torch.nn.functional as F

    from mpicoll.compression import get_codec

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    import train

    torch.set_num_threads(1)
    xtr, ytr, xte, yte, _ = train.load_data("digits")
    torch.manual_seed(seed)
    model = train.DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    params = list(model.parameters())[::-1]      # DistributedOptimizer's buffer order
    count = sum(q.numel() for q in params)
    codec = _TwoLevelSign(int(spec.split(":")[1]) if ":" in spec else 256) \
        if spec.startswith("seide") else get_codec(spec)
    sizes = np.cumsum([0] + [q.numel() for q in params])
    errors = {name: [0.0, 0.0] for name in [spec, *probes]}

    def pieces(lo, n, per_param):
        """Bounds of the parts of ``v[lo:lo + n]`` encoded on their own."""
        cuts = [c - lo for c in sizes if per_param and lo < c < lo + n]
        return list(zip([0] + cuts, cuts + [n]))

    def rt(v, lo=0):
        dec = codec.roundtrip(v)
        for name in errors:
            base, _, where = name.partition("@")
            out = dec if name == spec else np.concatenate(
                [get_codec(base).roundtrip(v[a:b]) for a, b in pieces(lo, v.size, where)])
            errors[name][0] += float(np.sum((v - out).astype(np.float64) ** 2))
            errors[name][1] += float(np.sum(v.astype(np.float64) ** 2))
        return dec

    res = [np.zeros(count, np.float32) for _ in range(ranks)]
    local = [np.zeros(count, np.float32) for _ in range(ranks)]
    prev = np.zeros(count, np.float32)
    bb = np.concatenate([[0], np.cumsum([len(a) for a in
                                         np.array_split(np.empty(count), ranks)])])

    def ring(ins, feedback):
        y = [x + r for x, r in zip(ins, feedback)]
        new = [np.zeros(count, np.float32) for _ in range(ranks)]
        out = np.zeros(count, np.float32)
        for b in range(ranks):
            lo, hi = bb[b], bb[b + 1]
            dec = None
            for step in range(ranks):
                q = (b + step) % ranks
                acc = y[q][lo:hi].copy() if dec is None else dec + y[q][lo:hi]
                dec = rt(acc, lo)
                new[q][lo:hi] = acc - dec
            out[lo:hi] = dec
        return out, new

    per = max(1, 64 // ranks)
    log = []
    for epoch in range(epochs):
        perm = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(seed + epoch))
        total = math.ceil(len(ytr) / ranks) * ranks
        perm = torch.cat([perm, perm[:total - len(ytr)]])
        shards = [perm[r::ranks] for r in range(ranks)]
        losses = []
        for i in range(0, len(shards[0]), per):
            grads = []
            for r in range(ranks):
                idx = shards[r][i:i + per]
                model.zero_grad()
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                losses.append(float(loss.detach()))
                grads.append(torch.cat([q.grad.reshape(-1) for q in params]).numpy().copy())
            if local_momentum:
                for r in range(ranks):
                    local[r] = local[r] * momentum + grads[r]
                grads = [m.copy() for m in local]
            if mode == "exact":
                out = sum(grads)
            elif mode == "ring":
                out, res = ring(grads, res)
            elif mode == "noef":
                out, _ = ring(grads, [np.zeros(count, np.float32)] * ranks)
            elif mode == "direct":
                y = [g + r for g, r in zip(grads, res)]
                dec = [rt(v) for v in y]
                out, res = sum(dec), [v - d for v, d in zip(y, dec)]
            else:
                raise ValueError(f"unknown mode {mode!r}")
            out = out / ranks
            if local_momentum:
                out, prev = out - prev * momentum, out
            o = 0
            for q in params:
                q.grad = torch.from_numpy(out[o:o + q.numel()].reshape(q.shape).copy())
                o += q.numel()
            opt.step()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        row = (epoch + 1, float(np.mean(losses)), acc,
               float(np.linalg.norm(sum(grads) / ranks)),
               [float(np.linalg.norm(r)) for r in res])
        log.append(row)
        print(f"# {mode} {spec}{' local momentum' if local_momentum else ''} seed {seed} "
              f"epoch {row[0]:2d}: loss {row[1]:.4f}, accuracy {row[2]:.4f}, |g| {row[3]:.3f}"
              f", |residual| " + " ".join(f"{v:.3f}" for v in row[4]), flush=True)
        if probes:
            print("#   relative squared error of the epoch's encodings: " + ", ".join(
                f"{name} {num / max(den, 1e-30):.4f}" for name, (num, den) in errors.items()),
                flush=True)
            errors = {name: [0.0, 0.0] for name in errors}
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--compressions", default=DEFAULT_COMPRESSIONS)
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", default="docs/results", help="folder for the JSON and the PNG")
    parser.add_argument("--name", default="compression_training",
                        help="file name (without extension) of the JSON and the PNG")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--replot", default=None, help="plot an earlier JSON instead")
    parser.add_argument("--merge", default=None, metavar="A.json,B.json",
                        help="write the records of earlier runs as one JSON (--out, --name)")
    parser.add_argument("--step-times", type=int, default=0, metavar="ITERS",
                        help="time optimizer.step() per compressor instead (interleaved)")
    parser.add_argument("--simulate", default=None, metavar="MODE",
                        choices=("exact", "ring", "direct", "noef"),
                        help="one-process simulation instead (see simulate()): "
                             "--compressions takes one codec (or seide[:C]), --seeds the seeds")
    parser.add_argument("--local-momentum", action="store_true",
                        help="--simulate: reduce each worker's momentum (momentum 0.9)")
    parser.add_argument("--probes", default="",
                        help="--simulate: codecs (NAME@param: chunks restart at each "
                             "parameter) also applied to every encoded vector, errors printed")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-steps"]:
        return step_times_rank(argv[1:])
    a = parser.parse_args(argv)
    if a.simulate:
        for seed in [int(x) for x in a.seeds.split(",")]:
            simulate(a.simulate, a.compressions, a.ranks, seed, a.epochs, 0.05, 0.9,
                     a.local_momentum, [p for p in a.probes.split(",") if p])
        return 0
    if a.step_times:
        return 0 if step_times(a.ranks, a.step_times, a.compressions, a.timeout) else 1
    if a.replot:
        with open(a.replot) as f:
            result = json.load(f)
        out = os.path.dirname(a.replot)
    elif a.merge:
        result, out = merge(a.merge.split(",")), a.out
        with open(os.path.join(out, f"{a.name}.json"), "w") as f:
            json.dump(result, f, indent=1)
    else:
        records = run(a.ranks, a.compressions.split(","), [int(s) for s in a.seeds.split(",")],
                      a.epochs, a.timeout)
        result = {"command": command_line(None, "compression_training", argv),
                  "machine": machine_description(), "records": records,
                  "summary": summarize(records)}
        out = a.out
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{a.name}.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(table(result["summary"]))
    path = None if a.no_plot else plot(result["records"], os.path.join(out, f"{a.name}.png"))
    if path:
        print(f"# wrote {path}")
    return 0 if result["records"] else 1


if __name__ == "__main__":
    sys.exit(main())
