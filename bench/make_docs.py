"""Run the documented benchmark sweep and regenerate docs/benchmarks.md (+ PNGs and JSON).

Usage (from the repository root; launches ``mpirun`` itself, each run with a timeout)::

    python -m bench.make_docs                      # n = 2, 3, 4, 8; about 10-20 minutes here
    python -m bench.make_docs --tune               # first re-tune the shipped default table
    python -m bench.make_docs --sizes 2,4 --quick  # a fast look (fewer sizes and iterations)
    python -m bench.make_docs --from-data          # only the markdown, from docs/results/bench/

Results go to ``docs/results/bench/*.json`` and ``docs/results/bench/*.png``; the markdown is
rebuilt from those files, so a sweep re-run on a quiet machine regenerates every table and plot.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a script (python bench/make_docs.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import report  # noqa: E402
from bench.collective import MODULES  # noqa: E402
from bench.common import (REPO_ROOT, KiB, MiB, command_line, human_bytes,  # noqa: E402
                          mpirun_command, parse_args, relative_paths)

ROOT = REPO_ROOT
DATA = ROOT / "docs" / "results" / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
LINK_BASE = DOC.parent   # relative links (plots, notes) start here: the page's folder
OTHER = ("reduce_scatter", "allgather", "broadcast", "reduce")


def mpirun(n: int, args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``python -m bench.<args>`` under ``mpirun -n n``; (exit status, output)."""
    cmd = [*mpirun_command(n), sys.executable, "-m", *args]
    print(f"$ {relative_paths(shlex.join(cmd))}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"TIMEOUT after {timeout:.0f} s\n{exc.stdout or ''}"
    print(f"  -> rc={rc} in {time.monotonic() - start:.0f} s", flush=True)
    if rc:
        print(out[-3000:], flush=True)
    return rc, out


def _rel(path: Path) -> str:
    """``path`` relative to the repository root when inside it (commands in the docs)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def retune(sizes: list[int], quick: bool, timeout: float) -> None:
    """Regenerate mpicoll/tuning_default.json: one tune run per world size, merged."""
    from mpicoll import tuning  # noqa: PLC0415

    path = str(tuning.default_table_path())
    tmp = path + ".new"  # bench.tune records it relative to the repository
    if os.path.exists(tmp):
        os.remove(tmp)
    for n in sizes:
        hi = ("4M" if quick else "64M") if n < 8 else ("4M" if quick else "16M")
        rc, _ = mpirun(n, ["bench.tune", "-m", f"8:{hi}", "-i", "10" if quick else "30",
                           "--iterations-large", "10", "--merge", tmp, "--output", tmp],
                       timeout)
        if rc:
            print(f"tune failed at n={n}; the default table is left as it was")
            return
    os.replace(tmp, path)
    print(f"wrote {_rel(Path(path))}")


def sweep(sizes: list[int], quick: bool, timeout: float, command: str) -> None:
    """Run every benchmark of the document; results into docs/results/bench/ (``command``, the
    make_docs command line, goes into sweep_status.json)."""
    DATA.mkdir(parents=True, exist_ok=True)
    its = ["-i", "10", "--iterations-large", "5"] if quick else ["-i", "50",
                                                                  "--iterations-large", "20"]
    top = "4M" if quick else "64M"
    step = ["--step", "4"] if quick else []
    log = {}
    if 2 in sizes:
        log["overhead"] = mpirun(2, ["bench.overhead", "--profile", "--format", "json",
                                     "--output", _rel(DATA / "overhead_n2.json")], timeout)[0]
        for t in ("latency", "bw", "bibw"):
            log[t] = mpirun(2, [f"bench.osu_{t}", "-m", "1:4M", "-c", "--format", "json",
                                "--output", _rel(DATA / f"{t}_n2.json")], timeout)[0]
    for n in sizes:
        hi = top if n < 8 else ("4M" if quick else "16M")
        log[f"allreduce_n{n}"] = mpirun(n, [
            "bench.osu_allreduce", "-m", f"8:{hi}", "-c", "-f", *its, *step, "--format", "json",
            "--output", _rel(DATA / f"allreduce_n{n}.json"),
            "--plot", _rel(DATA / f"allreduce_n{n}.png")], timeout)[0]
        # native at the other thread level, for "best native at either level"; small sizes
        # only above n = 2, where MPICH at THREAD_SINGLE is pathological on 2 cores
        single_hi = hi if n == 2 else "64K"
        log[f"allreduce_n{n}_single"] = mpirun(n, [
            "bench.osu_allreduce", "--thread-level", "single", "--algo", "native",
            "-m", f"8:{single_hi}", *(["-i", "10", "-x", "2"] if n > 2 else its), *step,
            "--memcpy-bytes", "0", "--format", "json",
            "--output", _rel(DATA / f"allreduce_n{n}_single.json")], timeout)[0]
    for n in [s for s in sizes if s in (2, 4)]:
        for coll in OTHER:
            log[f"{coll}_n{n}"] = mpirun(n, [
                f"bench.{MODULES[coll]}", "-m", "8:16M", "--step", "4", "-c", *its,
                "--memcpy-bytes", "0", "--format", "json",
                "--output", _rel(DATA / f"{coll}_n{n}.json"),
                "--plot", _rel(DATA / f"{coll}_n{n}.png")], timeout)[0]
    with open(DATA / "sweep_status.json", "w", encoding="utf-8") as fh:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "command": command, "sizes": sizes, "quick": quick, "exit_status": log},
                  fh, indent=1)


def _load(name: str):
    path = DATA / f"{name}.json"
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _index(rows: list[dict]) -> dict:
    return {(r["algorithm"], r["size"]): r for r in rows}


def _best_native(n: int) -> dict[int, float]:
    """MPI's best time (us) per size over the thread levels measured."""
    best: dict[int, float] = {}
    for name in (f"allreduce_n{n}", f"allreduce_n{n}_single"):
        d = _load(name)
        if d:
            for r in d["results"]:
                if r["algorithm"] == "mpi":
                    best[r["size"]] = min(best.get(r["size"], float("inf")), r["avg_us"])
    return best


def targets(ns: list[int]) -> list[str]:
    """Markdown lines: where each issue-6 target stands, computed from the data."""
    lines = ["| Target | n | Worst ratio (at size) | Limit | Status |", "|---|---|---|---|---|"]
    hand = lambda a: a not in ("mpi", "native", "auto")  # noqa: E731

    def worst(pairs):
        pairs = [p for p in pairs if p[0] is not None]
        return max(pairs) if pairs else None

    for n in ns:
        d = _load(f"allreduce_n{n}")
        if not d:
            continue
        idx = _index(d["results"])
        sizes = sorted({r["size"] for r in d["results"]})
        algs = sorted({r["algorithm"] for r in d["results"]})
        best_native = _best_native(n)

        def ratio(s, a, base="mpi"):
            r, b = idx.get((a, s)), idx.get((base, s))
            return r["avg_us"] / b["avg_us"] if r and b else None

        big = [s for s in sizes if MiB <= s <= 64 * MiB]
        rows = []
        w = worst([(min(ratio(s, a) for a in algs if hand(a)), s) for s in big])
        rows.append(("best hand-written all-reduce vs MPI, 1-64 MiB", w, 1.0))
        w2 = worst([(min(idx[(a, s)]["avg_us"] for a in algs if hand(a)) / best_native[s], s)
                    for s in big if s in best_native])
        rows.append(("... vs best MPI at either thread level", w2, 1.0))
        mid = [s for s in sizes if 4 * KiB <= s <= 64 * KiB]
        rows.append(("auto vs MPI, 4-64 KiB", worst([(ratio(s, "auto"), s) for s in mid]),
                     1.1 if n <= 4 else 1.3))
        small = [s for s in sizes if 8 <= s <= KiB]
        rows.append(("auto vs MPI, 8 B-1 KiB", worst([(ratio(s, "auto"), s) for s in small]),
                     1.5 if n <= 4 else 2.0))
        rows.append(("auto vs best single registered algorithm, every size", worst(
            [(idx[("auto", s)]["avg_us"] / min(idx[(a, s)]["avg_us"] for a in algs
                                                if a not in ("mpi", "auto")), s)
             for s in sizes if ("auto", s) in idx]), 1.1))
        for label, w, limit in rows:
            if w is None:
                lines.append(f"| {label} | {n} | not measured | {limit}x | - |")
            else:
                ok = "met" if w[0] <= limit else "**not met**"
                lines.append(f"| {label} | {n} | {w[0]:.2f}x ({human_bytes(w[1])}) | "
                             f"{limit}x | {ok} |")
    return lines


def _provenance(meta: dict, status: dict) -> str:
    """``Measured DATE with `COMMAND`.``: where a result came from (its JSON's meta)."""
    date = meta.get("date") or (f"date not recorded (in the sweep that ended "
                                f"{status.get('date', '?')})")
    command = meta.get("command")
    return f"Measured {date} with `{command}`." if command else f"Measured {date}."


def intro_section() -> list[str]:
    """Title, what the page is, how to regenerate it."""
    return ["# Benchmarks", "",
            "<!-- Generated by `python -m bench.make_docs`; edit bench/make_docs.py (and "
            "docs/results/bench/notes.md for the notes on the results), not this file. -->", "",
            "Results of the OSU-style benchmarks of `bench/` on one machine. Every result "
            "below says when it was measured and the exact command that measured it (run "
            "from the repository root); the reference part (how to run the benchmarks, what "
            "the columns mean) comes first and is not tied to a date.", "",
            "**Regenerate everything (tables, plots, JSON) with one command:** "
            "`python -m bench.make_docs` (about 10-20 minutes; `--sizes 2,4` for fewer world "
            "sizes; `--from-data` only rewrites this page from `docs/results/bench/*.json`).", ""]


def retune_section() -> list[str]:
    """Tell users to tune ``auto`` on their own machine."""
    return ["## Tune `auto` for your machine", "",
            "The shipped tuning table (`mpicoll/tuning_default.json`, below) was measured on "
            "the 2-core machine of these results; the best algorithm depends on the machine, "
            "the MPI library and the world size. Measure your own and point mpicoll at it:",
            "", "```sh",
            "mpirun -n N python -m bench.tune --output table.json   # once per world size N "
            "(--merge table.json to add sizes)",
            "export MPICOLL_TUNING_FILE=table.json                  # algorithm=\"auto\" now "
            "uses it", "```", ""]


def reference_section() -> list[str]:
    """How to run the benchmarks and what their output means (no dated content)."""
    return ["## Running the benchmarks", "",
            "```sh",
            "mpirun -n 2 python -m bench.osu_latency -m 0:4M -c      # also osu_bw, osu_bibw (-W window)",
            "mpirun -n 4 python -m bench.osu_allreduce -m 8:16M -c -f # every algorithm + MPI, interleaved",
            "mpirun -n 4 python -m bench allreduce --algo ring,rabenseifner --dtype float64 \\",
            "        --format csv --output ar.csv --plot ar.png --markdown ar.md",
            "mpirun -n 4 python -m bench.osu_allreduce --thread-level single   # MPI at THREAD_SINGLE",
            "mpirun -n 2 python -m bench.overhead --profile           # per-call overhead, memcpy GB/s",
            "mpirun -n 4 python -m bench.tune --output table.json     # then MPICOLL_TUNING_FILE=table.json",
            "python -m bench.tune --rebuild table.json --noise 0.1 --output table.json  # re-derive, no MPI",
            "python bench/osu_allreduce.py ...                        # scripts work too",
            "```", "",
            "Collective tests: `osu_allreduce`, `osu_reduce_scatter`, `osu_allgather`, "
            "`osu_bcast`, `osu_reduce`. Options (OSU's): `-m MIN:MAX` (K/M/G suffixes), "
            "`-i` iterations (`--iterations-large` above `--large-size`, default 20 above "
            "1 MiB), `-x` warm-up, `-f` min/avg/max over ranks, `-c` validate against an "
            "independently computed reference (exact integer-valued data); plus `--algo`, "
            "`--dtype`, `--op sum|max|min`, `--step`, `--thread-level "
            "single|funneled|serialized|multiple`, `--format osu|csv|json`, `--output`, "
            "`--plot`, `--markdown`. Every result file records its date and command.", "",
            "### What the columns mean", "",
            "- **Size**: the byte count of the whole vector (nccl-tests): for allgather all "
            "blocks together, for reduce_scatter the full input.",
            "- **Time** (us): each call alone between barriers (as OSU), every algorithm in the "
            "same loop, interleaved (the order rotated every iteration), each timed call right "
            "after an untimed call of the same algorithm (so no algorithm inherits another's "
            "cache state); per-rank median of the iterations, averaged over ranks.",
            "- **MPI**: the direct mpi4py call (`comm.Allreduce(...)`), the baseline of every "
            "ratio; **native**: the same MPI call through mpicoll (so `native / MPI` is "
            "mpicoll's per-call overhead); **auto**: what `algorithm=\"auto\"` runs, with the "
            "algorithm it chose in brackets.",
            "- **algbw** = size / time; **busbw** = algbw x 2(n-1)/n (allreduce), (n-1)/n "
            "(allgather, reduce_scatter), 1 (broadcast, reduce).",
            "- **Noise**: on a small shared machine (here 2 cores, up to 8 ranks), "
            "small-message times vary by 2-10x between runs when other jobs run; the notes "
            "with each set of results say how loaded the machine was.", ""]


def setup_section(ns: list[int], status: dict) -> list[str]:
    """The setup shared by the results: library, thread level, machine, sweep date."""
    first = next((d for d in (_load(f"allreduce_n{n}") for n in ns) if d), None)
    meta = first["meta"] if first else {}
    lines = ["## Results", "",
             "### Setup", "",
             f"- MPI library: {meta.get('mpi_library', '?')}",
             f"- Thread level: {meta.get('thread_level', '?')} (mpi4py's default) for every "
             "table unless marked; MPI at MPI_THREAD_SINGLE measured as well for the "
             "\"best MPI at either level\" column",
             f"- Machine: {meta.get('machine', '?')}; all ranks on this one node (shared "
             "memory)",
             f"- Data: {meta.get('dtype', 'float32')}, op {meta.get('op', 'sum')}, "
             f"segment size {meta.get('segment_bytes', '?')} B; results validated (`-c`) in "
             "every run",
             f"- Sweep: `{status.get('command', 'python -m bench.make_docs')}`, ended "
             f"{status.get('date', '?')}"
             + (" (quick mode: fewer sizes and iterations)" if status.get("quick") else ""),
             ""]
    failed = [k for k, rc in (status.get("exit_status") or {}).items() if rc]
    if failed:
        lines += [f"**Runs that failed in the last sweep (tables missing or stale):** "
                  f"{', '.join(failed)}", ""]
    return lines


def notes_section() -> list[str]:
    """The hand-kept, dated notes on the results (docs/results/bench/notes.md), their
    relative links rewritten from the notes' folder to the page's."""
    notes = DATA / "notes.md"
    if not notes.exists():
        return []

    def relink(m: re.Match) -> str:
        target = m.group(1)
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|#|/", target):
            return m.group(0)
        return "](" + Path(os.path.relpath(DATA / target, LINK_BASE)).as_posix() + ")"

    return [re.sub(r"\]\(([^)\s]+)\)", relink, notes.read_text(encoding="utf-8").strip()), ""]


def overhead_section(status: dict) -> list[str]:
    """Per-call overhead, memory bandwidth and the profile (overhead_n2.json)."""
    ov = _load("overhead_n2")
    if not ov:
        return []
    pc = ov["per_call_us"]
    lines = ["### Per-call overhead and memory bandwidth (n = 2)", "",
             "8-byte float32 all-reduce, back-to-back calls. " + _provenance(ov, status), "",
             "| Variant | us/call | vs MPI |", "|---|---|---|"]
    lines += [f"| {v} | {us:.2f} | {us / pc['mpi']:.2f}x |" for v, us in pc.items()]
    lines += ["", f"- **mpicoll's Python overhead per call: "
                  f"{ov['mpicoll_overhead_us']:.1f} us** (native through mpicoll minus the "
                  "direct mpi4py call).",
              f"- Memory bandwidth, one core (other ranks asleep): np.copyto of 64 MiB "
              f"{ov['memcpy_GBps']:.2f} GB/s, np.add(a, b, out=b) {ov['add_GBps']:.2f} GB/s. "
              f"An all-reduce moves 2(n-1)/n of the vector per rank in and out, so its bus "
              f"bandwidth here is bounded near the copy bandwidth (2 cores shared by all "
              f"ranks).", ""]
    if ov.get("profile"):
        lines += ["<details><summary>cProfile of one rank (1000 calls of "
                  "mpicoll.allreduce(algorithm='native'))</summary>", "", "```",
                  relative_paths(ov["profile"]).strip(), "```", "</details>", ""]
    return lines


def p2p_section(status: dict) -> list[str]:
    """Latency, bandwidth and bi-bandwidth at n = 2, one row per size."""
    runs = {t: _load(f"{t}_n2") for t in ("latency", "bw", "bibw")}
    if not any(runs.values()):
        return []
    lines = ["### Point-to-point (n = 2)", ""]
    lines += [f"- {t}: " + _provenance(d["meta"], status) for t, d in runs.items() if d]
    lines += ["", "| Size | Latency (us) | Bandwidth (MB/s) | Bi-bandwidth (MB/s) |",
              "|---|---|---|---|"]
    idx = {t: {r["size"]: r for r in d["results"]} if d else {} for t, d in runs.items()}
    for s in sorted(set().union(*[set(v) for v in idx.values()])):
        if s & (s - 1) or 1 < s < 8:
            continue
        lat, bw, bibw = (idx[t].get(s) for t in ("latency", "bw", "bibw"))
        lines.append(f"| {human_bytes(s)} | "
                     + (f"{lat['avg_us']:.2f} | " if lat else "- | ")
                     + (f"{bw['bandwidth_MBps']:.0f} | " if bw else "- | ")
                     + (f"{bibw['bandwidth_MBps']:.0f} |" if bibw else "- |"))
    return lines + [""]


def targets_section(ns: list[int]) -> list[str]:
    """Where the issue-6 targets stand, computed from the all-reduce results."""
    return ["### Where the issue-6 targets stand", "",
            "Computed from the all-reduce tables below (float32 sum, ratio = our time / MPI's "
            "time at the same thread level unless said otherwise):", "",
            *targets(ns), ""]


def allreduce_section(n: int, status: dict) -> list[str]:
    """One world size's all-reduce table, bus bandwidth, plot and THREAD_SINGLE line."""
    d = _load(f"allreduce_n{n}")
    if not d:
        return []
    m = d["meta"]
    cores = m.get("machine", "?").split(",")[1].strip() if "," in m.get("machine", "") else "?"
    lines = [f"### All-reduce, n = {n}", "",
             _provenance(m, status) + f" Thread level {m['thread_level']}, "
             f"{m['world_size']} ranks on {cores}.", "",
             "Time per call in us (ratio to MPI); last columns: best MPI time at either "
             "thread level, the best hand-written algorithm, and auto vs the best single "
             "registered algorithm.", "",
             report.markdown_table(m, d["results"], best_native=_best_native(n))]
    sizes = sorted({r["size"] for r in d["results"] if r["size"] >= 256 * KiB})
    if sizes:
        lines += ["Bus bandwidth (GB/s), large messages, next to one core's copy bandwidth:",
                  "", report.busbw_table(m, d["results"], sizes)]
    lines += _plot_link("allreduce", n)
    single = _load(f"allreduce_n{n}_single")
    if single:
        lines += [f"MPI at MPI_THREAD_SINGLE, n = {n} ("
                  + _provenance(single["meta"], status).rstrip(".") + "): "
                  + ", ".join(f"{human_bytes(r['size'])}: {r['avg_us']:.1f} us"
                              for r in single["results"] if r["algorithm"] == "mpi"), ""]
    return lines


def _plot_link(coll: str, n: int) -> list[str]:
    if not (DATA / f"{coll}_n{n}.png").exists():
        return []
    images = Path(os.path.relpath(DATA, LINK_BASE)).as_posix()   # relative to the page
    return [f"![{coll} busbw n={n}]({images}/{coll}_n{n}.png)", ""]


def collective_section(coll: str, n: int, status: dict) -> list[str]:
    """One table for a collective other than all-reduce."""
    d = _load(f"{coll}_n{n}")
    if not d:
        return []
    return [f"### {coll}, n = {n}", "", _provenance(d["meta"], status), "",
            report.markdown_table(d["meta"], d["results"]), *_plot_link(coll, n)]


def tuning_table_section() -> list[str]:
    """The shipped default table: its rules, how and when it was measured and derived."""
    from mpicoll import tuning  # noqa: PLC0415

    t = tuning.default_table()
    if t is None:
        return []
    meta = t.meta
    derivation = meta.get("derivation") or {}
    lines = ["### The default tuning table", "",
             "`mpicoll/tuning_default.json`; `auto` uses it unless `MPICOLL_TUNING_FILE` "
             "names another table (see [Tune `auto` for your machine]"
             "(#tune-auto-for-your-machine)). `python -m bench.make_docs --tune` measures it "
             "again, one `bench.tune` run per world size:", ""]
    lines += [f"- n = {r.get('world_size')}: " + _provenance(r, {})
              for r in meta.get("runs", [])]
    if derivation:
        lines += [f"- Rules derived {derivation.get('date', '?')} from those timings with "
                  f"`{derivation.get('command', '?')}`: times within "
                  f"{derivation.get('noise', 0) * 100:g}% of the fastest count as equal, "
                  "ties go to the preferred algorithm ("
                  + ", ".join(derivation.get("preference", [])) + ")"
                  + ("; each algorithm holds one range of sizes"
                     if derivation.get("single_range") else "") + "."]
    lines += ["", "| Collective | n | Rules (up to size: algorithm) |", "|---|---|---|"]
    for coll, entries in t.to_dict()["collectives"].items():
        lines += [f"| {coll} | {e['world_size']} | {report.rules_text(e['rules'])} |"
                  for e in entries]
    beyond = derivation.get("beyond_noise") or []
    if beyond:
        lines += ["", "Where these rules run an algorithm slower than the fastest measured "
                  "by more than the noise level (the price of one range per algorithm):", "",
                  "| Collective | n | Size | Runs | Slowdown | Fastest |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {b['collective']} | {b['world_size']} | {human_bytes(b['nbytes'])} | "
                  f"{b['algorithm']} | {b['slowdown']:.2f}x | {b['fastest']} |" for b in beyond]
    return lines + [""]


def render_markdown(ns: list[int]) -> str:
    """docs/benchmarks.md's text, from docs/results/bench/*.json and .../bench/notes.md."""
    status = _load("sweep_status") or {}
    sections = [intro_section(), retune_section(), reference_section(),
                setup_section(ns, status), notes_section(), overhead_section(status),
                p2p_section(status), targets_section(ns)]
    sections += [allreduce_section(n, status) for n in ns]
    sections += [collective_section(c, n, status) for c in OTHER for n in ns]
    sections.append(tuning_table_section())
    return "\n".join(line for section in sections for line in section) + "\n"


def write_markdown(ns: list[int]) -> str:
    """Rebuild docs/benchmarks.md from docs/results/bench/*.json; returns the text."""
    text = render_markdown(ns)
    DOC.write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    global DATA, DOC, LINK_BASE
    parser = argparse.ArgumentParser(prog="bench.make_docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,3,4,8", help="world sizes (default 2,3,4,8)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--from-data", action="store_true",
                        help="skip the sweep; rebuild the markdown from "
                             "docs/results/bench/*.json")
    parser.add_argument("--tune", action="store_true",
                        help="first regenerate the default tuning table (mpicoll/"
                             "tuning_default.json) at these world sizes, so auto uses it")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per mpirun")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"),
                        help="markdown to write (docs/benchmarks.md)")
    parser.add_argument("--data-dir", default=str(DATA),
                        help="JSON/PNG directory (docs/results/bench; image links are "
                             "made relative to the markdown)")
    args = parse_args(parser, argv)
    DATA, DOC = Path(args.data_dir), Path(args.doc)
    LINK_BASE = DOC.parent
    ns = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.tune and not args.from_data:
        retune(ns, args.quick, args.timeout)
    if not args.from_data:
        sweep(ns, args.quick, args.timeout, command_line(None, "make_docs", args.argv))
    write_markdown(ns)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
