"""Soak: random collectives, each checked against an independent numpy reference.

Usage (from the repository root)::

    mpirun -n N python -m bench.soak --count 10000 --seed S [--max-count 1048576]
        [--max-seconds T] [--json out.json] [--start K] [--inject-fault K]

Call ``i`` is drawn from ``(seed, i)`` alone (:func:`draw_call`), so every rank draws the
same sequence without communicating and ``--start i --count 1`` replays one call: the
collective, the algorithm (every registered one, ``"auto"`` and ``"native"``), the API
(the public function, ``mpicoll.Comm``'s method, or ``allreduce_init``), dtype, op,
element count (log-uniform in ``0..--max-count``), root, in place or not, output given or
``None``, checked mode, one or two repetitions on the same buffers, and the communicator:
the world or one of the split communicators made once at start from the seed
(:func:`make_layouts`: random colours and keys, ranks left out, groups of one).

Rank ``r``'s input to call ``i`` is generated from ``(seed, i, repetition, r)``
(:func:`make_input`), so every rank generates its group's inputs itself and computes the
expected result with numpy (:func:`expected_output`): no mpicoll call, no message. Values
make every reduction exact (integers in a range whose sums cannot overflow or round;
products of +-1, 2 and 1/2), compared exactly; sums of random reals and float averages are
compared within a bound derived from the dtype's epsilon. The send buffer must come back
unchanged, a given output must hold the result (it is first filled with a sentinel), a
non-root ``reduce`` must return ``None``; real-valued all-reduce results must be
bit-identical on every rank of the group (digests compared at the end).

Rank 0 prints the summary (calls per collective and algorithm, coverage, throughput,
mismatches with the full description of the first few) and ``--json`` writes it; the exit
status is 1 on any mismatch. A call that raises aborts the job with its description; a call
that stalls past ``--stall-seconds`` too.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.common import Progress, parse_args, run_meta

MODULE = "soak"

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")

#: dtype name -> weight of the draw.
DTYPE_WEIGHTS = {"float32": 16, "float64": 14, "int32": 14, "int64": 14, "float16": 8,
                 "int8": 6, "uint16": 6, "uint64": 6, "complex64": 5, "complex128": 5,
                 "bool": 6}

#: ops by numpy dtype kind.
OPS_BY_KIND = {
    "f": ("sum", "prod", "min", "max", "average"),
    "c": ("sum", "prod", "average"),
    "i": ("sum", "prod", "min", "max", "average", "band", "bor", "bxor"),
    "u": ("sum", "prod", "min", "max", "average", "band", "bor", "bxor"),
    "b": ("band", "bor", "bxor"),
}

#: The reference's own ufuncs (not mpicoll's op table): op -> numpy ufunc.
UFUNCS = {"sum": np.add, "average": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
          "bxor": np.bitwise_xor}

#: Random streams derived from the seed.
PLAN_STREAM, DATA_STREAM, LAYOUT_STREAM = 1, 2, 3

#: Count buckets of the coverage report (upper bounds, elements).
COUNT_BUCKETS = (0, 15, 255, 4095, 65535, 1 << 40)

#: Byte pattern of output buffers before a call (catches outputs left unwritten).
SENTINEL_BYTE = 0xA5


# -- communicators ------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One communicator of the soak: world ranks' colours (-1: left out) and keys."""

    name: str
    colors: tuple[int, ...]
    keys: tuple[int, ...]

    def members(self, world_rank: int) -> list[int]:
        """World ranks of ``world_rank``'s group in group-rank order (key, then world rank,
        as ``MPI_Comm_split`` orders them); ``[]`` when it is left out."""
        color = self.colors[world_rank]
        if color < 0:
            return []
        group = [r for r, c in enumerate(self.colors) if c == color]
        return sorted(group, key=lambda r: (self.keys[r], r))


def make_layouts(seed: int, world_size: int) -> list[Layout]:
    """The world and three splits drawn from ``seed``: two non-empty groups of random
    members; random colours with ranks left out; every rank alone. Keys are random, so
    group order differs from world order."""
    rng = np.random.default_rng([seed, LAYOUT_STREAM])
    n = world_size

    def keys() -> tuple[int, ...]:
        return tuple(int(k) for k in rng.integers(0, 3 * n, n))

    cut = int(rng.integers(1, n)) if n > 1 else 1
    halves = tuple(int(g >= cut) for g in np.argsort(rng.permutation(n)))
    ncolors = int(rng.integers(1, n + 1))
    scattered = [int(c) if rng.random() > 0.15 else -1 for c in rng.integers(0, ncolors, n)]
    if all(c < 0 for c in scattered):
        scattered[0] = 0
    return [Layout("world", (0,) * n, tuple(range(n))),
            Layout("split-two", halves, keys()),
            Layout("split-random", tuple(scattered), keys()),
            Layout("split-singletons", tuple(range(n)), keys())]


def create_comms(MPI: Any, layouts: list[Layout]) -> list[Any]:
    """Each layout's communicator on this rank (``MPI.COMM_NULL`` where it is left out),
    checked against the layout's own idea of the group."""
    world = MPI.COMM_WORLD
    comms = []
    for layout in layouts:
        if layout.name == "world":
            comm = world
        else:
            color = layout.colors[world.rank]
            comm = world.Split(color if color >= 0 else MPI.UNDEFINED, layout.keys[world.rank])
        members = layout.members(world.rank)
        if members and (comm.Get_size() != len(members)
                        or comm.Get_rank() != members.index(world.rank)):
            raise RuntimeError(f"{layout.name}: split does not match its layout")
        comms.append(comm)
    return comms


# -- the plan -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One drawn call (the same on every rank)."""

    index: int
    collective: str
    api: str             # "function", "Comm", "init" (allreduce_init)
    algorithm: str
    dtype: str
    op: str | None       # None for allgather and broadcast
    count: int           # elements of the full vector (allgather: count // size per rank)
    root_draw: int       # the root is root_draw % group size
    in_place: str        # "no", "IN_PLACE", "same" (sendbuf is recvbuf)
    output: str          # "given" or "none" (the call allocates it)
    values: str          # "exact" or "real" (random reals: compared within a tolerance)
    layout: int          # index into make_layouts()
    repeats: int         # calls on the same buffers (fresh data each time)
    check: bool          # checked mode
    spec: bool           # Comm API: buffers as [array, MPI datatype]

    def root(self, group_size: int) -> int:
        """The root in a group of ``group_size`` ranks."""
        return self.root_draw % group_size


def log_uniform_count(rng: np.random.Generator, max_count: int) -> int:
    """An element count in ``0..max_count``, log-uniform: most are small, some large."""
    return min(max_count, int(math.exp(rng.uniform(0.0, math.log(max_count + 1)))) - 1)


def _pick(rng: np.random.Generator, choices: Any) -> Any:
    return choices[int(rng.integers(0, len(choices)))]


def draw_call(seed: int, index: int, max_count: int, world_size: int,
              algorithms: dict[str, list[str]], n_layouts: int) -> Call:
    """Call ``index`` of the soak with ``seed``: a function of its arguments only."""
    rng = np.random.default_rng([seed, PLAN_STREAM, index])
    collective = _pick(rng, COLLECTIVES)
    algorithm = _pick(rng, ["auto", *algorithms[collective]])
    names = list(DTYPE_WEIGHTS)
    weights = np.array([DTYPE_WEIGHTS[d] for d in names], dtype=float)
    dtype = str(rng.choice(names, p=weights / weights.sum()))
    kind = np.dtype(dtype).kind
    apis = ["function", "function", "Comm"] + (["init"] if collective == "allreduce" else [])
    api = _pick(rng, apis)
    op = None
    if collective in ("allreduce", "reduce_scatter", "reduce"):
        ops = [o for o in OPS_BY_KIND[kind] if not (api == "Comm" and o == "average")]
        op = _pick(rng, ops)
    if collective == "broadcast":
        in_place = "no"
    else:
        in_place = _pick(rng, ["no", "no", "IN_PLACE", "same"])
        if in_place == "same" and (api == "Comm" or collective not in ("allreduce", "reduce")):
            in_place = "IN_PLACE"
    output = "given"
    if in_place == "no" and collective != "broadcast" and api != "Comm":
        output = _pick(rng, ["given", "none"])
    real = kind in "fc" and op in ("sum", "average") and rng.random() < 0.5
    return Call(index=index, collective=collective, api=api, algorithm=algorithm,
                dtype=dtype, op=op, count=log_uniform_count(rng, max_count),
                root_draw=int(rng.integers(0, max(world_size, 1))), in_place=in_place,
                output=output, values="real" if real else "exact",
                layout=int(rng.integers(0, n_layouts)) if rng.random() < 0.4 else 0,
                repeats=2 if rng.random() < 0.2 else 1, check=bool(rng.random() < 0.1),
                spec=api == "Comm" and dtype in ("float32", "float64", "int32", "int64")
                and bool(rng.random() < 0.5))


def describe(call: Call, seed: int, layout: Layout, members: list[int], replay: str) -> str:
    """Everything about ``call`` as seen from one group, with the command that replays it
    (``replay``: the soak's command line up to ``--start``)."""
    fields = {k: v for k, v in asdict(call).items() if k not in ("index", "root_draw",
                                                                  "layout")}
    size = max(len(members), 1)
    where = (f"comm={layout.name} (world ranks {members} in group order)" if members
             else f"comm={layout.name} (not a member)")
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    return (f"iteration {call.index} (seed {seed}): {text} root={call.root(size)} {where}; "
            f"replay: {replay} --start {call.index} --count 1")


# -- data and reference ----------------------------------------------------------------------
def block_count(call: Call, group_size: int) -> int:
    """Elements of one rank's input: the full vector, or its all-gather block."""
    return call.count // group_size if call.collective == "allgather" else call.count


def _prod_values(dt: np.dtype, world_size: int) -> list[Any]:
    """Factors whose products over ``world_size`` ranks are exact in ``dt``."""
    if dt.kind == "c":
        return [1, -1, 2, 0.5, 1j, -1j]
    if dt.kind == "f":
        return [1, -1, 2, 0.5] if world_size <= 14 else [1, -1]
    big = 2 ** world_size <= np.iinfo(dt).max
    if dt.kind == "u":
        return [0, 1, 2] if big else [0, 1]
    return [1, -1, 2] if big else [1, -1]


def _exact_bound(dt: np.dtype, world_size: int) -> int:
    """Largest magnitude whose sums over ``world_size`` ranks are exact in ``dt``."""
    if dt.kind in "fc":
        return 2 ** (np.finfo(dt).nmant + 1) // world_size
    return int(np.iinfo(dt).max) // world_size


def _random_bits(rng: np.random.Generator, dt: np.dtype, n: int) -> np.ndarray:
    raw = np.frombuffer(bytearray(rng.bytes(n * dt.itemsize)), dtype=np.uint8)
    if dt.kind == "b":
        return (raw & 1).view(bool)
    return raw.view(dt)


def _exact_values(rng: np.random.Generator, dt: np.dtype, n: int,
                  world_size: int) -> np.ndarray:
    bound = _exact_bound(dt, world_size)
    if dt.kind in "iu":
        return rng.integers(0 if dt.kind == "u" else -bound, bound, n, dtype=dt,
                            endpoint=True)
    out = rng.integers(-bound, bound, n, endpoint=True).astype(dt)
    if dt.kind == "c":
        out += 1j * rng.integers(-bound, bound, n, endpoint=True)
    return out


def make_input(seed: int, call: Call, rep: int, world_rank: int, n: int,
               world_size: int) -> np.ndarray:
    """World rank ``world_rank``'s ``n`` input elements to repetition ``rep`` of ``call``."""
    rng = np.random.default_rng([seed, DATA_STREAM, call.index, rep, world_rank])
    dt = np.dtype(call.dtype)
    if call.op is None or call.op in ("band", "bor", "bxor"):
        return _random_bits(rng, dt, n)
    if call.op == "prod":
        values = np.array(_prod_values(dt, world_size))
        return values[rng.integers(0, len(values), n)].astype(dt)
    if call.op in ("min", "max"):
        if dt.kind == "f":
            return (rng.standard_normal(n) * 1000).astype(dt)
        return _random_bits(rng, dt, n)
    if call.values == "real":
        out = rng.uniform(-1, 1, n).astype(dt)
        if dt.kind == "c":
            out += 1j * rng.uniform(-1, 1, n).astype(dt)
        return out
    return _exact_values(rng, dt, n, world_size)


@dataclass
class Expected:
    """What one output must hold: ``value`` (``None``: the output must be ``None``);
    ``tol`` an elementwise bound (``None``: exact); ``bits``: compared as bytes."""

    value: np.ndarray | None
    tol: np.ndarray | None = None
    bits: bool = False
    dtype: np.dtype | None = None   # the output's dtype, where ``value`` is wider


def _wide(dt: np.dtype) -> type:
    return np.complex128 if dt.kind == "c" else np.float64


def reference_reduce(inputs: list[np.ndarray], op: str, values: str) -> Expected:
    """Reduce ``inputs`` (in group-rank order) with numpy: exactly, or for real values and
    float averages in double precision with a bound derived from the dtype's epsilon."""
    dt, n = inputs[0].dtype, len(inputs)
    if values == "real" or (op == "average" and dt.kind in "fc"):
        wide = [x.astype(_wide(dt)) for x in inputs]
        total = np.sum(wide, axis=0)
        eps = float(np.finfo(dt).eps)
        tol = 2.0 * n * eps * np.sum(np.abs(wide), axis=0) if values == "real" else 0.0
        if op == "average":
            total, tol = total / n, tol / n
        return Expected(total, tol + eps * np.abs(total) + n * float(np.finfo(dt).tiny),
                        dtype=dt)
    acc = inputs[0].copy()
    for x in inputs[1:]:
        UFUNCS[op](acc, x, out=acc)
    if op == "average":
        np.floor_divide(acc, n, out=acc)
    return Expected(acc)


def split_bounds(count: int, size: int) -> list[int]:
    """Block boundaries of ``numpy.array_split`` (computed here, not by mpicoll)."""
    base, extra = divmod(count, size)
    return [i * base + min(i, extra) for i in range(size + 1)]


def expected_output(call: Call, group_rank: int, size: int,
                    inputs: Callable[[int], np.ndarray]) -> Expected:
    """The result ``call`` must give group rank ``group_rank`` (``inputs(g)``: group rank
    ``g``'s input, generated on demand)."""
    root = call.root(size)
    if call.collective == "broadcast":
        return Expected(inputs(root), bits=True)
    if call.collective == "allgather":
        return Expected(np.concatenate([inputs(g) for g in range(size)]), bits=True)
    if call.collective == "reduce" and group_rank != root:
        return Expected(None)
    full = reference_reduce([inputs(g) for g in range(size)], call.op, call.values)
    if call.collective == "reduce_scatter":
        lo, hi = split_bounds(call.count, size)[group_rank:group_rank + 2]
        tol = None if full.tol is None else full.tol[lo:hi]
        return Expected(full.value[lo:hi], tol, dtype=full.dtype)
    return full


def mismatch(actual: Any, expected: Expected) -> str | None:
    """Why ``actual`` is not ``expected`` (``None`` when it is)."""
    want = expected.value
    if want is None:
        return None if actual is None else f"got {type(actual).__name__}, expected None"
    if not isinstance(actual, np.ndarray):
        return f"got {type(actual).__name__}, expected an array"
    dtype = expected.dtype if expected.dtype is not None else want.dtype
    if actual.dtype != dtype:
        return f"dtype {actual.dtype}, expected {dtype}"
    flat = actual.reshape(-1)
    if flat.size != want.size:
        return f"{flat.size} elements, expected {want.size}"
    if not want.size:
        return None
    if expected.bits:
        if np.array_equal(flat.view(np.uint8), want.view(np.uint8)):
            return None
        bad = (flat.view(np.uint8).reshape(want.size, -1)
               != want.view(np.uint8).reshape(want.size, -1)).any(axis=1)
    elif expected.tol is not None:
        bad = ~(np.abs(flat.astype(want.dtype) - want) <= expected.tol)
    elif np.array_equal(flat, want):
        return None
    else:
        bad = flat != want
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    return (f"{int(bad.sum())} of {want.size} elements differ, first at {first}: "
            f"got {flat[first]!r}, expected {want[first]!r}")


# -- running one call -----------------------------------------------------------------------
class Case:
    """This rank's buffers and invocation of one call (reused across its repetitions)."""

    def __init__(self, call: Call, comm: Any, wrapper: Any, members: list[int],
                 group_rank: int, MPI: Any) -> None:
        self.call, self.comm, self.wrapper, self.MPI = call, comm, wrapper, MPI
        self.size, self.rank = len(members), group_rank
        self.root = call.root(self.size)
        self.dt = np.dtype(call.dtype)
        self.n_in = block_count(call, self.size)
        self.bounds = split_bounds(call.count, self.size)
        in_place = call.in_place != "no" and (call.collective != "reduce"
                                              or self.rank == self.root)
        self.in_place = in_place
        moves_only = call.collective == "broadcast"   # buf is both input and output
        self.send = None if in_place or moves_only else np.empty(self.n_in, self.dt)
        self.recv = self._make_recv()
        self.init_call: Callable[[], Any] | None = None

    def _make_recv(self) -> np.ndarray | None:
        c = self.call
        if c.collective == "broadcast":
            return np.empty(c.count, self.dt)
        if c.output == "none" and not self.in_place:
            return None
        if c.collective == "reduce" and self.rank != self.root:
            return None
        size = {"allreduce": c.count, "reduce": c.count, "allgather": self.n_in * self.size,
                "reduce_scatter": c.count if self.in_place else self.block_size()}
        return np.empty(size[c.collective], self.dt)

    def block_size(self) -> int:
        """Elements of this rank's reduce-scatter block."""
        return self.bounds[self.rank + 1] - self.bounds[self.rank]

    def load(self, x: np.ndarray) -> None:
        """Put this rank's input ``x`` where the call reads it; the rest of the output
        gets the sentinel."""
        if self.recv is not None:
            self.recv.view(np.uint8)[...] = SENTINEL_BYTE
        if self.call.collective == "broadcast":
            if self.rank == self.root:
                self.recv[...] = x
        elif not self.in_place:
            self.send[...] = x
        elif self.call.collective == "allgather":
            self.recv[self.rank * self.n_in:(self.rank + 1) * self.n_in] = x
        else:
            self.recv[...] = x

    def _sendbuf(self) -> Any:
        if not self.in_place:
            return self.send
        return self.recv if self.call.in_place == "same" else self.MPI.IN_PLACE

    def invoke(self) -> Any:
        """Run the call; return what it returned."""
        if self.call.api == "Comm":
            return self._invoke_comm()
        if self.call.api == "init":
            if self.init_call is None:
                self.init_call = self._mpicoll().allreduce_init(
                    self._sendbuf(), self.recv, self.call.op, self.comm, self.call.algorithm,
                    check=self.call.check)
            return self.init_call()
        return self._invoke_function()

    @staticmethod
    def _mpicoll() -> Any:
        import mpicoll  # noqa: PLC0415

        return mpicoll

    def _invoke_function(self) -> Any:
        c, m = self.call, self._mpicoll()
        kw = {"comm": self.comm, "algorithm": c.algorithm, "check": c.check}
        if c.collective == "allreduce":
            return m.allreduce(self._sendbuf(), self.recv, c.op, **kw)
        if c.collective == "reduce_scatter":
            return m.reduce_scatter(self._sendbuf(), self.recv, c.op, **kw)
        if c.collective == "allgather":
            return m.allgather(self._sendbuf(), self.recv, **kw)
        if c.collective == "broadcast":
            return m.broadcast(self.recv, self.root, **kw)
        return m.reduce(self._sendbuf(), self.recv, c.op, self.root, **kw)

    def _spec(self, buf: Any) -> Any:
        if not self.call.spec or buf is None or buf is self.MPI.IN_PLACE:
            return buf
        predefined = {"float32": self.MPI.FLOAT, "float64": self.MPI.DOUBLE,
                      "int32": self.MPI.INT32_T, "int64": self.MPI.INT64_T}
        return [buf, predefined[self.call.dtype]]

    def _invoke_comm(self) -> None:
        c, w, MPI = self.call, self.wrapper, self.MPI
        op = getattr(MPI, c.op.upper()) if c.op else None
        send, recv = self._spec(self._sendbuf()), self._spec(self.recv)
        if c.collective == "allreduce":
            return w.Allreduce(send, recv, op)
        if c.collective == "reduce_scatter":
            if c.count % self.size == 0:
                return w.Reduce_scatter_block(send, recv, op)
            counts = [self.bounds[g + 1] - self.bounds[g] for g in range(self.size)]
            return w.Reduce_scatter(send, recv, counts, op)
        if c.collective == "allgather":
            return w.Allgather(send, recv)
        if c.collective == "broadcast":
            return w.Bcast(recv, self.root)
        return w.Reduce(send, recv, op, self.root)

    def outputs(self, returned: Any) -> list[tuple[str, Any]]:
        """(label, array) of every output to check against the expected result."""
        c, found = self.call, []
        if c.api != "Comm":
            found.append(("returned value", returned))
        if self.recv is not None and (c.api == "Comm" or c.output == "given"):
            region = self.recv
            if c.collective == "reduce_scatter" and self.in_place:
                region = self.recv[:self.block_size()]
            found.append(("recvbuf" if c.collective != "broadcast" else "buf", region))
        return found

    def bytes_moved(self) -> int:
        """Payload bytes of the call on this rank (the full vector)."""
        return self.call.count * self.dt.itemsize


# -- the soak loop ----------------------------------------------------------------------------
@dataclass
class Mismatch:
    """One failed check on one rank."""

    iteration: int
    repetition: int
    world_rank: int
    output: str
    reason: str
    call: str


class Watchdog:
    """Aborts the job when one call runs longer than ``limit`` seconds, naming it."""

    def __init__(self, MPI: Any, limit: float) -> None:
        self.MPI, self.limit = MPI, limit
        self.current, self.since = "start-up", time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, what: str) -> None:
        self.current, self.since = what, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            stuck = time.monotonic() - self.since
            if stuck > self.limit:
                print(f"soak: STALL: rank {self.MPI.COMM_WORLD.rank} stuck {stuck:.0f} s in "
                      f"{self.current}", file=sys.stderr, flush=True)
                self.MPI.COMM_WORLD.Abort(3)
                os._exit(3)  # Abort may return before the job is torn down


class Soak:
    """The state of one soak run on this rank."""

    def __init__(self, args: argparse.Namespace, MPI: Any) -> None:
        import mpicoll  # noqa: PLC0415

        self.args, self.MPI, self.mpicoll = args, MPI, mpicoll
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.rank, self.world.size
        self.layouts = make_layouts(args.seed, self.size)
        self.comms = create_comms(MPI, self.layouts)
        self.algorithms = {c: mpicoll.algorithms(c) for c in COLLECTIVES}
        self.wrappers: dict[tuple, Any] = {}
        self.mismatches: list[Mismatch] = []
        self.digests: dict[tuple[int, int], int] = {}
        self.stats: dict[str, Counter] = {k: Counter() for k in (
            "calls", "bytes", "seconds", "api", "dtype", "op", "group_size", "in_place",
            "output", "values", "repeats", "checked", "count")}
        self.done = 0
        self.plan_digest = 0   # crc32 of every drawn call: must be the same on every rank
        self.replay = (f"mpirun -n {self.size} python -m bench.soak --seed {args.seed} "
                       f"--max-count {args.max_count}")

    def plan(self, index: int) -> Call:
        return draw_call(self.args.seed, index, self.args.max_count, self.size,
                         self.algorithms, len(self.layouts))

    def _wrapper(self, call: Call) -> Any:
        key = (call.layout, call.algorithm, call.check)
        if key not in self.wrappers:
            self.wrappers[key] = self.mpicoll.Comm(self.comms[call.layout], call.algorithm,
                                                   check=call.check)
        return self.wrappers[key]

    def run_call(self, call: Call) -> None:
        """Run ``call`` on this rank's group (if any) and check every repetition."""
        layout = self.layouts[call.layout]
        members = layout.members(self.rank)
        self._count(call, members)
        if not members:
            return
        desc = describe(call, self.args.seed, layout, members, self.replay)
        group_rank = members.index(self.rank)
        case = Case(call, self.comms[call.layout],
                    self._wrapper(call) if call.api == "Comm" else None, members, group_rank,
                    self.MPI)
        for rep in range(call.repeats):
            inputs = self._inputs(call, rep, members, case.n_in)
            case.load(inputs(group_rank))
            returned = self._timed_invoke(case, desc)
            self._check(call, rep, case, returned, inputs, desc)

    def _inputs(self, call: Call, rep: int, members: list[int],
                n: int) -> Callable[[int], np.ndarray]:
        cache: dict[int, np.ndarray] = {}

        def of(group_rank: int) -> np.ndarray:
            if group_rank not in cache:
                cache[group_rank] = make_input(self.args.seed, call, rep, members[group_rank],
                                               n, self.size)
            return cache[group_rank]
        return of

    def _timed_invoke(self, case: Case, desc: str) -> Any:
        self.watchdog.beat(desc)
        t0 = time.perf_counter()
        try:
            returned = case.invoke()
        except Exception:  # noqa: BLE001  (the other ranks would wait: end the job)
            print(f"soak: rank {self.rank} raised in {desc}\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            self.MPI.COMM_WORLD.Abort(2)
            os._exit(2)  # Abort may return before the job is torn down
        elapsed = time.perf_counter() - t0
        key = f"{case.call.collective}/{case.call.algorithm}"
        self.stats["seconds"][key] += elapsed
        self.stats["bytes"][key] += case.bytes_moved()
        return returned

    def _check(self, call: Call, rep: int, case: Case, returned: Any,
               inputs: Callable[[int], np.ndarray], desc: str) -> None:
        expected = expected_output(call, case.rank, case.size, inputs)
        checks = [(label, out, expected) for label, out in case.outputs(returned)]
        if case.send is not None:
            checks.append(("sendbuf (must be unchanged)", case.send,
                           Expected(inputs(case.rank), bits=True)))
        for n, (label, actual, want) in enumerate(checks):
            if n == 0 and rep == 0 and self._faulty(call, case):
                actual = corrupt(actual)
            reason = mismatch(actual, want)
            if reason is not None:
                self.mismatches.append(Mismatch(call.index, rep, self.rank, label, reason,
                                                desc))
                return
        if call.values == "real" and call.collective == "allreduce":
            self.digests[(call.index, rep)] = zlib.crc32(np.ascontiguousarray(
                checks[0][1]).view(np.uint8).tobytes())

    def _faulty(self, call: Call, case: Case) -> bool:
        """Whether this rank corrupts ``call``'s first checked output (``--inject-fault``):
        the lowest world rank that takes part in the call."""
        if call.index != self.args.inject_fault:
            return False
        layout = self.layouts[call.layout]
        return self.rank == min(r for r, c in enumerate(layout.colors) if c >= 0)

    def _count(self, call: Call, members: list[int]) -> None:
        s = self.stats
        s["calls"][f"{call.collective}/{call.algorithm}"] += 1
        s["api"][call.api if call.api != "Comm" else f"Comm ({call.collective})"] += 1
        s["dtype"][call.dtype] += 1
        s["op"][call.op or "-"] += 1
        s["group_size"][str(len(members)) if members else "left out"] += 1
        s["in_place"][call.in_place] += 1
        s["output"][call.output] += 1
        s["values"][call.values] += 1
        s["repeats"][str(call.repeats)] += 1
        s["checked"][str(call.check)] += 1
        s["count"][count_bucket(call.count)] += 1

    def run(self) -> float:
        """Run the planned calls; return the wall time. Rank 0 decides when
        ``--max-seconds`` is up (checked every 16 calls, so all ranks stop together)."""
        args = self.args
        self.watchdog = Watchdog(self.MPI, args.stall_seconds)
        progress = Progress(self.rank == 0 and not args.quiet, "soak", args.count, every=10.0)
        self.world.Barrier()
        start = time.monotonic()
        for k in range(args.count):
            if k % 16 == 0 and args.max_seconds is not None:
                late = time.monotonic() - start > args.max_seconds
                if self.world.bcast(late if self.rank == 0 else None, root=0):
                    break
            call = self.plan(args.start + k)
            self.plan_digest = zlib.crc32(repr(call).encode(), self.plan_digest)
            self.run_call(call)
            self.done = k + 1
            progress.step(self.done, f"calls, {len(self.mismatches)} mismatches on rank 0")
        self.watchdog.beat("the end-of-run barrier")
        self.world.Barrier()
        return time.monotonic() - start

    def identity_mismatches(self, all_digests: list[dict]) -> list[Mismatch]:
        """Real-valued all-reduce results that are not bit-identical across a group."""
        found = []
        by_call: dict[tuple[int, int], dict[int, int]] = {}
        for rank, digests in enumerate(all_digests):
            for key, crc in digests.items():
                by_call.setdefault(key, {})[rank] = crc
        for (index, rep), crcs in sorted(by_call.items()):
            call = self.plan(index)
            layout = self.layouts[call.layout]
            for group in _groups(layout):
                seen = {crcs[r] for r in group if r in crcs}
                if len(seen) > 1:
                    found.append(Mismatch(index, rep, group[0], "returned value",
                                          "not bit-identical across the group",
                                          describe(call, self.args.seed, layout, group,
                                                   self.replay)))
        return found


def plan_mismatches(digests: list[int]) -> list[Mismatch]:
    """A mismatch for each rank whose sequence of calls differs from rank 0's."""
    return [Mismatch(-1, 0, rank, "plan", f"drew another sequence of calls than rank 0 "
                     f"(digest {d:#x}, rank 0 {digests[0]:#x})", "the whole run")
            for rank, d in enumerate(digests) if d != digests[0]]


def _groups(layout: Layout) -> list[list[int]]:
    return [layout.members(r) for r in range(len(layout.colors))
            if layout.colors[r] >= 0 and layout.members(r)[0] == r]


def corrupt(actual: Any) -> Any:
    """A wrong copy of ``actual`` (for ``--inject-fault``): one element changed, or one
    element more where there is none, or an array where ``None`` was due."""
    if not isinstance(actual, np.ndarray):
        return np.zeros(1)
    if actual.size == 0:
        return np.zeros(1, actual.dtype)
    bad = actual.reshape(-1).copy()
    bad.view(np.uint8)[0] ^= 1
    return bad


def count_bucket(count: int) -> str:
    """The coverage bucket of an element count."""
    lo = 0
    for hi in COUNT_BUCKETS:
        if count <= hi:
            return f"{lo}-{hi}" if hi < 1 << 40 else f">={lo}"
        lo = hi + 1
    return "?"


# -- summary ----------------------------------------------------------------------------------
def summarize(soak: Soak, wall: float, mismatches: list[Mismatch], total: int,
              argv: list[str]) -> dict:
    """The run's summary (rank 0): what was run, throughput, coverage, mismatches."""
    s, args = soak.stats, soak.args
    calls, nbytes = soak.done, sum(s["bytes"].values())
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("MPICOLL_")}
    return {
        "meta": run_meta(soak.MPI, soak.size, MODULE, argv),
        "seed": args.seed, "start": args.start, "world_size": soak.size,
        "max_count": args.max_count, "requested_calls": args.count, "calls": calls,
        "stopped_by_max_seconds": calls < args.count, "environment": env,
        "layouts": [asdict(layout) for layout in soak.layouts],
        "wall_s": round(wall, 3), "collective_s_rank0": round(sum(s["seconds"].values()), 3),
        "calls_per_s": round(calls / wall, 2) if wall else None,
        "payload_bytes_rank0": nbytes,
        "payload_bytes_per_s_rank0": round(nbytes / wall, 1) if wall else None,
        "plan_digest": f"{soak.plan_digest:#010x}", "mismatches": total,
        "first_mismatches": [asdict(m) for m in mismatches[:args.show]],
        "by_algorithm": {k: {"calls": s["calls"][k], "payload_bytes_rank0": s["bytes"][k],
                             "seconds_rank0": round(s["seconds"][k], 3)}
                         for k in sorted(s["calls"])},
        "coverage": {k: dict(sorted(s[k].items())) for k in s
                     if k not in ("calls", "bytes", "seconds")},
    }


def format_summary(summary: dict) -> str:
    """The summary as rank 0 prints it."""
    stopped = " (stopped by --max-seconds)" if summary["stopped_by_max_seconds"] else ""
    lines = [(f"# soak: seed {summary['seed']}, {summary['world_size']} ranks, "
              f"{summary['calls']} calls from iteration {summary['start']}{stopped}, "
              f"counts 0..{summary['max_count']}"),
             f"# {summary['meta']['mpi_library']}; {summary['meta']['thread_level']}",
             f"# {'collective/algorithm':<36s}{'calls':>8s}{'payload MB':>12s}{'seconds':>10s}"]
    for key, row in summary["by_algorithm"].items():
        lines.append(f"  {key:<36s}{row['calls']:8d}"
                     f"{row['payload_bytes_rank0'] / 1e6:12.1f}"
                     f"{row['seconds_rank0']:10.2f}")
    for key, counts in summary["coverage"].items():
        lines.append(f"# {key}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    lines.append(f"# wall {summary['wall_s']:.1f} s, {summary['calls_per_s']} calls/s, "
                 f"{summary['payload_bytes_per_s_rank0'] / 1e6:.2f} MB/s payload per rank, "
                 f"{summary['collective_s_rank0']:.1f} s inside collectives (rank 0)")
    for m in summary["first_mismatches"]:
        lines.append(f"MISMATCH rank {m['world_rank']} repetition {m['repetition']} "
                     f"{m['output']}: {m['reason']}\n    {m['call']}")
    lines.append(f"# mismatches: {summary['mismatches']}")
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="calls to run (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--start", type=int, default=0,
                        help="first iteration (replay one call: --start K --count 1)")
    parser.add_argument("--max-count", type=int, default=1 << 20,
                        help="largest element count (default 1048576)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop after this many seconds (whole calls; default: no limit)")
    parser.add_argument("--stall-seconds", type=float, default=300.0,
                        help="abort when one call takes longer (default 300)")
    parser.add_argument("--inject-fault", type=int, default=None, metavar="K",
                        help="corrupt iteration K's output on one rank (tests the checks)")
    parser.add_argument("--show", type=int, default=5, help="mismatches printed (default 5)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the summary here")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    from mpi4py import MPI  # noqa: PLC0415

    soak = Soak(args, MPI)
    wall = soak.run()
    gathered = soak.world.gather((soak.mismatches, soak.digests, soak.plan_digest,
                                  soak.stats["group_size"]), root=0)
    if soak.rank != 0:
        return 0 if not soak.mismatches else 1
    found = sorted((m for mine, _, _, _ in gathered for m in mine),
                   key=lambda m: (m.iteration, m.repetition, m.world_rank))
    found += soak.identity_mismatches([d for _, d, _, _ in gathered])
    found += plan_mismatches([p for _, _, p, _ in gathered])
    summary = summarize(soak, wall, found, len(found), args.argv)
    summary["coverage"]["group_size_all_ranks"] = dict(sorted(
        sum((sizes for _, _, _, sizes in gathered), Counter()).items()))
    print(format_summary(summary), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)
            fh.write("\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
