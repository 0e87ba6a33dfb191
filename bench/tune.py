"""Measure every registered algorithm on this machine and write a tuning table for ``auto``.

Usage::

    mpirun -n 4 python -m bench.tune --output table.json
    MPICOLL_TUNING_FILE=table.json mpirun -n 4 python train.py      # auto now uses it

    # one table for several world sizes: run once per size, merging into the same file
    for n in 2 3 4 8; do mpirun -n $n python -m bench.tune --merge tuned.json --output tuned.json; done

For each collective and each size (powers of two, ``-m``), all registered algorithms
(``native`` included) run interleaved as in the benchmarks; each is validated once; the
fastest (average over ranks of each rank's median) wins, and runs of equal winners become
one rule; a switch between neighbouring sizes must pay for itself (``--tolerance``), so
noise does not cut the table into slivers (see :func:`mpicoll.tuning.rules_from_timings`). The table records the MPI library, thread level,
machine and the raw timings (in ``meta``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if not __package__:  # run as a script (python bench/tune.py): find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (MiB, Progress, add_common_options, iterations_for, library_version,
                     machine_description, power_of_two_sizes, start_mpi, thread_level_name)

__all__ = ["main", "tune"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.tune", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(parser, default_range="8:16M", iterations=20, warmup=3)
    parser.set_defaults(iterations_large=10, output="tuning.json")
    parser.add_argument("--collectives", default="all",
                        help="comma-separated collectives (default: all)")
    parser.add_argument("--exclude", default="",
                        help="comma-separated algorithms never to choose (e.g. native)")
    parser.add_argument("--step", type=int, default=2, choices=(2, 4),
                        help="size factor between measured sizes (default 2)")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="cost of switching algorithm between neighbouring sizes, as a "
                             "fraction of one size's time (default 0.1; 0: fastest per size)")
    parser.add_argument("--merge", metavar="TABLE",
                        help="start from this table (entries for other world sizes are kept)")
    parser.add_argument("--dtype", default="float32", help="data type measured (float32)")
    parser.add_argument("--rebuild", metavar="TABLE",
                        help="measure nothing: rebuild the rules of TABLE from the timings "
                             "it records (e.g. with another --tolerance); no MPI needed")
    return parser


def rebuild(path: str, output: str, tolerance: float) -> int:
    """Recompute every entry's rules from the raw timings stored in ``path``'s meta."""
    from mpicoll import tuning  # noqa: PLC0415

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    table = tuning.TuningTable(data, path)
    colls: dict[str, list] = {}
    for run in table.meta.get("runs", []):
        for coll, per in (run.get("timings_us") or {}).items():
            timings = {int(b): v for b, v in per.items()}
            if timings:
                colls.setdefault(coll, []).append({
                    "world_size": run["world_size"], "ranks_per_node": run["ranks_per_node"],
                    "rules": tuning.rules_from_timings(timings, tolerance)})
    new = tuning.merge_tables([table, tuning.TuningTable(
        {"format": tuning.FORMAT, "meta": {}, "collectives": colls})])
    new.meta = {**table.meta, "tolerance": tolerance}
    with open(output, "w", encoding="utf-8") as fh:
        json.dump(new.to_dict(), fh, indent=1)
        fh.write("\n")
    print(f"# tune: rebuilt {output} from the timings in {path} (tolerance {tolerance})")
    return 0


def tune(args: argparse.Namespace) -> int:
    """Measure, build the table, write it on rank 0; returns the exit status."""
    MPI = start_mpi(args.thread_level)
    import mpicoll  # noqa: PLC0415
    from mpicoll import tuning  # noqa: PLC0415
    from mpicoll.context import get_context  # noqa: PLC0415

    from bench.collective import CollectiveCase, time_interleaved  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    colls = (list(mpicoll.COLLECTIVES) if args.collectives == "all"
             else [c.strip() for c in args.collectives.split(",") if c.strip()])
    for c in colls:
        if c not in mpicoll.COLLECTIVES:
            raise SystemExit(f"unknown collective {c!r}; choose from {mpicoll.COLLECTIVES}")
    exclude = {a.strip() for a in args.exclude.split(",") if a.strip()}
    sizes = power_of_two_sizes(*args.message_size, step=args.step)
    rpn = get_context(comm).topology.local_size
    progress = Progress(rank == 0 and not args.quiet, "tune", len(colls) * len(sizes))
    timings: dict[str, dict[int, dict[str, float]]] = {}
    failures: list[str] = []
    done = 0
    if n == 1:
        if rank == 0:
            print("# tune: one rank has nothing to choose; writing no entries", file=sys.stderr)
        colls = []
    for coll in colls:
        algs = [a for a in mpicoll.algorithms(coll) if a not in exclude]
        per_size = timings[coll] = {}
        for nbytes in sizes:
            case = CollectiveCase(coll, comm, nbytes, args.dtype)
            usable = []
            for a in algs:
                errs = comm.allgather(case.validate(a, repeats=1))
                if any(errs):
                    failures.append(f"{coll} {a} {nbytes} B: {[e for e in errs if e][0]}")
                else:
                    usable.append(a)
            warm, iters = iterations_for(args, nbytes)
            medians = comm.allgather(time_interleaved(
                comm, {a: case.call(a) for a in usable}, warm, iters))
            per_size[nbytes] = {a: sum(m[a] for m in medians) / n for a in usable}
            done += 1
            progress.step(done, f"{coll} {nbytes} B")
            del case
    if rank == 0:
        meta = {
            "tolerance": args.tolerance,
            "mpi_library": library_version(),
            "thread_level": thread_level_name(MPI.Query_thread()),
            "machine": machine_description(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "world_size": n, "ranks_per_node": rpn, "dtype": args.dtype,
            "iterations": args.iterations, "iterations_large": args.iterations_large,
            "command": f"mpirun -n {n} python -m bench.tune " + " ".join(sys.argv[1:]),
            "timings_us": {c: {str(b): {a: round(t * 1e6, 2) for a, t in v.items()}
                               for b, v in per.items()} for c, per in timings.items()},
        }
        collectives = {c: [{"world_size": n, "ranks_per_node": rpn,
                            "rules": tuning.rules_from_timings(per, args.tolerance)}]
                       for c, per in timings.items() if per}
        table = tuning.TuningTable({"format": tuning.FORMAT, "meta": {"runs": [meta]},
                                    "collectives": collectives}, "<tune>")
        if args.merge:
            try:
                base = tuning.load_table(args.merge)
            except ValueError as exc:
                print(f"# tune: --merge: {exc}; starting a new table", file=sys.stderr)
            else:
                table = tuning.merge_tables([base, table])
                runs = {r.get("world_size"): r for r in table.meta.get("runs", [])}
                table.meta["runs"] = [runs[k] for k in sorted(runs, key=str)]
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(table.to_dict(), fh, indent=1)
            fh.write("\n")
        print(f"# tune: wrote {args.output} (world size {n}, {len(collectives)} collectives)")
        for c, entries in collectives.items():
            rules = ", ".join(f"<= {r['max_bytes']}: {r['algorithm']}"
                              if r["max_bytes"] is not None else f"above: {r['algorithm']}"
                              for r in entries[0]["rules"])
            print(f"#   {c}: {rules}")
        for f in failures:
            print(f"# tune: VALIDATION FAILED, not chosen: {f}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    if args.rebuild:
        return rebuild(args.rebuild, args.output, args.tolerance)
    return tune(args)


if __name__ == "__main__":
    sys.exit(main())
