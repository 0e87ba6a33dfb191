"""A Chrome-trace timeline of every collective, merged across ranks into one file.

``MPICOLL_TIMELINE=trace.json mpirun -n 4 python train.py`` (or :func:`start` /
:func:`stop` in the program) records, on every rank, one complete event per collective
(begin, end, algorithm, bytes, sequence number, communicator) and whatever else calls
:func:`event` (the PyTorch adapter records its negotiation and operations there). Open the
file in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``: one process per rank,
one track per communicator (or per tensor, for the adapter).

How the file is made, without any collective at the end of the run (a rank that failed
must not make the others wait): each rank appends its events as JSON lines to its own part
file ``trace.json.rank<R>`` (flushed every :data:`FLUSH_EVENTS` events, and at
:func:`stop` or interpreter exit); rank 0, at its stop, waits up to
:data:`MERGE_WAIT_SECONDS` for every rank's finished part and writes ``trace.json``, then
removes the parts. Parts that did not finish in time are left in place, and
``python -m mpicoll.timeline trace.json`` merges them later (also what to run when the ranks
do not share a file system: copy the parts together first).

A rank is a rank of the runtime's world when the timeline starts (:mod:`mpicoll.elastic`:
a process that joined a growth is its rank in the grown world, not its spawn's
``MPI.COMM_WORLD``'s), and rank 0 waits for the parts of every world it has been in (the
new ranks' too). After a shrink the survivors keep their parts; a growth after a shrink can
give a new rank the part of a survivor whose rank moved.

Timestamps are ``time.perf_counter()`` shifted to the epoch (``time.time()`` read once at
start): exact within a process, as aligned across processes as the hosts' clocks.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["start", "stop", "enabled", "now", "event", "merge", "FLUSH_EVENTS",
           "MERGE_WAIT_SECONDS"]

#: Events kept in memory before they are appended to this rank's part file.
FLUSH_EVENTS = 10_000
#: How long rank 0 waits, at its stop, for the other ranks' parts.
MERGE_WAIT_SECONDS = 10.0
_DONE = {"done": True}  # the last line of a finished part

ON = False  # read on the hot path of recorded calls: a plain module global
_events: list[tuple] = []
_state: dict[str, Any] = {}


def now() -> float:
    """The clock of :func:`event` (seconds, ``time.perf_counter``)."""
    return time.perf_counter()


def enabled() -> bool:
    """Whether a timeline is being recorded in this process."""
    return ON


def _world() -> tuple[int, int]:
    """This process's rank and the size of the runtime's world (what ``comm=None`` means:
    in a process that joined a growth, the grown world, not its own ``MPI.COMM_WORLD``)."""
    from mpi4py import MPI  # noqa: PLC0415  (the module itself runs without MPI: merge)

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 0, 1
    from ..runtime import world  # noqa: PLC0415

    return world.comm().Get_rank(), world.comm().Get_size()


def _most_ranks() -> int:
    """How many parts rank 0 merges: ranks of every world this process has been in (a
    growth's new ranks write parts too), at least the size at the start."""
    from ..runtime import world  # noqa: PLC0415

    return max(_state["size"], world.most_ranks())


def _part(path: str, rank: int) -> Path:
    return Path(f"{path}.rank{rank}")


def start(path: str | os.PathLike) -> None:
    """Start recording into ``path`` (the same path on every rank; per process, not
    collective). A timeline already running is stopped (and written) first.

    Raises:
        ValueError: ``path`` is a directory, or this rank's part file beside it cannot be
            written (its directory is missing or not writable): at the start, not at the
            first flush or at exit.
    """
    global ON
    if ON:
        stop()
    rank, size = _world()
    part = _part(os.fspath(path), rank)
    if Path(path).is_dir():
        raise ValueError(f"timeline path {os.fspath(path)!r} is a directory: name a file "
                         f"(its parts are written beside it as <file>.rank<R>)")
    try:
        part.write_bytes(b"")     # (also empties a part left by an earlier run)
    except OSError as exc:
        raise ValueError(f"timeline path {os.fspath(path)!r}: this rank's part {part} "
                         f"cannot be written ({exc.strerror})") from None
    _state.update(path=os.fspath(path), rank=rank, size=size, part=part,
                  offset=time.time() - time.perf_counter())
    _events.clear()
    ON = True
    _invalidate_calls()


def _invalidate_calls() -> None:
    from .. import fastpath  # noqa: PLC0415  (cached calls are bound with or without events)

    fastpath.invalidate()


def event(name: str, begin: float, end: float, *, track: str = "collectives",
          category: str = "collective", args: dict | None = None) -> None:
    """Record one complete event of this rank (``begin``/``end`` from :func:`now`).

    Args:
        name: what ran (``"allreduce"``, ``"NEGOTIATE_ALLREDUCE"`` ...).
        track: the row it is drawn on (a communicator, a tensor name).
        category: Chrome trace's ``cat``.
        args: shown when the event is selected (algorithm, bytes ...).
    """
    if not ON:
        return
    _events.append((name, begin, end, track, category, args))
    if len(_events) >= FLUSH_EVENTS:
        _flush()


def _flush(final: bool = False) -> None:
    offset, rank = _state["offset"], _state["rank"]
    with open(_state["part"], "a", encoding="utf-8") as out:
        for name, begin, end, track, category, args in _events:
            record = {"name": name, "cat": category, "ph": "X", "pid": rank, "track": track,
                      "ts": round((begin + offset) * 1e6, 3),
                      "dur": round((end - begin) * 1e6, 3)}
            if args:
                record["args"] = args
            out.write(json.dumps(record) + "\n")
        if final:
            out.write(json.dumps(_DONE) + "\n")
    _events.clear()


def stop() -> Path | None:
    """Stop recording; write this rank's part; on rank 0, merge every rank's part.

    Returns:
        On rank 0, the merged file (``None`` if some parts were missing after
        :data:`MERGE_WAIT_SECONDS`: they are left for ``python -m mpicoll.timeline``);
        ``None`` on other ranks or when no timeline was running.
    """
    global ON
    if not ON:
        return None
    ON = False
    _invalidate_calls()
    _flush(final=True)
    if _state["rank"] != 0:
        return None
    path, size = _state["path"], _most_ranks()
    deadline = time.monotonic() + MERGE_WAIT_SECONDS
    while missing := [r for r in range(size) if not _finished(_part(path, r))]:
        if time.monotonic() > deadline:
            print(f"mpicoll.timeline: parts of ranks {missing} not finished after "
                  f"{MERGE_WAIT_SECONDS:.0f} s; merge later with: python -m mpicoll.timeline "
                  f"{path}", file=sys.stderr, flush=True)
            return None
        time.sleep(0.05)
    return merge(path, size)


def _finished(part: Path) -> bool:
    try:
        with open(part, "rb") as f:
            f.seek(max(0, part.stat().st_size - 64))
            return f.read().rstrip().endswith(json.dumps(_DONE).encode())
    except OSError:
        return False


def merge(path: str | os.PathLike, size: int | None = None, keep_parts: bool = False) -> Path:
    """Merge the part files of ``path`` (ranks ``0..size-1``; all found when ``None``) into
    one Chrome-trace JSON file at ``path``; remove the parts unless ``keep_parts``."""
    path = Path(path)
    if size is None:
        parts = sorted((p for p in path.parent.glob(path.name + ".rank*")
                        if p.name.rsplit(".rank", 1)[1].isdigit()),
                       key=lambda p: int(p.name.rsplit(".rank", 1)[1]))
    else:
        parts = [p for p in (_part(os.fspath(path), r) for r in range(size)) if p.exists()]
    if not parts:            # (a merged trace, or a mistyped path: never overwritten)
        raise FileNotFoundError(f"no part files {path}.rank<R> to merge")
    trace = [event for part in parts for event in _part_events(part)]
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}) + "\n",
                    encoding="utf-8")
    if not keep_parts:
        for part in parts:
            part.unlink()
    return path


def _part_events(part: Path) -> list[dict]:
    """One rank's events, tracks numbered, with the names of its process and tracks."""
    rank = int(part.name.rsplit(".rank", 1)[1])
    tids: dict[str, int] = {}
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "pid": rank,
               "args": {"sort_index": rank}}]
    for line in part.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:     # the last line of a rank killed mid-flush
            print(f"mpicoll.timeline: skipped an incomplete line of {part}", file=sys.stderr)
            continue
        if record.get("done"):
            continue
        track = record.pop("track")
        if track not in tids:
            tids[track] = len(tids) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": rank,
                           "tid": tids[track], "args": {"name": track}})
        record["tid"] = tids[track]
        events.append(record)
    return events


@atexit.register
def _stop_at_exit() -> None:
    if ON:
        stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m mpicoll.timeline trace.json``: merge the part files left beside it."""
    parser = argparse.ArgumentParser(prog="python -m mpicoll.timeline", description=main.__doc__)
    parser.add_argument("path", help="the timeline file (its parts are PATH.rank<R>)")
    parser.add_argument("--keep-parts", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = merge(args.path, keep_parts=args.keep_parts)
    except FileNotFoundError as exc:
        print(f"python -m mpicoll.timeline: {exc}; {args.path} is left as it is",
              file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
