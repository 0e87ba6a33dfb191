"""Measure the relaunching supervisor's recovery under MPICH: the time from a rank's
failure to the first completed step after the relaunch, and where it goes.

Usage (from the checkout's root)::

    .venv/bin/python tests/faults/launch_measure.py [--runs 5] [--np 4] [--after 4]
        [--mode disk|elastic] [--json FILE]

Each run is ``python -m mpicoll.elastic.launch`` on launch_train.py at ``--np`` ranks; one
rank SIGKILLs itself at step 3 (after the commit of step 2 is on disk); the discovery
script then answers ``--after`` slots. Phases, from the victim's time stamp just before
its SIGKILL:

- detect: until the supervisor sees the job's end (hydra notices the death, kills the
  other ranks, exits);
- discover: the supervisor's discovery and decision, until it starts the new launch;
- spawn: from that start to the first line of rank 0's script (mpiexec, hydra proxies,
  the Python interpreter);
- numpy, mpi_init, mpicoll: rank 0's imports (numpy; mpi4py, whose import runs
  MPI_Init; mpicoll and the rest of the script's imports);
- restore: loading the commit on rank 0 and broadcasting it;
- step: the first step (an all-reduce and the commit to disk).

Prints one row per run and the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PHASES = ("detect", "discover", "spawn", "numpy", "mpi_init", "mpicoll", "restore", "step")


def one_run(np_before: int, np_after: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="launch-measure-") as tmp:
        out = Path(tmp)
        discover = out / "discover.sh"
        discover.write_text(f"#!/bin/sh\nif [ -e '{out}/failed' ]; then echo "
                            f"localhost:{np_after}; else echo localhost:{np_before}; fi\n")
        discover.chmod(0o755)
        commits = out / "commits"
        argv = [sys.executable, "-m", "mpicoll.elastic.launch", "--min-np", "1",
                "--max-np", str(max(np_before, np_after)), "--host-discovery-script",
                str(discover), "--commit-dir", str(commits), "--max-restarts", "1", "--",
                sys.executable, str(HERE / "launch_train.py"), str(out), "6", "3",
                str(np_before - 2 if np_before > 1 else 0), mode]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"supervisor exited {proc.returncode}:\n{proc.stderr}")
        events = [json.loads(x) for x in (commits / "launch-events.jsonl").read_text()
                  .splitlines()]
        failed = json.loads((out / "failure.json").read_text())["time"]
        ended = next(e["time"] for e in events if e["event"] == "exit")
        relaunched = [e["time"] for e in events if e["event"] == "launch"][1]
        second = json.loads((out / "launch-1.json").read_text())
        marks = [failed, ended, relaunched, second["t_start"], second["t_numpy"],
                 second["t_mpi"], second["t_imported"],
                 second["t_loaded"], second["t_step_done"]]
        row = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
        row["total"] = marks[-1] - marks[0]
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--after", type=int, default=None, help="slots after (default --np)")
    parser.add_argument("--mode", choices=("disk", "elastic"), default="disk")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    after = args.after or args.np
    rows = []
    print(f"# relaunch recovery, MPICH, {args.np} -> {after} ranks, {args.mode}, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| run | " + " | ".join(PHASES) + " | total (s) |")
    print("|---" * (len(PHASES) + 2) + "|")
    for run in range(args.runs):
        row = one_run(args.np, after, args.mode)
        rows.append(row)
        print(f"| {run} | " + " | ".join(f"{row[p]:.3f}" for p in PHASES)
              + f" | {row['total']:.3f} |", flush=True)
    median = {k: statistics.median(r[k] for r in rows) for k in (*PHASES, "total")}
    print("| median | " + " | ".join(f"{median[p]:.3f}" for p in PHASES)
          + f" | {median['total']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median": median}, indent=1))


if __name__ == "__main__":
    main()
