"""Plots and markdown tables from benchmark results (JSON written with ``--format json``).

Usage::

    python -m bench.report results.json [more.json ...] --plot busbw.png --markdown table.md

Functions take ``(meta, rows)`` pairs, ``rows`` being :class:`bench.common.Row` objects or
the dicts of a JSON file's ``results``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Iterable, Sequence

if not __package__:  # run as a script (python bench/report.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import human_bytes  # noqa: E402

__all__ = ["load_results", "plot_busbw", "markdown_table", "busbw_table", "rules_text", "main"]


def _d(row: Any) -> dict:
    return row if isinstance(row, dict) else row.as_dict()


def load_results(path: str) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of a ``--format json`` file."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data["meta"], data["results"]


def _by_algorithm(rows: Iterable[Any]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in map(_d, rows):
        out.setdefault(r["algorithm"], []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["size"])
    return out


def plot_busbw(runs: Sequence[tuple[dict, Sequence[Any]]], path: str,
               title: str | None = None) -> None:
    """Bus bandwidth vs message size, one line per algorithm (and per run if several).

    The machine's one-core ``np.copyto`` bandwidth, when measured, is drawn as a dashed
    line: the physical limit the bus bandwidth is measured against here.
    """
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5))
    memcpy = None
    # one rank: no bus traffic (busbw factor 0), so plot the algorithm bandwidth instead
    key = "busbw" if any((_d(r).get("busbw") or 0) > 0 for _, rows in runs for r in rows) \
        else "algbw"
    for meta, rows in runs:
        suffix = "" if len(runs) == 1 else f" ({meta.get('thread_level', '')}, n={meta['world_size']})"
        for alg, rs in _by_algorithm(rows).items():
            xs = [r["size"] for r in rs if (r.get(key) or 0) > 0]
            ys = [r[key] for r in rs if (r.get(key) or 0) > 0]
            style = {"mpi": dict(color="black", linewidth=2.5),
                     "native": dict(color="gray", linestyle=":"),
                     "auto": dict(linestyle="--", linewidth=2)}.get(alg, {})
            label = "MPI (direct mpi4py)" if alg == "mpi" else alg
            ax.plot(xs, ys, marker=".", label=label + suffix, **style)
        memcpy = memcpy or meta.get("memcpy_GBps")
    if memcpy:
        ax.axhline(memcpy, color="red", linestyle="--", linewidth=1,
                   label=f"np.copyto, one core ({memcpy:.1f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, whole vector)")
    ax.set_ylabel("bus bandwidth (GB/s)" if key == "busbw" else "algorithm bandwidth (GB/s)")
    meta0 = runs[0][0]
    ax.set_title(title or f"{meta0['test']}: {key}, n={meta0['world_size']}, "
                          f"{meta0.get('dtype', '')}, {meta0.get('thread_level', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _fmt_us(us: float) -> str:
    if us >= 10000:
        return f"{us / 1000:.1f} ms"
    if us >= 100:
        return f"{us:.0f}"
    return f"{us:.1f}"


def markdown_table(meta: dict, rows: Sequence[Any], *, best_native: dict[int, float] | None
                   = None, sizes: Sequence[int] | None = None) -> str:
    """Markdown: time per call (us) and ratio to MPI per algorithm, rows by size.

    Args:
        meta, rows: one run.
        best_native: optional ``{size: us}``, MPI's best time at any thread level; adds a
            column and the ratio of ``auto`` to it.
        sizes: only these sizes (default: all).
    """
    by_alg = _by_algorithm(rows)
    algs = list(by_alg)
    table_sizes = sorted({r["size"] for r in map(_d, rows)})
    if sizes is not None:
        table_sizes = [s for s in table_sizes if s in set(sizes)]
    idx = {(a, r["size"]): r for a, rs in by_alg.items() for r in rs}
    head = ["Size"] + [("MPI" if a == "mpi" else a) for a in algs]
    if best_native:
        head += ["best MPI (any level)", "auto / best MPI"]
    head += ["best hand-written", "auto / best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in table_sizes:
        cells = [human_bytes(s)]
        for a in algs:
            r = idx.get((a, s))
            if r is None:
                cells.append("-")
                continue
            text = _fmt_us(r["avg_us"])
            if a != "mpi" and r.get("ratio") is not None:
                text += f" ({r['ratio']:.2f}x)"
            if a == "auto" and r.get("chosen"):
                text += f" [{r['chosen']}]"
            if r.get("validated") is False:
                text += " **WRONG**"
            cells.append(text)
        if best_native:
            bn = best_native.get(s)
            auto = idx.get(("auto", s))
            cells.append(_fmt_us(bn) if bn else "-")
            cells.append(f"{auto['avg_us'] / bn:.2f}x" if bn and auto else "-")
        hand = [(idx[(a, s)]["avg_us"], a) for a in algs
                if a not in ("mpi", "native", "auto") and (a, s) in idx]
        if hand:
            t, a = min(hand)
            mpi = idx.get(("mpi", s))
            cells.append(f"{a} ({t / mpi['avg_us']:.2f}x)" if mpi else a)
        else:
            cells.append("-")
        singles = [idx[(a, s)]["avg_us"] for a in algs if a not in ("mpi", "auto")
                   and (a, s) in idx]
        auto = idx.get(("auto", s))
        cells.append(f"{auto['avg_us'] / min(singles):.2f}x" if auto and singles else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def busbw_table(meta: dict, rows: Sequence[Any], sizes: Sequence[int]) -> str:
    """Markdown: bus bandwidth (GB/s) per algorithm at ``sizes``, and the copy bandwidth."""
    by_alg = _by_algorithm(rows)
    idx = {(a, r["size"]): r for a, rs in by_alg.items() for r in rs}
    memcpy = meta.get("memcpy_GBps")
    head = ["Size"] + [("MPI" if a == "mpi" else a) for a in by_alg]
    if memcpy:
        head.append("np.copyto (one core)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sizes:
        if not any((a, s) in idx for a in by_alg):
            continue
        cells = [human_bytes(s)]
        for a in by_alg:
            r = idx.get((a, s))
            cells.append(f"{r['busbw']:.2f}" if r and r.get("busbw") is not None else "-")
        if memcpy:
            cells.append(f"{memcpy:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rules_text(rules: Sequence[dict], size: Callable[[int], str] = human_bytes) -> str:
    """A tuning-table entry's rules in one line: ``<= 8 KiB: native, above: binomial``."""
    return ", ".join(f"<= {size(r['max_bytes'])}: {r['algorithm']}"
                     if r["max_bytes"] is not None else f"above: {r['algorithm']}"
                     for r in rules)


def main(argv: list[str] | None = None) -> int:
    """Entry point: plot and/or tabulate JSON result files."""
    parser = argparse.ArgumentParser(prog="bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON files from --format json")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--markdown", metavar="MD")
    args = parser.parse_args(argv)
    runs = [load_results(p) for p in args.results]
    if args.plot:
        plot_busbw(runs, args.plot)
    text = "\n".join(markdown_table(m, r) for m, r in runs)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
