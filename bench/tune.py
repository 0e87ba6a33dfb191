"""Measure every registered algorithm on this machine and write a tuning table for ``auto``.

Usage::

    mpirun -n 4 python -m bench.tune --output table.json
    MPICOLL_TUNING_FILE=table.json mpirun -n 4 python train.py      # auto now uses it

    # one table for several world sizes: run once per size, merging into the same file
    for n in 2 3 4 8; do mpirun -n $n python -m bench.tune --merge tuned.json --output tuned.json; done

    # measure nothing: derive the rules again from the timings a table records
    python -m bench.tune --rebuild tuned.json --noise 0.1 --output tuned.json

For each collective and each size (powers of two, ``-m``), all registered algorithms
(``native`` included) run interleaved as in the benchmarks; each is validated once; each
algorithm's time is the average over ranks of each rank's median. The rules are derived
from those times by :func:`mpicoll.tuning.rules_from_timings`: times within ``--noise``
(5%) of the fastest count as equal, ties go to the preferred algorithm (``native`` first,
then simpler schedules), and each algorithm holds one range of sizes unless
``--allow-returns``. The table records the MPI library, thread level, machine and the raw
timings of every run (``meta.runs``), and how its rules were derived (``meta.derivation``:
the parameters, the command, and where the choice is slower than noise allows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

if not __package__:  # run as a script (python bench/tune.py): find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (Progress, add_common_options, command_line, iterations_for,
                          parse_args, power_of_two_sizes, relative_paths, run_meta, start_mpi)

__all__ = ["main", "tune", "rebuild", "derive_table"]


def _fraction(text: str) -> float:
    """``--noise``: a relative difference, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Options of ``bench.tune``."""
    parser = argparse.ArgumentParser(prog="bench.tune", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(parser, default_range="8:16M", iterations=20, warmup=3,
                       iterations_large=10, output="tuning.json")
    parser.add_argument("--collectives", default="all",
                        help="comma-separated collectives (default: all)")
    parser.add_argument("--exclude", default="",
                        help="comma-separated algorithms never to choose (e.g. native)")
    parser.add_argument("--step", type=int, default=2, choices=(2, 4),
                        help="size factor between measured sizes (default 2)")
    parser.add_argument("--noise", type=_fraction, default=None,
                        help="relative time difference that counts as noise (default 0.05)")
    parser.add_argument("--prefer", default="",
                        help="comma-separated preference order for ties within noise "
                             "(default: native, then simpler algorithms; see "
                             "mpicoll.tuning.PREFERENCE)")
    parser.add_argument("--allow-returns", action="store_true",
                        help="let an algorithm take sizes again after another one (A, B, A) "
                             "where that is faster beyond noise (default: one range each)")
    parser.add_argument("--merge", metavar="TABLE",
                        help="start from this table (entries for other world sizes are kept)")
    parser.add_argument("--dtype", default="float32", help="data type measured (float32)")
    parser.add_argument("--rebuild", metavar="TABLE",
                        help="measure nothing: derive the rules of TABLE again from the "
                             "timings it records (e.g. with another --noise); no MPI needed")
    return parser


def derivation_params(args: argparse.Namespace) -> dict:
    """How the rules are derived (``meta.derivation`` without command, date and costs)."""
    from mpicoll import tuning  # noqa: PLC0415

    prefer = [a.strip() for a in args.prefer.split(",") if a.strip()]
    return {"noise": tuning.NOISE if args.noise is None else args.noise,
            "single_range": not args.allow_returns,
            "preference": prefer or list(tuning.PREFERENCE)}


def _run_timings(run: dict) -> dict[str, dict[int, dict[str, float]]]:
    return {coll: {int(b): v for b, v in per.items()}
            for coll, per in (run.get("timings_us") or {}).items() if per}


def derive_table(base: Any, runs: list[dict], params: dict, command: str) -> Any:
    """A table: ``base``'s entries, overridden by the rules derived from ``runs``' timings.

    Args:
        base: a :class:`mpicoll.tuning.TuningTable` (or ``None``) whose entries are kept
            where no run has timings for them.
        runs: run records (``meta.runs``), each with ``world_size``, ``ranks_per_node``
            and ``timings_us``.
        params: ``noise``, ``single_range`` and ``preference`` (see
            :func:`mpicoll.tuning.rules_from_timings`).
        command: the command that derives it, recorded in ``meta.derivation``.
    """
    from mpicoll import tuning  # noqa: PLC0415

    colls: dict[str, list] = {}
    beyond: list[dict] = []
    for run in runs:
        for coll, timings in _run_timings(run).items():
            rules = tuning.rules_from_timings(timings, params["noise"], params["preference"],
                                              params["single_range"])
            colls.setdefault(coll, []).append({"world_size": run["world_size"],
                                               "ranks_per_node": run["ranks_per_node"],
                                               "rules": rules})
            beyond += [{"collective": coll, "world_size": run["world_size"], **s}
                       for s in tuning.slowdowns(timings, rules, params["noise"])]
    new = tuning.TuningTable({"format": tuning.FORMAT, "meta": {}, "collectives": colls})
    table = tuning.merge_tables([base, new] if base is not None else [new])
    table.meta = {"runs": runs, "derivation": {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        **params, "beyond_noise": beyond}}
    return table


def write_table(table: Any, path: str) -> None:
    """Write ``table`` as indented JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(table.to_dict(), fh, indent=1)
        fh.write("\n")


def rebuild(args: argparse.Namespace) -> int:
    """Derive every entry's rules again from the raw timings stored in ``args.rebuild``."""
    from mpicoll import tuning  # noqa: PLC0415

    with open(args.rebuild, encoding="utf-8") as fh:
        table = tuning.TuningTable(json.load(fh), args.rebuild)
    runs = [_clean_run(r) for r in table.meta.get("runs", [])]
    command = command_line(None, "tune", args.argv)
    new = derive_table(table, runs, derivation_params(args), command)
    write_table(new, args.output)
    print(f"# tune: derived {args.output} from the timings in {args.rebuild}")
    print_rules(new.to_dict()["collectives"])
    return 0


def _clean_run(run: dict) -> dict:
    """A stored run record without what no longer describes the table (the old
    ``tolerance`` parameter) and with repository-relative paths in its command."""
    run = {k: v for k, v in run.items() if k != "tolerance"}
    if "command" in run:
        run["command"] = relative_paths(run["command"])
    return run


def _collectives(args: argparse.Namespace) -> list[str]:
    import mpicoll  # noqa: PLC0415

    colls = (list(mpicoll.COLLECTIVES) if args.collectives == "all"
             else [c.strip() for c in args.collectives.split(",") if c.strip()])
    for c in colls:
        if c not in mpicoll.COLLECTIVES:
            raise SystemExit(f"unknown collective {c!r}; choose from {mpicoll.COLLECTIVES}")
    from bench.collective import check_case_options  # noqa: PLC0415

    exclude, prefer = ({a.strip() for a in spec.split(",") if a.strip()}
                       for spec in (args.exclude, args.prefer))
    known = {a for c in colls for a in mpicoll.algorithms(c)}
    if (exclude | prefer) - known:
        raise SystemExit(f"--exclude/--prefer name no algorithm of {colls}: "
                         f"{sorted((exclude | prefer) - known)} (registered: {sorted(known)})")
    for c in colls:   # (every rank alike, before anything is measured)
        check_case_options(c, args.dtype, "sum", 0, 1)
        if not set(mpicoll.algorithms(c)) - exclude:
            raise SystemExit(f"--exclude leaves no {c} algorithm to measure")
    return colls


def measure(args: argparse.Namespace, comm: Any, colls: list[str]
            ) -> tuple[dict[str, dict[int, dict[str, float]]], list[str]]:
    """Every algorithm of ``colls`` at every size: ({coll: {nbytes: {alg: s}}}, failures)."""
    import mpicoll  # noqa: PLC0415

    from bench.collective import CollectiveCase, time_interleaved  # noqa: PLC0415

    n = comm.Get_size()
    exclude = {a.strip() for a in args.exclude.split(",") if a.strip()}
    sizes = power_of_two_sizes(*args.message_size, step=args.step)
    progress = Progress(comm.Get_rank() == 0 and not args.quiet, "tune",
                        len(colls) * len(sizes))
    timings: dict[str, dict[int, dict[str, float]]] = {}
    failures: list[str] = []
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
            if not usable:
                raise SystemExit(f"no {coll} algorithm passed validation at {nbytes} B:\n"
                                 + "\n".join(failures))
            warm, iters = iterations_for(args, nbytes)
            medians = comm.allgather(time_interleaved(
                comm, {a: case.call(a) for a in usable}, warm, iters))
            per_size[nbytes] = {a: sum(m[a] for m in medians) / n for a in usable}
            progress.step(sum(len(v) for v in timings.values()), f"{coll} {nbytes} B")
            del case
    return timings, failures


def run_record(MPI: Any, args: argparse.Namespace, n: int, rpn: int,
               timings: dict[str, dict[int, dict[str, float]]]) -> dict:
    """The ``meta.runs`` entry of one measurement: setup, command and raw timings (us)."""
    meta = run_meta(MPI, n, "tune", args.argv)
    return {"mpi_library": meta["mpi_library"], "thread_level": meta["thread_level"],
            "machine": meta["machine"], "date": meta["date"],
            "world_size": n, "ranks_per_node": rpn, "dtype": args.dtype,
            "iterations": args.iterations, "iterations_large": args.iterations_large,
            "command": meta["command"],
            "timings_us": {c: {str(b): {a: round(t * 1e6, 2) for a, t in v.items()}
                               for b, v in per.items()} for c, per in timings.items()}}


def _merge_base(path: str | None) -> Any:
    """The table to merge into (``None``: none, or it cannot be read)."""
    from mpicoll import tuning  # noqa: PLC0415

    if not path:
        return None
    try:
        return tuning.load_table(path)
    except ValueError as exc:
        print(f"# tune: --merge: {exc}; starting a new table", file=sys.stderr)
        return None


def print_rules(collectives: dict, world_size: int | None = None) -> None:
    """One line per table entry (of ``world_size`` only, if given)."""
    from bench.report import rules_text  # noqa: PLC0415

    for c, entries in collectives.items():
        for e in entries:
            if world_size is None or e["world_size"] == world_size:
                print(f"#   {c} n={e['world_size']}: {rules_text(e['rules'], str)}")


def tune(args: argparse.Namespace) -> int:
    """Measure, build the table, write it on rank 0; returns the exit status."""
    MPI = start_mpi(args.thread_level)
    from mpicoll.context import get_context  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    colls = _collectives(args)
    if n == 1:
        if rank == 0:
            print("# tune: one rank has nothing to choose; writing no entries", file=sys.stderr)
        colls = []
    rpn = get_context(comm).topology.local_size
    timings, failures = measure(args, comm, colls)
    if rank == 0:
        record = run_record(MPI, args, n, rpn, timings)
        base = _merge_base(args.merge)
        runs = {r.get("world_size"): r for r in (base.meta.get("runs", []) if base else [])}
        runs[n] = record
        table = derive_table(base, [runs[k] for k in sorted(runs, key=str)],
                             derivation_params(args), record["command"])
        write_table(table, args.output)
        print(f"# tune: wrote {args.output} (world size {n}, {len(timings)} collectives)")
        print_rules(table.to_dict()["collectives"], n)
        for f in failures:
            print(f"# tune: VALIDATION FAILED, not chosen: {f}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(build_parser(), argv)
    return rebuild(args) if args.rebuild else tune(args)


if __name__ == "__main__":
    sys.exit(main())
