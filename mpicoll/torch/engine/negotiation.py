"""Negotiation: which requests every rank has submitted, in one order all ranks share.

Pure bookkeeping, no MPI. Every negotiation round, each rank contributes the requests it
submitted since the previous round; the engine all-gathers them, so every rank feeds the
same ``payloads`` into :meth:`Negotiator.process` and gets the same responses in the same
order (the order in which entries entered the shared table: by round, then rank, then the
rank's own submission order). That order, not the order in which gradient hooks happened
to fire on each rank, decides fusion and execution.

Rules:

- An entry completes when every rank that has not joined has submitted it; ranks that
  called ``join()`` take part in all-reduces with zeros; all-gather, broadcast,
  all-to-all and reduce-scatter fail on every rank while a rank has joined (as Horovod's).
- A completed entry whose ranks disagree (kind, dtype, shape, op, scaling, root) becomes
  an error response, identical on every rank.
- ``join`` completes when every rank has joined.
- ``shutdown`` is not negotiated: as in Horovod, one rank asking is enough. The round that
  carries a rank's ``shutdown`` first runs what completed in it, then ends with one
  ``shutdown`` response (the ranks that asked, and why): every engine stops, and every
  request still incomplete fails on every rank with :func:`shutdown_message`, which names
  the ranks that left.
- Deadlock: when a round completes nothing, every rank that has not joined is blocked
  waiting for a result, and some entries are incomplete, no rank can submit what is missing
  (a rank's thread submits before it waits), so every incomplete entry fails on every rank,
  naming who submitted it and who did not.
"""
from __future__ import annotations

import re
import time
from typing import Callable, NamedTuple

from ..ops import ReduceOp

__all__ = ["Meta", "Response", "Negotiator", "ResponseCache", "JOIN", "SHUTDOWN", "REALIGN",
           "shutdown_message"]

JOIN = "__join__"
SHUTDOWN = "__shutdown__"
#: The response that realigns every rank's numbering of unnamed requests after a deadlock
#: (:meth:`mpicoll.torch.engine.core.Engine.realign_unnamed`); it runs before the round's
#: error responses wake anyone up.
REALIGN = "__realign__"

#: An unnamed request's name (``mpicoll.torch.mpi_ops.request_name``): ``allreduce.noname.7``.
_UNNAMED = re.compile(r"^(?P<kind>[A-Za-z_]+)\.noname\.(?P<n>[0-9]+)$")


class Meta(NamedTuple):
    """What one rank asked for (small; pickled once per round)."""

    name: str
    kind: str        # allreduce | allgather | broadcast | alltoall | reducescatter | group
    #                  | barrier | join | shutdown
    dtype: str = ""
    shape: tuple = ()
    op: int = -1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    #: What a fused request covers (DistributedOptimizer's gradient buffers: the parameter
    #: count and a checksum of their names and shapes), so that ranks whose models differ
    #: but happen to have equal totals still disagree.
    layout: str = ""
    #: All-to-all: how many rows of dimension 0 go to each rank (empty: split evenly).
    splits: tuple = ()
    #: A problem with this rank's own arguments that only shows once every rank has
    #: submitted (bad all-to-all splits): the request fails on every rank, naming this one.
    error: str = ""
    #: A grouped operation (kind ``"group"``): its members' metadata, in order. The group
    #: is one entry of the table: it completes, or fails, as a whole on every rank.
    members: tuple = ()
    #: ``shutdown``: why this rank left (``"it called hvd.shutdown()"``, ``"its process is
    #: exiting ..."``).
    reason: str = ""
    #: This rank's tensors are on a device that the engine stages through host memory (MPI
    #: not CUDA-aware): then every rank runs the entry in chunks when it spans several
    #: (:mod:`mpicoll.torch.engine.pipeline`). Set by the engine at submission; not compared.
    stages: bool = False


class Response(NamedTuple):
    """One entry that every rank now executes (or fails) together."""

    kind: str
    name: str
    metas: dict               # rank -> Meta, for the ranks that submitted
    error: str | None = None
    last_joined: int = -1
    #: Ranks whose own arguments caused ``error`` (they raise ``ValueError``, the others
    #: ``mpicoll.RemoteError``); empty for disagreements and deadlocks.
    bad_ranks: tuple = ()


class _Entry:
    __slots__ = ("kind", "metas", "warned_at")

    def __init__(self, kind: str, now: float) -> None:
        self.kind = kind
        self.metas: dict[int, Meta] = {}
        self.warned_at = now


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks) if ranks else "none"


class Negotiator:
    """The shared table of incomplete requests (identical on every rank)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.table: dict[str, _Entry] = {}
        self.joined: list[int] = []

    def busy(self) -> bool:
        """Whether some request is still incomplete (every rank must keep negotiating)."""
        return bool(self.table) or bool(self.joined)

    def process(self, payloads: list[list[Meta]], waiting: list[bool],
                now: float | None = None) -> list[Response]:
        """Add one round of requests; return the responses to run, in order."""
        now = time.monotonic() if now is None else now
        responses: list[Response] = []
        leaving: dict[int, Meta] = {}
        for rank, items in enumerate(payloads):
            for meta in items:
                if meta.kind == "shutdown":
                    leaving[rank] = meta
                    continue
                if meta.kind == "join":
                    if rank not in self.joined:
                        self.joined.append(rank)
                    continue
                entry = self.table.get(meta.name)
                if entry is None:
                    entry = self.table[meta.name] = _Entry(meta.kind, now)
                if rank in entry.metas:
                    responses.append(Response(meta.kind, meta.name, {rank: meta},
                                              f"{meta.kind} {meta.name!r}: rank {rank} "
                                              f"submitted this name twice"))
                    continue
                entry.metas[rank] = meta
        joined = frozenset(self.joined)
        active = [r for r in range(self.size) if r not in joined]
        for name in list(self.table):
            entry = self.table[name]
            refusal = _join_refusal(entry, name, joined)
            if refusal:
                # It would fail once complete anyway (no rank leaves join() before every
                # rank has joined): fail it now, on the ranks that submitted it, without
                # waiting for the others' matching names (ranks whose paths differ while
                # one has joined need not have numbered their unnamed requests alike).
                del self.table[name]
                responses.append(Response(entry.kind, name, entry.metas, refusal))
                continue
            if entry.metas and all(r in entry.metas for r in active):
                del self.table[name]
                bad = tuple(sorted(r for r, m in entry.metas.items() if m.error))
                if bad:
                    error = f"{entry.kind} {name!r}: " + "; ".join(
                        f"rank {r}: {entry.metas[r].error}" for r in bad)
                else:
                    error = _mismatch(entry.kind, name, entry.metas)
                responses.append(Response(entry.kind, name, entry.metas, error,
                                          bad_ranks=bad))
        if len(self.joined) == self.size:
            responses.append(Response("join", JOIN, {}, None, self.joined[-1]))
            self.joined = []
        if leaving:
            # Every engine stops after this round: what is still incomplete fails locally.
            responses.append(Response("shutdown", SHUTDOWN, leaving))
            self.table = {}
            self.joined = []
        elif (not responses and self.busy() and active
                and all(waiting[r] for r in active)):
            responses.extend(self._fail_all(joined))
        return responses

    def _fail_all(self, joined: frozenset) -> list[Response]:
        """Fail every incomplete entry (and a pending ``join``) on every rank; the first
        response realigns the numbering of unnamed requests (:data:`REALIGN`)."""
        out = [Response("realign", REALIGN, {})]
        diverged = _diverged_numbering(self.table)
        for name, entry in self.table.items():
            have = sorted(entry.metas)
            missing = [r for r in range(self.size) if r not in entry.metas and r not in joined]
            unnamed = _UNNAMED.match(name)
            out.append(Response(entry.kind, name, entry.metas,
                                f"{entry.kind} {name!r} can never complete: submitted by "
                                f"ranks {_ranks(have)} but not by ranks {_ranks(missing)}, and "
                                f"every rank is blocked waiting (ranks submitted different "
                                f"names, or a different number of operations; or a thread "
                                f"waited while another of its rank had yet to submit: one "
                                f"thread per rank submits and waits, docs/torch.md)"
                                + (diverged.get(unnamed.group("kind"), "") if unnamed else "")))
        if self.joined:
            out.append(Response("join", JOIN, {}, "join() can never complete: ranks "
                                f"{_ranks(sorted(self.joined))} joined, the others are blocked "
                                "waiting for operations", -1))
        self.table = {}
        self.joined = []
        return out

    def stalled(self, now: float, after: float) -> list[tuple[str, list[int], list[int]]]:
        """Entries incomplete for ``after`` seconds since first seen (or last warning).

        Returns (name, ranks that submitted, ranks that did not) and resets their timer.
        """
        out = []
        for name, entry in self.table.items():
            if now - entry.warned_at >= after:
                entry.warned_at = now
                have = sorted(entry.metas)
                missing = [r for r in range(self.size)
                           if r not in entry.metas and r not in self.joined]
                out.append((name, have, missing))
        return out


class ResponseCache:
    """Rounds that repeat exactly (Horovod's response cache, for whole rounds).

    A training loop submits the same requests every step. When a round starts with an
    empty table, every rank contributes the same non-empty list of requests and all of them
    complete without error, that list is *learned* under the next id (1, 2, ...). Every rank
    learns the same lists in the same rounds (they all process the same payloads), so ids
    agree everywhere. Later a rank whose new requests equal a learned list sends its id
    instead of the pickled list; when every rank sends the same id on an empty table, the
    learned responses are the round's responses without unpickling or negotiating, and
    otherwise ids are expanded back to their lists and negotiated as usual. When full, the
    cache is emptied (in the same round everywhere).
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._ids: dict[tuple, int] = {}
        self._entries: list[tuple[list[Meta], list[Response]]] = []

    def lookup(self, metas: list[Meta]) -> int:
        """The id of ``metas`` if learned, else 0."""
        return self._ids.get(tuple(metas), 0) if metas else 0

    def metas(self, cache_id: int) -> list[Meta]:
        """The requests learned under ``cache_id``."""
        return self._entries[cache_id - 1][0]

    def responses(self, cache_id: int) -> list[Response]:
        """The responses learned under ``cache_id``."""
        return self._entries[cache_id - 1][1]

    def learn(self, payloads: list[list[Meta]], responses: list[Response],
              was_idle: bool, idle: bool) -> None:
        """Learn this round if it qualifies (``was_idle``/``idle``: the table was empty
        before and is empty after the round)."""
        first = payloads[0]
        if not (was_idle and idle and first and len(responses) == len(first)
                and all(items == first for items in payloads[1:])
                and all(r.error is None and r.kind not in ("join", "shutdown")
                        for r in responses)):
            return
        key = tuple(first)
        if key in self._ids:
            return
        if len(self._entries) >= self.capacity:
            self._ids.clear()
            self._entries.clear()
        self._entries.append((list(first), list(responses)))
        self._ids[key] = len(self._entries)


#: Fields that must agree across ranks, per kind ("shape0+" compares shape[1:]).
_FIELDS = {
    "allreduce": ("kind", "dtype", "shape", "op", "prescale", "postscale", "layout"),
    "allgather": ("kind", "dtype", "rows"),
    "broadcast": ("kind", "dtype", "shape", "root"),
    "alltoall": ("kind", "dtype", "rows"),
    "reducescatter": ("kind", "dtype", "shape", "op", "prescale", "postscale"),
    "barrier": ("kind",),
}


def shutdown_message(leaving: dict, rank: int) -> str:
    """The error of every operation that a ``shutdown`` response leaves incomplete on
    ``rank`` (or that it submits later): the ranks that left and why, and Horovod's
    explanation.

    Args:
        leaving: rank -> the ``shutdown`` :class:`Meta` it sent.
        rank: the rank the message is for.
    """
    who = "; ".join(("this rank (" if r == rank else f"rank {r} (") +
                    (leaving[r].reason or "it called hvd.shutdown()") + ")"
                    for r in sorted(leaving))
    return (f"mpicoll.torch has been shut down by {who}. As in Horovod, this is caused by "
            f"an exception on one of the ranks or an attempt to allreduce, allgather or "
            f"broadcast a tensor after one of the ranks finished execution (if an "
            f"exception caused it, it is in that rank's log); operations still pending "
            f"fail, and so does any later one until hvd.init() is called again on every "
            f"rank")


def _field(meta: Meta, field: str) -> object:
    if field == "rows":
        return tuple(meta.shape[1:]) if meta.shape else ("scalar",)
    value = getattr(meta, field)
    if field == "op" and isinstance(value, int):
        return ReduceOp(value)   # (its name: Sum, Max, ...)
    return tuple(value) if field == "shape" else value


def _disagreement(metas: dict, value: Callable[[Meta], object]) -> str:
    """Which ranks have which ``value(meta)`` (``ranks 0,1 have X; ranks 2 have Y``), or
    "" when every rank has the same."""
    groups: dict[object, list[int]] = {}
    for rank in sorted(metas):
        groups.setdefault(value(metas[rank]), []).append(rank)
    if len(groups) == 1:
        return ""
    return "; ".join(f"ranks {_ranks(rs)} have {v}" for v, rs in groups.items())


def _group_mismatch(name: str, metas: dict) -> str | None:
    differ = _disagreement(metas, lambda m: len(m.members))
    if differ:
        return f"group {name!r}: ranks disagree: members: {differ}"
    first = next(iter(metas.values()))
    for index, member in enumerate(first.members):
        error = _mismatch(member.kind, member.name,
                          {r: m.members[index] for r, m in metas.items()})
        if error:
            return f"group {name!r}: member {index}: {error}"
    return None


def _diverged_numbering(table: dict) -> dict[str, str]:
    """kind -> an explanation, for each kind whose incomplete unnamed requests show ranks
    numbering them differently (two or more numbers, each submitted by other ranks)."""
    numbers: dict[str, dict[int, list[int]]] = {}
    for name, entry in table.items():
        match = _UNNAMED.match(name)
        if match:
            numbers.setdefault(match.group("kind"), {})[int(match.group("n"))] = \
                sorted(entry.metas)
    out = {}
    for kind, by_number in numbers.items():
        if len(by_number) > 1:
            seen = "; ".join(f"{kind}.noname.{n} by ranks {_ranks(ranks)}"
                             for n, ranks in sorted(by_number.items()))
            out[kind] = (f". The ranks' numbering of unnamed {kind} operations diverged "
                         f"({seen}): a rank skipped one (it raised before submitting it, or "
                         f"took another path); the numbering is realigned on every rank, so "
                         f"the next unnamed operations match again")
    return out


def _join_refusal(entry: _Entry, name: str, joined: frozenset) -> str | None:
    """The error of an entry that cannot run while ranks have joined (an all-gather,
    broadcast, all-to-all or reduce-scatter, or a group with one), else ``None``."""
    if not joined:
        return None
    kinds = [entry.kind]
    for meta in entry.metas.values():
        kinds.extend(m.kind for m in meta.members)
    kind = next((k for k in kinds if k in _NO_JOIN), None)
    if kind is None:
        return None
    return (f"{entry.kind} {name!r}: {_NO_JOIN[kind]} is not supported with join() "
            f"(ranks {_ranks(sorted(joined))} joined), as in Horovod"
            + (" (DistributedOptimizer(sparse_as_dense=True) reduces sparse gradients "
               "by all-reduce)" if kind == "allgather" else ""))


def _mismatch(kind: str, name: str, metas: dict) -> str | None:
    if kind == "group" and all(m.kind == "group" for m in metas.values()):
        return _group_mismatch(name, metas)
    details = []
    kinds = {m.kind for m in metas.values()}
    fields = ("kind",) if len(kinds) > 1 else _FIELDS.get(kind, ("kind",))
    for field in fields:
        differ = _disagreement(metas, lambda m, field=field: _field(m, field))
        if differ:
            details.append(f"{field}: {differ}")
    if details:
        return f"{kind} {name!r}: ranks disagree: " + " | ".join(details)
    if kind == "allgather" and any(not m.shape for m in metas.values()):
        return f"allgather {name!r}: tensors must have at least one dimension"
    return None


#: Collectives that fail on every rank while some rank has joined: Horovod 0.28 refuses
#: them too (its join tests expect allgather and broadcast to raise), only all-reduce (and
#: barrier) go on without the joined ranks.
_NO_JOIN = {"allgather": "Allgather", "broadcast": "Broadcast", "alltoall": "Alltoall",
            "reducescatter": "Reducescatter"}
