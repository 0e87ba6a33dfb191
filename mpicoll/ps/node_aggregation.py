"""Local aggregation (局部聚合): the workers of one node push and pull as one.

With ``ParameterServer(..., local_aggregation=...)`` on (the default ``"auto"`` turns it on
when the workers span several nodes and some node holds more than one worker), the workers
of a node form a *node group* (:class:`NodeGroup`), ordered by rank; the lowest rank is
the node's *leader*. Every operation of a worker is collective over its node group:

1. *control*: a small non-blocking all-gather of ``(op, clock, error)`` over the group,
   so the node's workers either all go on or all raise the same :class:`PSError` (they
   made different calls, pushed at different clocks, or one passed bad arrays);
2. *push*: the node's other workers send their gradients to the leader (point to point;
   MPI moves them through shared memory), which sums them in local rank order
   (:func:`~mpicoll.ps.node_order.fold_sum`, the order the servers use) and pushes the
   node's sum as one push that counts for the node's number of workers (its *weight*).
   (A first version used ``mpicoll``'s shared-memory all-reduce; it gives every rank the
   sum, which only the leader needs, and synchronises the node twice per slot: 4-10x
   slower on the test bed's oversubscribed cores, docs/results/ps_node_aware.md);
3. *pull*: only the leader pulls; it then sends a status word and the values to the
   node's other workers (non-blocking broadcasts on the group's communicator).

The servers (or, co-located, the leaders' engine) thus see one worker per node. Which
nodes there are comes from :class:`mpicoll.topology.Topology` (``COMM_TYPE_SHARED``, or
``MPICOLL_RANKS_PER_NODE`` to emulate nodes on one machine). Under ULFM a node group's
waits go through the parameter server's failure watch (:mod:`mpicoll.ps.failures`): a
dead rank, in the node or elsewhere, is a :class:`~mpicoll.ProcessFailedError` here too.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..topology import Topology
from . import protocol as P
from .errors import PSError
from .node_order import fold_sum
from .placement import ParamSpec
from .protocol import CollOp
from .stepped import CollectiveGroup

__all__ = ["node_indices", "worker_groups", "decide", "NodeGroup"]

#: tag of the node's gradients sent to its leader (the group's own communicator)
_TAG_REDUCE = 7110


def node_indices(comm: MPI.Comm) -> list[int]:
    """Every rank's node index in the node layout of ``comm`` (collective)."""
    topo = Topology(comm)
    try:
        return comm.allgather(topo.node_index)
    finally:
        topo.free()


def worker_groups(node_of: list[int], workers: list[int]) -> list[list[int]]:
    """The worker ranks of each node that holds workers, nodes in layout order."""
    groups: dict[int, list[int]] = {}
    for w in sorted(workers):
        groups.setdefault(node_of[w], []).append(w)
    return [groups[k] for k in sorted(groups)]


def decide(setting: Any, groups: list[list[int]], backup_workers: int, replicas: int,
           init: bool) -> bool:
    """Whether local aggregation runs (the same answer on every rank: every input was
    agreed at set-up).

    Args:
        setting: ``local_aggregation`` (``"auto"``, ``True``, ``False``; ``True`` with an
            excluding setting was refused by :mod:`mpicoll.ps.settings`).
        groups: :func:`worker_groups`.
        backup_workers, replicas, init: the settings that exclude it.
    Returns:
        ``True`` when some node holds more than one worker and: ``True`` was passed, or
        ``"auto"`` was, the workers span more than one node and nothing excludes it.
    """
    if setting is False or not any(len(g) > 1 for g in groups):
        return False
    if setting is True:
        return True
    return len(groups) > 1 and not backup_workers and not replicas and init


class NodeGroup(CollectiveGroup):
    """The workers of one node under local aggregation (see the module docstring).

    Args:
        comm: the node's workers, ordered by rank (the leader is rank 0 of it).
        specs: the parameters (name -> spec).
        leader_call: on the leader, ``leader_call(kind, grads, out)`` starts the node's
            ``"push"``/``"pull"``/``"push_pull"`` towards the servers and returns a
            handle; ``None`` on the other workers.
        max_sleep: longest pause while polling.
        watch: the failure watch under ULFM (``None``: not watched); any failure is fatal.
    """

    def __init__(self, comm: MPI.Comm, specs: dict[str, ParamSpec], leader_call: Any,
                 max_sleep: float = 1e-3, watch: Any = None) -> None:
        self._setup_group(comm)
        self.is_leader = self.rank == 0
        self.specs = specs
        self.leader_call = leader_call
        self.max_sleep = max_sleep
        self.watch = watch
        self.counters = dict.fromkeys(P.WORKER_COUNTERS + ("node_bytes_reduced",
                                                           "node_bytes_shared"), 0)
        self._sums: dict[str, np.ndarray] = {}
        self._parts: dict[str, list[np.ndarray]] = {}   # the others' gradients

    # ------------------------------------------------------------------ steps
    def _control(self, op: int, error: str | None) -> Any:
        """All-gather ``(op, clock, error flag)`` over the node and check it.

        Raises:
            PSError: (on every worker of the node) they made different calls, pushed at
                different clocks, or one passed bad arguments.
        """
        yield from super()._control(op, error)
        ops = [int(o) for o in self._ctrl_in[:, 0]]
        if len(set(ops)) > 1:
            what = ", ".join(f"local rank {r}: {CollOp(o).name.lower()}"
                             for r, o in enumerate(ops))
            raise PSError(f"local aggregation: the workers of a node must make the same call "
                          f"at the same step ({what}); pass local_aggregation=False to let "
                          f"them act alone")
        if len({int(c) for c in self._ctrl_in[:, 1]}) > 1:
            raise PSError(f"local aggregation: the workers of a node are at different clocks "
                          f"{[int(c) for c in self._ctrl_in[:, 1]]}")
        bad = [r for r in range(self.size) if self._ctrl_in[r, 2]]
        if bad:
            self._refuse_bad_arguments(f"local aggregation: local rank(s) {bad} of this node",
                                       error, "workers")

    def share(self, obj: Any = None) -> Any:
        """Steps: the leader's ``obj`` (small, pickled) on every worker of the node."""
        data = pickle.dumps(obj) if self.is_leader else b""
        size = np.array([len(data)], dtype=np.int64)
        yield [self.comm.Ibcast([size, MPI.INT64_T], root=0)]
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.is_leader else \
            np.empty(int(size[0]), dtype=np.uint8)
        yield [self.comm.Ibcast([buf, MPI.BYTE], root=0)]
        return obj if self.is_leader else pickle.loads(buf.tobytes())

    # ------------------------------------------------------------------ operations
    def step(self, op: int, grads: dict[str, Any] | None = None,
             out: dict[str, Any] | None = None) -> Any:
        """One node-collective push, pull or push_pull (a generator of request lists).

        Returns (as the generator's value): the pulled dict, or ``None`` for a push.
        """
        call = self._prepare(op, grads, out, self.specs)
        yield from self._control(op, call.error)
        # (separate arrays: pulling into the gradients is safe)
        sums = (yield from self._reduce(call.grads)) if call.pushing else None
        # a pull fills call.result (its ``out``) on the leader; the others get it below
        yield from self.lead(self.leader_call, CollOp(op).name.lower(), sums, call.result,
                            share_result=False)
        if call.pulling:
            result = call.result
            yield [self.comm.Ibcast(_raw(result[n]), root=0)
                   for n in sorted(self.specs) if result[n].size]
            if not self.is_leader:
                self.counters["node_bytes_shared"] += sum(result[n].nbytes for n in self.specs)
        self._advance(call, self.counters)
        return call.finish()

    def _reduce(self, grads: dict[str, Any]) -> Any:
        """Steps: the node's sum of every gradient on the leader (the other workers send
        theirs to it, point to point, through MPI's shared memory), summed in local rank
        order (:func:`~mpicoll.ps.node_order.fold_sum`, the order the servers use).
        Returns the sums on the leader, ``None`` elsewhere."""
        names = [n for n in sorted(self.specs) if self.specs[n].size]
        flat = {n: np.ascontiguousarray(grads[n]).reshape(-1) for n in self.specs}
        if not self.is_leader:
            yield [self.comm.Isend(_raw(flat[n]), 0, _TAG_REDUCE) for n in names]
            return None
        sums = self._sums
        reqs = []
        for name in sorted(self.specs):
            spec = self.specs[name]
            if name not in sums:
                sums[name] = np.empty(spec.shape, dtype=spec.dtype)
                self._parts[name] = [np.empty(spec.size, dtype=spec.dtype)
                                     for _ in range(self.size - 1)]
            if spec.size:
                reqs += [self.comm.Irecv(_raw(buf), r + 1, _TAG_REDUCE)
                         for r, buf in enumerate(self._parts[name])]
        yield reqs
        for name in names:
            fold_sum(sums[name].reshape(-1), [flat[name], *self._parts[name]], [self.size])
            self.counters["node_bytes_reduced"] += sums[name].nbytes * (self.size - 1)
        return sums

    def lead(self, start: Callable[..., Any], *args: Any, share_result: bool = True) -> Any:
        """Steps: the leader starts ``start(*args)`` (a handle of its client or engine)
        and waits for it; every worker of the node gets its result (``share_result=False``:
        ``None``, e.g. a pull's arrays, which :meth:`step` broadcasts), or the same
        :class:`PSError`."""
        result, error = None, None
        if self.is_leader:
            try:
                handle = start(*args)
                yield handle                # a handle: the node's handle waits on it
                result = handle.wait()
            except PSError as exc:
                error = str(exc)
        result, error = yield from self.share((result if share_result else None, error))
        if error is not None:
            raise PSError(error)
        return result

    def agree_and_lead(self, op: int, start: Callable[[], Any]) -> Any:
        """Steps of a node's close, stats or save: the node's workers agree on ``op``, the
        leader starts ``start()`` (a handle of its client or engine), and every worker of
        the node gets its result, or the same :class:`PSError` (:meth:`lead`)."""
        yield from self._control(op, None)
        return (yield from self.lead(start))

    def worker_counters(self, leader_counters: dict[str, int] | None) -> dict[str, int]:
        """This worker's counters: the node's traffic to the servers on the leader."""
        out = dict(self.counters, local_aggregation=True, node_leader=self.is_leader,
                   node_workers=self.size)
        if leader_counters is not None:
            for k in ("bytes_sent", "bytes_received", "bytes_sent_uncompressed",
                      "bytes_received_uncompressed"):
                out[k] = leader_counters.get(k, 0)
        return out


def _raw(arr: np.ndarray) -> list:
    return [arr.reshape(-1).view(np.uint8), MPI.BYTE]
