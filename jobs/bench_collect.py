"""Merge the JSON results of a benchmark sweep into one table and one plot per collective.

Usage: ``python jobs/bench_collect.py RESULTS_DIR [--plots/--no-plots]`` (run by
jobs/bench_collect.sbatch). Reads every ``*.json`` that ``python -m bench <collective>
--format json`` wrote into RESULTS_DIR and writes there:

- ``summary.csv``: every row of every run (collective, world size, algorithm, size, times,
  bandwidths, validated), one line each: the machine-readable table;
- ``summary.md``: per collective and world size, the time table of ``bench.report``;
- ``<collective>-busbw.png``: bus bandwidth vs message size, one line per algorithm and
  world size.

Exits 1 if there is no result, or any result row failed validation.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import load_results, markdown_table, plot_busbw  # noqa: E402

COLUMNS = ("collective", "world_size", "ranks_per_node", "algorithm", "size", "avg_us",
           "min_us", "max_us", "algbw", "busbw", "ratio", "validated")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="directory holding the sweep's *.json")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    args = parser.parse_args()
    files = sorted(p for p in args.results.glob("*.json"))
    if not files:
        print(f"no *.json in {args.results}", file=sys.stderr)
        return 1
    runs: dict[str, list[tuple[dict, list[dict]]]] = {}
    for path in files:
        meta, rows = load_results(str(path))
        runs.setdefault(meta["test"], []).append((meta, rows))
    bad = 0
    md = ["# Benchmark sweep", "",
          f"{len(files)} run(s) from `{args.results}`; times in microseconds per call, "
          "ratios to the direct MPI call.", ""]
    with open(args.results / "summary.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for collective in sorted(runs):
            collective_runs = sorted(runs[collective], key=lambda mr: mr[0]["world_size"])
            md += [f"## {collective}", ""]
            if args.plots:
                png = f"{collective}-busbw.png"
                sizes = ",".join(str(m["world_size"]) for m, _ in collective_runs)
                plot_busbw(collective_runs, str(args.results / png),
                           title=f"{collective}: bus bandwidth, n = {sizes}")
                md += [f"![{collective}]({png})", ""]
            for meta, rows in collective_runs:
                md += [f"### {meta['world_size']} ranks ({meta.get('ranks_per_node', '?')} per "
                       f"node), {meta.get('mpi_library', '')}, thread level "
                       f"{meta.get('thread_level', '?')}", "",
                       markdown_table(meta, rows)]
                for r in rows:
                    writer.writerow([collective, meta["world_size"], meta.get("ranks_per_node"),
                                     *(r.get(c) for c in COLUMNS[3:])])
                    if r.get("validated") is False:
                        bad += 1
    (args.results / "summary.md").write_text("\n".join(md), encoding="utf-8")
    print(f"collected {len(files)} run(s): {', '.join(sorted(runs))}; "
          f"{'all validated rows correct' if not bad else f'{bad} row(s) FAILED validation'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
