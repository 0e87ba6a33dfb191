"""Tuning tables for ``algorithm="auto"``: which algorithm is fastest, by message size.

A table is a JSON file written by the tune command (``mpirun -n 4 python -m bench.tune
--output table.json``) and read here. Which table ``auto`` uses, first match wins:

1. the one given to :func:`use_table` (a path, a :class:`TuningTable` or a dict);
2. ``MPICOLL_TUNING_FILE`` (a path; ``none`` / ``off`` disables tables);
3. the default table shipped with mpicoll (``mpicoll/tuning_default.json``).

A table that has no entry for a collective at a world size leaves the choice to the
built-in rules of :mod:`mpicoll.selection`. Every lookup depends only on (collective, world
size, ranks per node, byte count) and the table, which all ranks read from the same file,
so every rank makes the same choice.

Format (``"format": "mpicoll-tuning/1"``)::

    {
      "format": "mpicoll-tuning/1",
      "meta": {"mpi_library": "...", "thread_level": "MPI_THREAD_MULTIPLE", ...},
      "collectives": {
        "allreduce": [
          {"world_size": 2, "ranks_per_node": 2,
           "rules": [{"max_bytes": 4096, "algorithm": "recursive_doubling"},
                     {"max_bytes": null, "algorithm": "ring"}]}
        ]
      }
    }

``rules`` are sorted by ``max_bytes``; a message of ``nbytes`` bytes takes the first rule
with ``nbytes <= max_bytes`` (``null``: no upper bound). ``ranks_per_node`` 0 (or absent)
matches any layout. A world size with no entry uses the nearest entry of the same kind
(power of two or not) when one exists within a factor of two, else the built-in rules.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import config, fastpath
from .partition import is_power_of_two

__all__ = ["FORMAT", "TuningTable", "load_table", "default_table_path", "default_table",
           "use_table", "active_table", "rules_from_timings", "slowdowns", "merge_tables",
           "clear_cache", "PREFERENCE", "NOISE"]

log = logging.getLogger("mpicoll.tuning")

#: The format tag of tables this module reads and writes.
FORMAT = "mpicoll-tuning/1"

_DISABLED = ("none", "off", "0", "false", "builtin")
_lock = threading.Lock()
_file_cache: dict[str, "TuningTable | ValueError"] = {}
_override: "TuningTable | None" = None


def _spans_nodes(ranks_per_node: int, size: int) -> bool | None:
    """Whether a layout spans several nodes (``None``: unknown layout)."""
    return None if ranks_per_node <= 0 else ranks_per_node < size


def _nearest_layout(layouts: dict, pick: int, size: int, ranks_per_node: int) -> Any:
    """The entry measured at the layout nearest ``ranks_per_node`` (ties: the larger), never
    across the node boundary: timings of one shared-memory node say nothing of a network,
    so a layout spanning nodes with only one-node entries (or the reverse) gets ``None``
    (the built-in rules, which know about nodes)."""
    spans = _spans_nodes(ranks_per_node, size)
    alike = [r for r in layouts if spans is None or _spans_nodes(r, pick) == spans]
    if not alike:
        return None
    return layouts[min(alike, key=lambda r: (abs(r - ranks_per_node), -r))]


class TuningTable:
    """A parsed, validated tuning table.

    Args:
        data: the JSON object (see the module docstring).
        source: where it came from, for messages.
    Raises:
        ValueError: the object does not follow the format (the message says where).
    """

    def __init__(self, data: Mapping[str, Any], source: str = "<dict>") -> None:
        self.source = source
        if not isinstance(data, Mapping):
            raise ValueError(f"tuning table {source}: expected a JSON object")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"tuning table {source}: format {fmt!r} is not {FORMAT!r}")
        self.meta: dict = dict(data.get("meta") or {})
        colls = data.get("collectives")
        if not isinstance(colls, Mapping):
            raise ValueError(f"tuning table {source}: 'collectives' must be an object")
        # collective -> {(world_size, ranks_per_node): (thresholds, names)}
        self._entries: dict[str, dict[tuple[int, int], tuple[list[float], list[str]]]] = {}
        for coll, entries in colls.items():
            if not isinstance(entries, list):
                raise ValueError(f"tuning table {source}: collectives.{coll} must be a list")
            parsed = self._entries.setdefault(str(coll), {})
            for k, entry in enumerate(entries):
                where = f"tuning table {source}: collectives.{coll}[{k}]"
                key = self._key(entry, where)  # first: it checks that entry is an object
                parsed[key] = self._rules(entry, where)
        self._cache: dict[tuple[str, int, int], tuple[list[float], list[str]] | None] = {}

    @staticmethod
    def _key(entry: Any, where: str) -> tuple[int, int]:
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected an object")
        try:
            size = int(entry["world_size"])
            rpn = int(entry.get("ranks_per_node") or 0)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: needs an integer 'world_size'") from None
        if size < 1 or rpn < 0:
            raise ValueError(f"{where}: world_size must be >= 1 and ranks_per_node >= 0")
        return size, rpn

    @staticmethod
    def _rules(entry: Mapping, where: str) -> tuple[list[float], list[str]]:
        rules = entry.get("rules")
        if not isinstance(rules, list) or not rules:
            raise ValueError(f"{where}: 'rules' must be a non-empty list")
        pairs = []
        for j, rule in enumerate(rules):
            if not isinstance(rule, Mapping) or not isinstance(rule.get("algorithm"), str):
                raise ValueError(f"{where}.rules[{j}]: needs a string 'algorithm'")
            mb = rule.get("max_bytes")
            if mb is None:
                limit = float("inf")
            elif isinstance(mb, (int, float)) and not isinstance(mb, bool) and mb >= 0:
                limit = float(mb)
            else:
                raise ValueError(f"{where}.rules[{j}]: max_bytes must be a number >= 0 or "
                                 f"null, not {mb!r}")
            pairs.append((limit, rule["algorithm"]))
        pairs.sort(key=lambda p: p[0])
        if pairs[-1][0] != float("inf"):
            pairs.append((float("inf"), pairs[-1][1]))  # the largest rule covers the rest
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def collectives(self) -> list[str]:
        """Collectives the table has entries for."""
        return sorted(self._entries)

    def world_sizes(self, collective: str) -> list[int]:
        """World sizes with an entry for ``collective``."""
        return sorted({s for s, _ in self._entries.get(collective, {})})

    def _entry(self, collective: str, size: int,
               ranks_per_node: int) -> tuple[list[float], list[str]] | None:
        key = (collective, size, ranks_per_node)
        if key in self._cache:
            return self._cache[key]
        entries = self._entries.get(collective, {})
        found = None
        same_kind = [s for s, _ in entries if is_power_of_two(s) == is_power_of_two(size)
                     and s <= 2 * size and size <= 2 * s]
        # (the size itself, when it has an entry, is the nearest)
        pick = min(same_kind, key=lambda s: (abs(s - size), -s), default=None)
        if pick is not None:
            layouts = {r: v for (s, r), v in entries.items() if s == pick}
            found = layouts.get(0)  # (an entry for any layout)
            if ranks_per_node in layouts and \
                    _spans_nodes(ranks_per_node, pick) == _spans_nodes(ranks_per_node, size):
                found = layouts[ranks_per_node]  # (of another size: on as many nodes or one)
            elif found is None:  # the measured layout nearest to the one asked for; ties: the larger
                found = _nearest_layout(layouts, pick, size, ranks_per_node)
        if len(self._cache) < 4096:
            self._cache[key] = found
        return found

    def lookup(self, collective: str, size: int, ranks_per_node: int,
               nbytes: int) -> str | None:
        """The table's algorithm for this call, or ``None`` when it has no entry.

        Args:
            collective: e.g. ``"allreduce"``.
            size: world size.
            ranks_per_node: ranks per node (0: unknown, matches any layout).
            nbytes: byte count of the whole vector.
        """
        entry = self._entry(collective, size, ranks_per_node)
        if entry is None:
            return None
        limits, names = entry
        return names[min(bisect.bisect_left(limits, nbytes), len(names) - 1)]

    def to_dict(self) -> dict:
        """The table as a JSON-ready object (same format it was read from)."""
        colls: dict[str, list] = {}
        for coll, entries in sorted(self._entries.items()):
            out = colls[coll] = []
            for (size, rpn), (limits, names) in sorted(entries.items()):
                rules = [{"max_bytes": None if lim == float("inf") else int(lim),
                          "algorithm": name} for lim, name in zip(limits, names)]
                out.append({"world_size": size, "ranks_per_node": rpn, "rules": rules})
        return {"format": FORMAT, "meta": self.meta, "collectives": colls}

    def __repr__(self) -> str:
        return f"TuningTable({self.source!r}, collectives={self.collectives()})"


def load_table(path: str | os.PathLike) -> TuningTable:
    """Read and validate the table at ``path``.

    The result (or the error) is cached per path for the life of the process, so every
    call of a collective costs one dictionary lookup and all ranks keep the table they
    first read even if the file is rewritten meanwhile; :func:`clear_cache` forgets it.

    Raises:
        ValueError: unreadable file, bad JSON, or not a tuning table (names the file).
    """
    p = str(path)
    hit = _file_cache.get(p)
    if hit is None:
        try:
            with open(p, encoding="utf-8") as fh:
                data = json.load(fh)
            hit = TuningTable(data, source=p)
        except OSError as exc:
            hit = ValueError(f"tuning table {p}: cannot read it ({exc.strerror})")
        except json.JSONDecodeError as exc:
            hit = ValueError(f"tuning table {p}: not valid JSON ({exc})")
        except ValueError as exc:
            hit = exc
        with _lock:
            _file_cache[p] = hit
    if isinstance(hit, ValueError):
        raise hit
    return hit


def clear_cache() -> None:
    """Forget every table read from a file (the next lookup reads the files again)."""
    fastpath.invalidate()
    with _lock:
        _file_cache.clear()


def default_table_path() -> Path:
    """Where the shipped default table lives (``mpicoll/tuning_default.json``)."""
    return Path(__file__).with_name("tuning_default.json")


_DEFAULT_PATH = str(default_table_path())


def default_table() -> TuningTable | None:
    """The shipped table, or ``None`` if it is missing or invalid (logged once: the
    error is cached with the file, :func:`load_table`)."""
    if isinstance(_file_cache.get(_DEFAULT_PATH), ValueError):
        return None
    try:
        return load_table(_DEFAULT_PATH)
    except ValueError as exc:
        # a missing file (a source checkout without one) is not worth a warning
        missing = not os.path.exists(_DEFAULT_PATH)
        log.log(logging.DEBUG if missing else logging.WARNING,
                "ignoring the default tuning table: %s", exc)
        return None


def use_table(table: str | os.PathLike | TuningTable | Mapping | None) -> TuningTable | None:
    """Make ``auto`` use ``table`` in this process (overrides ``MPICOLL_TUNING_FILE``).

    Call it on every rank with the same table. ``None`` goes back to the environment
    variable / default table.

    Args:
        table: a path, a :class:`TuningTable`, or a table as a dict.
    Returns:
        The table now in use (``None`` after a reset).
    Raises:
        ValueError: the table cannot be read or is not valid.
    """
    global _override
    if table is None:
        parsed = None
    elif isinstance(table, TuningTable):
        parsed = table
    elif isinstance(table, Mapping):
        parsed = TuningTable(table)
    else:
        parsed = load_table(table)
    with _lock:
        _override = parsed
    fastpath.invalidate()
    return parsed


def active_table() -> TuningTable | None:
    """The table ``auto`` consults now (``None``: built-in rules only).

    Raises:
        ValueError: ``MPICOLL_TUNING_FILE`` names a file that is missing or invalid.
    """
    if _override is not None:
        return _override
    path = config.env_str("MPICOLL_TUNING_FILE")
    if path is not None:
        if path.strip().lower() in _DISABLED:
            return None
        try:
            return load_table(path)
        except ValueError as exc:
            raise ValueError(f"MPICOLL_TUNING_FILE: {exc}") from None
    return default_table()


#: Order of preference among algorithms whose times are within noise of each other: MPI's
#: own first, then the simpler schedules; names not listed come after, alphabetically.
PREFERENCE = ("native", "binomial", "recursive_doubling", "recursive_halving", "ring",
              "tree", "scatter_allgather", "rabenseifner", "hierarchical")

#: Default noise level of :func:`rules_from_timings`: times within 5% count as equal.
NOISE = 0.05


def _preference_key(preference: Iterable[str]):
    order = {name: k for k, name in enumerate(preference)}
    return lambda name: (order.get(name, len(order)), name)


def _excess_over_noise(timings: Mapping[int, Mapping[str, float]],
                       noise: float) -> tuple[list[int], list[dict[str, float]]]:
    """Sizes in order and, per size, each algorithm's slowdown beyond noise (0: within it)."""
    sizes, excess = [], []
    for nbytes in sorted(timings):
        times = {a: t for a, t in timings[nbytes].items() if t is not None and t > 0}
        if times:
            best = min(times.values())
            sizes.append(nbytes)
            excess.append({a: max(0.0, round(t / best - 1.0 - noise, 9))
                           for a, t in times.items()})
    if not sizes:
        raise ValueError("no timings to build rules from")
    return sizes, excess


def _label_sizes(excess: list[dict[str, float]], key, single_range: bool) -> list[str]:
    """One algorithm per size: with ``single_range`` fewest returns (an algorithm taking
    sizes again after another one), then least total excess, fewest switches, preference.

    A shortest path over sizes whose state is (algorithm, algorithms used so far). Returns
    are only counted with ``single_range``, and then only chosen when unavoidable (an
    algorithm missing at some sizes, e.g. one that failed validation there).
    """
    Cost = tuple[int, float, int, int]
    State = tuple[str, frozenset]
    level: dict[State, tuple[Cost, State | None]] = {}
    for a in sorted(excess[0], key=key):
        used = frozenset((a,) if single_range else ())
        level[(a, used)] = ((0, excess[0][a], 0, key(a)[0]), None)
    back = [level]
    for here in excess[1:]:
        new: dict[State, tuple[Cost, State | None]] = {}
        for (prev, used), (cost, _) in back[-1].items():
            for a in sorted(here, key=key):
                state = (a, used | {a} if single_range else used)
                c = (cost[0] + (a != prev and a in used), round(cost[1] + here[a], 9),
                     cost[2] + (a != prev), cost[3] + key(a)[0])
                if state not in new or c < new[state][0]:
                    new[state] = (c, (prev, used))
        back.append(new)
    state: State | None = min(back[-1], key=lambda s: (back[-1][s][0], key(s[0])))
    labels = []
    for level in reversed(back):
        labels.append(state[0])
        state = level[state][1]
    return labels[::-1]


def rules_from_timings(timings: Mapping[int, Mapping[str, float]], noise: float = NOISE,
                       preference: Iterable[str] = PREFERENCE,
                       single_range: bool = True) -> list[dict]:
    """Turn measured times into rules: which algorithm up to which size.

    Times within ``noise`` of the fastest at a size count as equally fast, so noise cannot
    make the choice flicker between neighbouring sizes: among the labellings of the sizes,
    the one chosen has the least total slowdown beyond noise (``time / fastest - 1 -
    noise``, where positive, summed over sizes), then the fewest changes of algorithm,
    then the most preferred algorithms (``preference``: MPI's own ``native`` first, then
    simpler schedules). Without ``single_range`` that puts every size on an algorithm
    within noise of its fastest. With ``single_range`` (the default) each algorithm also
    holds one range of sizes only (no A, B, A): where the measurements really do favour
    an algorithm again after another, the range whose loss is smaller gives way (see
    :func:`slowdowns` for what that costs); only an algorithm missing from the timings
    at some sizes can force a return.

    Args:
        timings: ``{nbytes: {algorithm: seconds}}`` (any sizes, at least one).
        noise: relative difference that counts as noise (0.05: 5%).
        preference: algorithm names, most preferred first.
        single_range: each algorithm takes one range of sizes.
    Returns:
        The ``rules`` list of a table entry: each range ends at its last measured size;
        the last rule has ``max_bytes`` ``None``.
    Raises:
        ValueError: no usable timings, or a negative ``noise``.
    """
    if noise < 0:
        raise ValueError(f"noise must be >= 0, not {noise!r}")
    sizes, excess = _excess_over_noise(timings, noise)
    labels = _label_sizes(excess, _preference_key(preference), single_range)
    rules: list[dict] = []
    for i, (nbytes, name) in enumerate(zip(sizes, labels, strict=True)):
        if i + 1 < len(sizes) and labels[i + 1] == name:
            continue
        rules.append({"max_bytes": None if i + 1 == len(sizes) else nbytes, "algorithm": name})
    return rules


def slowdowns(timings: Mapping[int, Mapping[str, float]], rules: list[dict],
              noise: float = NOISE) -> list[dict]:
    """The measured sizes where ``rules`` choose an algorithm slower than noise allows.

    Returns:
        ``[{"nbytes", "algorithm", "slowdown", "fastest"}]``: ``slowdown`` is the chosen
        algorithm's time over the fastest one's (rounded to 0.01).
    """
    table = TuningTable({"collectives": {"x": [{"world_size": 1, "rules": rules}]}})
    out = []
    for nbytes in sorted(timings):
        times = {a: t for a, t in timings[nbytes].items() if t is not None and t > 0}
        if not times:
            continue
        chosen = table.lookup("x", 1, 0, nbytes)
        fastest = min(times, key=times.get)
        ratio = times[chosen] / times[fastest] if chosen in times else float("inf")
        if ratio > 1.0 + noise:
            out.append({"nbytes": nbytes, "algorithm": chosen, "slowdown": round(ratio, 2),
                        "fastest": fastest})
    return out


def merge_tables(tables: Iterable[TuningTable | Mapping]) -> TuningTable:
    """One table holding every entry of ``tables``; later tables win on the same key."""
    merged: dict[str, dict[tuple[int, int], dict]] = {}
    meta: dict = {}
    for t in tables:
        d = t.to_dict() if isinstance(t, TuningTable) else TuningTable(t).to_dict()
        for coll, entries in d["collectives"].items():
            for e in entries:
                merged.setdefault(coll, {})[(e["world_size"], e["ranks_per_node"])] = e
        runs = meta.setdefault("runs", [])
        runs.extend(d["meta"].get("runs", [d["meta"]] if d["meta"] else []))
    colls = {c: [e for _, e in sorted(v.items())] for c, v in sorted(merged.items())}
    return TuningTable({"format": FORMAT, "meta": meta, "collectives": colls}, "<merged>")
