""":class:`MPIProcessGroup`: the c10d backend whose operations are mpicoll's.

It subclasses the C++ extension's ``Backend`` (:mod:`.extension`: a ``c10d::Backend``
whose virtual operations call these Python methods), so torch wraps it in a
``ProcessGroup`` of its own and registers it for the ``"cpu"`` and ``"cuda"`` devices, as
it does gloo and NCCL: ``pg._get_backend(torch.device("cpu"))`` is this object. Importing
this module builds the extension where no build is cached.

Each group owns an MPI communicator (ranks in group order) and a duplicate of it for
point-to-point messages, both made and freed by :mod:`mpicoll.runtime.comms`, and a
runtime :class:`~mpicoll.runtime.Lane` on which its collectives run in call order; every
call returns a :class:`~.work.MPIWork` at once (``async_op=False`` is torch waiting on it).

Reductions, broadcast, all-gather and reduce-scatter run mpicoll's collectives
(``algorithm="auto"``; :class:`Options` or ``MPICOLL_ALLREDUCE_ALGORITHM`` force the
all-reduce's, ``MPICOLL_ALGORITHM`` every collective's); gather, scatter, the all-to-alls
and barriers run MPI's own (``MPI_Igather``, ``MPI_Iscatter``, ``MPI_Ialltoallv``,
``MPI_Ibarrier``: the non-blocking forms waited for as the lane waits,
:mod:`mpicoll.waiting`, so that they notice the group's timeout), recorded for the stall
inspector and timeline like mpicoll's.

Checking (:class:`Options` ``check``): each call's arguments are checked on the calling
rank (any error there, a ``ValueError``/``TypeError`` or another, is the rank's local
error), then, before a checked call runs, the group's ranks agree on it
(:func:`mpicoll.checked.agree`: one small ``MPI_Allgather``): a rank whose own arguments
were bad raises its error and the others :class:`mpicoll.RemoteError`; ranks that
disagree on the operation, count, dtype, op or root all raise
:class:`mpicoll.MismatchError`. The all-to-alls also check that each rank's send splits
equal its peers' receive splits.

Timeouts, abort and shutdown follow the runtime's lane (:mod:`mpicoll.runtime.progress`):
an expired ``Work.wait(timeout)`` raises :class:`mpicoll.CollectiveTimeoutError` and
breaks the group; :meth:`MPIProcessGroup.abort` fails the work in flight and the queued
work; under ULFM both revoke the communicators, without ULFM a broken group used again,
destroyed or left at exit with an operation in flight ends the job.
"""
from __future__ import annotations

import functools
import itertools
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ... import collectives, config, tracking, waiting
from ...buffers import IN_PLACE
from ...checked import agree
from ...context import get_context
from ...errors import CollectiveError, CollectiveTimeoutError, ProcessFailedError
from ...node_window import node_table
from ...runtime import Lane, comms, failures, progress
from ...runtime import world as runtime_world
from ..engine.settings import allreduce_algorithm
from . import backward, extension, p2p, reconfigure
from .failures import GroupFailures
from .options import BACKEND, Options
from .staging import Staging
from .tensors import (Host, byte_view, check_reduce_dtype, check_tensor, op_label, op_name,
                      premul_factor)
from .work import MPIWork, seconds

__all__ = ["MPIProcessGroup", "Options", "BACKEND", "SHUTDOWN_STALL_S"]

#: How long :meth:`MPIProcessGroup.shutdown` waits for a group whose queued operations
#: make no progress (an operation the other ranks never joined) before it aborts it.
SHUTDOWN_STALL_S = progress.EXIT_STALL_S
#: How long a timed-out wait waits for the stall inspector's answers naming late ranks
#: (when its question is due or asked; on a loaded machine its thread can be late).
MISSING_WAIT_S = 1.0

#: What monitored_barrier's messages carry (kept alive while sends are pending).
_TOKEN = np.zeros(1, dtype=np.uint8)
_SINK = np.zeros(1, dtype=np.uint8)
_serial = itertools.count()
#: What a call's ``prepare`` returns: the operation and the fields the ranks agree on.
Prepared = tuple[Callable[[], Any], dict[str, Any]]


#: The C++ extension's ``c10d::Backend`` that Python can subclass.
_Backend = extension.load().Backend
#: Every group not shut down yet. torch's ProcessGroup holds the C++ object only; the
#: Python object, which holds the operations, must live as long (see :meth:`shutdown`).
_live: set[Any] = set()


def _sizes_field(sizes: list[list[int]]) -> str:
    """The agreement's count of an uneven call: every block size, per tensor."""
    return ";".join(",".join(str(n) for n in s) for s in sizes)


def _dtype_field(tensors: list[torch.Tensor]) -> str:
    return ",".join(sorted({str(t.dtype) for t in tensors}))


def _count(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _copy_parts(outputs: list[torch.Tensor], parts: Any) -> None:
    """Copy each of ``parts`` (flat tensors) into its output, in the output's shape."""
    with torch.no_grad():
        for out, part in zip(outputs, parts):
            out.copy_(part.view(out.shape))


class MPIProcessGroup(_Backend):
    """The c10d backend of one group: its collectives are mpicoll's, on its own MPI
    communicator. torch's ``ProcessGroup`` holds it for the ``"cpu"`` and ``"cuda"``
    devices; its methods are c10d's ``Backend`` operations (torch's names).

    Args:
        comm: the communicator (made for this group by :mod:`mpicoll.runtime.comms`,
            freed by :meth:`shutdown`; ranks in group order).
        rank: this process's rank in the group (equals ``comm``'s).
        size: the group's size (equals ``comm``'s).
        timeout: the group's timeout: ``Work.wait()``'s default limit.
        options: :class:`Options` (``None``: the defaults); the group keeps a copy with
            its timeout, name and ranks.
        owned: more communicators of the runtime's that :meth:`shutdown` frees.
        group_name: torch's name of the group.
        ranks: the group's global ranks (``[]``: the default group).
    """

    def __init__(self, comm: Any, rank: int, size: int, timeout: Any = None,
                 options: Options | None = None, owned: tuple[Any, ...] = (),
                 group_name: str = "", ranks: list[int] | tuple[int, ...] = ()) -> None:
        super().__init__(rank, size, BACKEND)
        if not isinstance(timeout, timedelta):
            timeout = None if timeout is None else timedelta(seconds=float(timeout))
        #: The group's :class:`Options` (its timeout, name, ranks; what
        #: ``pg._get_backend(device).options`` gives).
        self.options = (options if isinstance(options, Options) else Options()).for_group(
            timeout, group_name, list(ranks))
        self._algorithm = self.options.algorithm or allreduce_algorithm()
        #: creation order (the order in which groups are rebuilt after a reconfiguration)
        self.serial = next(_serial)
        self._shut = False
        #: made by ``dist.shrink_group``: torch's group of it is fixed at its first call
        self._adopt = False
        self._bind(comm, owned, seconds(timeout))
        if self._lane.inline:
            _warn_synchronous()
        _live.add(self)

    def _bind(self, comm: Any, owned: tuple[Any, ...], timeout: float | None) -> None:
        """Make ``comm`` the group's communicator, with a point-to-point duplicate, its
        context, lanes and failure state, for the runtime's current world generation (at
        creation, and again when an elastic reconfiguration rebuilds the group)."""
        self.comm = comm
        #: the runtime's world generation the group's communicators belong to
        self.generation = runtime_world.generation()
        self._p2p = comms.dup(comm, "group")
        self._owned = (self._p2p, comm, *owned)
        self._ctx = get_context(comm)
        # MPI's own collectives in their non-blocking forms: the lane's waits poll them,
        # so the group's timeout bounds them too (mpicoll.algorithms.native)
        self._ctx.nonblocking = True
        #: the all-reduce's algorithm: ``auto`` is ``shm`` on a group of three or more ranks
        #: of one node whose barriers sleep in the kernel (:mod:`mpicoll.node_window`): the
        #: lane's waits are then the kernel's, not MPI's polling (DDP's 6-8 MB buckets at
        #: n = 4: 1.32-1.37x gloo, 1.24-1.34x with auto's ring; docs/results/ddp_threads.md)
        self._allreduce = self._algorithm
        # the agreement's table on one node, made here where every rank is: a first call
        # that a peer never joins then waits in its barrier, which notices the timeout
        table = node_table(self._ctx)
        if (self._algorithm == "auto" and comm.Get_size() >= 3
                and not config.env_str("MPICOLL_ALGORITHM") and table is not None):
            self._allreduce = "shm"
        self._checked: set[str] = set()
        self._failures = GroupFailures(comm)
        name = f"mpicoll-pg{self.serial}" + (f".{self.generation}" if self.generation else "")
        self._lane = Lane(name, comm, timeout, missing=self._missing)
        self._futures = p2p.Futures(f"{name}-p2p")
        self._monitored = 0
        #: (autograd graph task, operations submitted during it so far); and how many the
        #: last backward pass submitted: its last one runs on the caller's thread
        self._backward: tuple[int, int] = (-1, 0)
        self._per_backward = 0
        #: monitored_barrier's sends not known complete (never freed while pending: Open
        #: MPI ends the job when a freed send to a dead rank fails)
        self._sends: list[Any] = []
        #: collectives submitted so far (torch's sequence number for the group)
        self._sequence = 0

    def rebind(self, comm: Any, owned: tuple[Any, ...], ranks: list[int]) -> None:
        """After an elastic reconfiguration (:mod:`.reconfigure`): the group goes on over
        ``comm`` (its surviving members, in group order; ``ranks``: their global ranks,
        ``[]`` for the default group) with its rank and size. The old communicators are
        forgotten (revoked: a free would wait for the dead), the old lanes' work fails
        with :class:`~mpicoll.ProcessFailedError`, the options, timeout and algorithm stay."""
        error = ProcessFailedError(f"mpicoll: process group {self._lane.name} was rebuilt "
                                   f"on the survivors of a failure")
        timeout = self._lane.timeout
        for lane in (self._lane, self._futures.lane):
            if lane.broken is None:
                lane.abort(error)
            lane.close(0.0)
        self._futures.close()
        comms.forget(self._owned)
        self._bind(comm, owned, timeout)
        self.options.global_ranks_in_group = list(ranks)
        self._set_rank_size(comm.Get_rank(), comm.Get_size())

    # --- the call path ----------------------------------------------------------------
    def submit(self, kind: str, run: Callable[[], Any], fallback: Any = None) -> MPIWork:
        """Run ``run`` (a function of no arguments) where the group runs its operations:
        on its lane, after the operations already queued, so that every rank runs it in
        the same order (a DDP communication hook's own collectives, say). On a group that
        failed it fails at once; a process failure it meets is reported like the group's
        own operations'.

        Inside a backward pass (DDP's reducer, or a communication hook) the work's error
        is raised from ``backward()`` after DDP's own callbacks, and its future completes
        with ``fallback`` when it fails (:mod:`.backward`).

        Returns:
            The :class:`~.work.MPIWork` of ``run`` (its result is ``run``'s value).
        """
        def op() -> Any:
            refused = self._failures.refuse(kind)
            if refused is not None:
                raise refused
            try:
                return run()
            except Exception as exc:
                if self._lane.broken is not None:   # the abort's revocation ended it
                    raise
                error = self._failures.error(kind, exc)
                if getattr(error, "peer_revoked", False):
                    self._lane.abort(error)   # a peer's revocation: the queued work too
                if error is exc:
                    raise
                raise error from exc

        if self._adopt:
            self._adopt = False
            reconfigure.adopt_wrapper(self)
        task = backward.task()
        if task == -1:          # not during a backward pass
            return MPIWork(self._lane.submit(kind, op))
        work = MPIWork(self._lane.submit(kind, op, here=self._last_of_backward(task)),
                       fallback=fallback)
        backward.watch(work, task)
        return work

    def _last_of_backward(self, task: int) -> bool:
        """Whether an operation submitted now, during backward pass ``task``, is that
        pass's last (as many operations as the previous pass submitted: DDP's buckets):
        DDP's reducer waits for it at once, so it runs on the caller's thread, without the
        hand-over to the lane's thread and back (on oversubscribed cores: two wake-ups per
        step). A pass that submits more or fewer only moves where that happens."""
        last_task, count = self._backward
        if task != last_task:
            if last_task != -1:
                self._per_backward = count
            count = 0
        self._backward = (task, count + 1)
        return count + 1 == self._per_backward

    def _check(self, kind: str) -> bool:
        """Whether this call is agreed on first (decided alike on every rank)."""
        if self.options.check == "every" or config.check_enabled():
            return True
        first = kind not in self._checked
        self._checked.add(kind)
        return first

    def _call(self, kind: str, prepare: Callable[[Staging], Prepared],
              fallback: Any = None) -> MPIWork:
        """Check and stage the call's arguments here (``prepare``: its error is this
        rank's local error), then queue its operation on the group's lane, after the
        agreement step where the call is checked (a local error is raised at once where
        it is not). ``prepare``'s fields may hold ``splits``, a second agreement step's
        check (the all-to-alls')."""
        self._sequence += 1
        stage = Staging()
        try:
            run, fields = prepare(stage)
            error = None
        except Exception as exc:  # noqa: BLE001  (this rank's error, told to the others)
            run, fields, error = None, {}, exc
        check = self._check(kind)
        if error is not None and not check:
            raise error
        splits = fields.pop("splits", None)

        def task() -> Any:
            if check:
                self._agree(kind, error, fields)
                if splits is not None:
                    self._agree(f"{kind} (splits)", splits(), {})
            stage.before()
            result = run()
            stage.after()
            return result

        return self.submit(kind, task, fallback)

    def _set_sequence_number_for_group(self) -> None:
        """Start counting the group's collectives (c10d's ``setSequenceNumberForGroup``:
        torch's ``ProcessGroupWrapper``, which ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts
        around every group, compares the count across ranks before each collective)."""
        self._sequence = 0

    def _get_sequence_number_for_group(self) -> int:
        """The number of collectives this rank has submitted on the group (since it was
        made or rebuilt); the same on every rank that has made the same calls."""
        return self._sequence

    def _tracked(self, name: str, fn: Callable[[], Any], **info: Any) -> Any:
        """``fn()``, recorded as the call ``name`` for the stall inspector and timeline
        when they are on."""
        if tracking.wanted():
            return tracking.recorded(self._ctx.tracker, tracking.CallInfo(name, **info), fn)()
        return fn()

    def _agree(self, kind: str, error: BaseException | None, fields: dict) -> None:
        """The agreement step, recorded for the stall inspector as a call of its own (a
        rank waiting in it for a rank that never comes is seen, as in the collective)."""
        self._tracked(f"{kind} (agreement)",
                      lambda: agree(self._ctx, error, collective=kind, **fields))

    def _native(self, name: str, start: Callable[[], MPI.Request], naps: bool = False,
                **info: Any) -> None:
        """Run MPI's own collective: ``start()`` starts its non-blocking form, waited for
        as the lane waits (:func:`mpicoll.waiting.wait`, so that it notices the group's
        timeout; ``naps``: see there), recorded for the stall inspector/timeline."""
        self._tracked(name, lambda: waiting.wait(start(), naps=naps), algorithm="native",
                      **info)

    def _allreduce_host(self, tensor: torch.Tensor, op: str, factor: Any) -> None:
        host = Host(tensor, True, factor)
        collectives.allreduce(IN_PLACE, host.array, op=op, comm=self.comm,
                              algorithm=self._allreduce, check=False)
        host.finish()

    def _root(self, kind: str, root: int) -> int:
        if not 0 <= root < self.size():
            raise ValueError(f"{kind} root {root} is not a rank of the group")
        return root

    def _missing(self, work: Any) -> list[int]:
        """The ranks the stall inspector found outside the call in progress (those that
        had not entered it, or had ended), for timeout messages; ``[]``: not known. Waits
        up to :data:`MISSING_WAIT_S` for every answer to its question about the call, or
        for the question itself where the inspector watches a call and asks by then."""
        w = self._ctx.watched
        deadline = time.monotonic() + MISSING_WAIT_S
        while w is not None and time.monotonic() < deadline:
            query = w.query
            if (len(query["replies"]) >= self.size() - 1 if query
                    else not w.seq or w.next_query > deadline):
                break
            time.sleep(0.01)
        query = w.query if w is not None else None
        if not query:
            return []
        seq = query["seq"]
        late = {peer for peer, reply in query["replies"].items() if reply[1] < seq}
        return sorted(late | {r for r, done in w.left.items() if done < seq})

    # --- c10d's Backend interface --------------------------------------------------------
    def supportsSplitting(self) -> bool:  # noqa: N802 (c10d's name)
        """No: ``dist.split_group`` needs an accelerator; :func:`.groups.split_group` is
        the mpicoll way."""
        return False

    def supportsCoalescing(self) -> bool:  # noqa: N802
        """No: ``batch_isend_irecv`` posts every operation at once without it."""
        return False

    def supportsShrinking(self) -> bool:  # noqa: N802
        """Yes: ``dist.shrink_group`` (after a failure through ULFM's shrink; see
        :func:`.reconfigure.shrunk`)."""
        return True

    def shrink(self, ranks_to_exclude: list[int], shrink_flags: int = 0,
               opts_override: Any = None) -> "MPIProcessGroup":
        """torch's ``dist.shrink_group``: a new backend of this group's members but
        ``ranks_to_exclude`` (:func:`.reconfigure.shrunk`). ``SHRINK_ABORT`` first aborts
        the work in flight (failed with :class:`~mpicoll.CollectiveError`)."""
        if shrink_flags:
            self.abort()
        comm, owned, ranks = reconfigure.shrunk(self, [int(r) for r in ranks_to_exclude])
        options = opts_override if isinstance(opts_override, Options) else self.options
        new = MPIProcessGroup(comm, comm.Get_rank(), comm.Get_size(), self.options._timeout,
                              options, owned, group_name=f"{self.options.group_name}:shrunk",
                              ranks=ranks)
        new._adopt = True
        return new

    def getBackendOptions(self) -> Options:  # noqa: N802
        """The group's :class:`Options` (``_get_backend(device).options``' source)."""
        return self.options

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._reduce("allreduce", tensors, opts or dist.AllreduceOptions(), None)

    allreduce_coalesced = allreduce   # one all-reduce per tensor, same options
    allreduce_sparse = allreduce      # refused (a sparse tensor) on every rank

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.BroadcastOptions()

        def prepare(stage: Staging) -> Prepared:
            root = self._root("broadcast", opts.rootRank)
            hosts = [stage.host(check_tensor(t, "tensor"), load=True, store=True)
                     for t in tensors]

            def run() -> list[torch.Tensor]:
                for tensor in hosts:
                    host = Host(tensor)
                    collectives.broadcast(host.array, root=root, comm=self.comm, check=False)
                    host.finish()
                return tensors

            return run, dict(count=_count(tensors), dtype=_dtype_field(tensors), root=root)

        return self._call("broadcast", prepare)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceOptions()
        return self._reduce("reduce", tensors, opts, opts.rootRank)

    def _reduce(self, kind: str, tensors: list[torch.Tensor], opts: Any,
                root: int | None) -> MPIWork:
        """All-reduce ``tensors`` (``root`` ``None``), else reduce them to rank ``root``."""
        def prepare(stage: Staging) -> Prepared:
            op, factor = op_name(opts.reduceOp), premul_factor(opts.reduceOp)
            if root is not None:
                self._root(kind, root)
            for t in tensors:
                check_reduce_dtype(check_tensor(t, "tensor"), op, factor=factor)
            mine = root is None or self.rank() == root
            hosts = [stage.host(t, load=True, store=mine) for t in tensors]

            def run() -> list[torch.Tensor]:
                for tensor in hosts:
                    if root is None:
                        self._allreduce_host(tensor, op, factor)
                        continue
                    host = Host(tensor, True, factor)
                    collectives.reduce(IN_PLACE if mine else host.array,
                                       host.array if mine else None, op=op, root=root,
                                       comm=self.comm, check=False)
                    if mine:
                        host.finish()
                return tensors

            return run, dict(count=_count(tensors), dtype=_dtype_field(tensors),
                             op=op_label(opts.reduceOp), root=root)

        return self._call(kind, prepare, fallback=tensors if root is None else None)

    # all-gather ---------------------------------------------------------------------------
    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        src, dst = Host(input), Host(output)
        collectives.allgather(_gather_source(src.array, dst.array, self.rank()), dst.array,
                              comm=self.comm, check=False)
        dst.finish()

    def _check_blocks(self, whole: torch.Tensor, block: torch.Tensor, name: str) -> None:
        """``whole`` (named ``name``) must hold ``size()`` blocks like ``block``."""
        if whole.dtype != block.dtype or whole.numel() != block.numel() * self.size():
            raise ValueError(f"{name} tensor must hold {self.size()} x {block.numel()} "
                             f"elements of {block.dtype}, not {whole.numel()} of "
                             f"{whole.dtype}")

    @staticmethod
    def _staged_pairs(stage: Staging, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                      check: Callable[[torch.Tensor, torch.Tensor], None]
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each (output, input) pair checked by ``check``, then as host tensors (the output
        written back after the call)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{len(outputs)} output tensors for {len(inputs)} inputs")
        for output, input in zip(outputs, inputs):
            check(output, input)
        return [(stage.host(o, load=False, store=True), stage.host(i))
                for o, i in zip(outputs, inputs)]

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        def prepare(stage: Staging) -> Prepared:
            pairs = self._staged_pairs(stage, outputs, inputs, lambda o, i: self._check_blocks(
                check_tensor(o, "output_tensor"), check_tensor(i, "input_tensor"), "output"))

            def run() -> list[torch.Tensor]:
                for output, input in pairs:
                    self._gather_into(output, input)
                return outputs

            return run, dict(count=_count(inputs), dtype=_dtype_field(inputs))

        return self._call("allgather", prepare)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Any:
        """``all_gather_into_tensor`` (``all_gather_single``)."""
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """``all_gather``: ``output_tensors[0][r]`` gets rank ``r``'s input. Ranks may
        give inputs of different sizes (as NCCL allows): output ``r`` must then hold as
        many elements as rank ``r``'s input, and every rank must pass the same sizes."""
        return self._allgather(lambda: output_tensors, input_tensors, output_tensors)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Any:
        """``all_gather_coalesced``: ``output_lists[r][i]`` gets rank ``r``'s ``input_list[i]``."""
        def per_input() -> list[list[torch.Tensor]]:
            if len(output_lists) != self.size():
                raise ValueError(f"all_gather_coalesced needs {self.size()} output lists, "
                                 f"not {len(output_lists)}")
            return [[outputs[i] for outputs in output_lists] for i in range(len(input_list))]

        return self._allgather(per_input, input_list, output_lists)

    def _allgather(self, output_lists: Callable[[], list[list[torch.Tensor]]],
                   input_tensors: list[torch.Tensor], result: list[list[torch.Tensor]]) -> Any:
        """All-gather each input into its list of outputs (``output_lists()``, one per
        input); the work's result is ``result`` (the caller's lists) as gloo's is."""
        def prepare(stage: Staging) -> Prepared:
            lists = output_lists()
            if len(lists) != len(input_tensors):
                raise ValueError(f"{len(lists)} output lists for {len(input_tensors)} inputs")
            gathered, sizes = [], []
            for outputs, input in zip(lists, input_tensors):
                check_tensor(input, "input_tensor")
                if len(outputs) != self.size():
                    raise ValueError(f"all_gather needs {self.size()} output tensors, "
                                     f"not {len(outputs)}")
                for out in outputs:
                    check_tensor(out, "output_tensor")
                    if out.dtype != input.dtype:
                        raise ValueError(f"all_gather's output tensors must have the "
                                         f"input's dtype ({input.dtype}), not {out.dtype}")
                mine = outputs[self.rank()]
                if mine.numel() != input.numel():
                    raise ValueError(f"all_gather's output tensor {self.rank()} (this "
                                     f"rank's) must hold the input's {input.numel()} "
                                     f"elements, not {mine.numel()}")
                sizes.append([out.numel() for out in outputs])
                gathered.append(([stage.host(o, load=False, store=True) for o in outputs],
                                 stage.host(input)))
            even = all(len(set(s)) == 1 for s in sizes)

            def run() -> Any:
                for outputs, input in gathered:
                    if even:   # one row per rank
                        parts = torch.empty((self.size(), input.numel()), dtype=input.dtype)
                        self._gather_into(parts, input)
                    else:
                        parts = self._gather_uneven(input, [o.numel() for o in outputs])
                    _copy_parts(outputs, parts)
                return _as_gloo_value(result)

            count: Any = _count(input_tensors) if even else _sizes_field(sizes)
            return run, dict(count=count, dtype=_dtype_field(input_tensors))

        return self._call("allgather", prepare)

    def _gather_uneven(self, input: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Every rank's ``input`` (rank ``r``'s has ``sizes[r]`` elements), by
        ``MPI_Iallgatherv``; returns one flat tensor per rank."""
        src = Host(input)
        recv = torch.empty(sum(sizes), dtype=input.dtype)
        counts = np.array(sizes, dtype=np.int64) * recv.element_size()
        self._native("allgather", lambda: self.comm.Iallgatherv(
            byte_view(src.work), [byte_view(recv), counts]),   # (blocks in rank order)
            count=None, dtype=str(input.dtype))
        return list(recv.split(sizes))

    # reduce-scatter -------------------------------------------------------------------------
    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._reduce_scatter(outputs, lambda: (inputs, None), opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Any:
        """``reduce_scatter_tensor`` (``reduce_scatter_single``)."""
        return self._reduce_scatter([output], lambda: ([input], None), opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        """``reduce_scatter`` (list form): rank ``r`` gets the reduction of every rank's
        ``input_tensors[0][r]``. The inputs may differ in size (as gloo and NCCL allow):
        then this rank's output must hold as many elements as its own input (index
        ``rank``), every rank must pass the same sizes, and the call runs as an all-reduce
        of the concatenated inputs."""
        def flat() -> tuple[list[torch.Tensor], list[list[int]] | None]:
            if len(output_tensors) != len(input_tensors):
                raise ValueError(f"{len(output_tensors)} output tensors for "
                                 f"{len(input_tensors)} input lists")
            sizes = []
            for output, inputs in zip(output_tensors, input_tensors):
                if len(inputs) != self.size():
                    raise ValueError(f"reduce_scatter needs {self.size()} input tensors, "
                                     f"not {len(inputs)}")
                for t in inputs:
                    check_tensor(t, "input_tensor")
                mine = inputs[self.rank()]
                if len({t.numel() for t in inputs}) > 1 and mine.numel() != output.numel():
                    raise ValueError(f"reduce_scatter's output must hold as many elements as "
                                     f"input tensor {self.rank()} (this rank's): "
                                     f"{mine.numel()}, not {output.numel()}")
                sizes.append([t.numel() for t in inputs])
            uneven = any(len(set(s)) > 1 for s in sizes)
            return ([torch.cat([t.reshape(-1) for t in inputs]) for inputs in input_tensors],
                    sizes if uneven else None)

        return self._reduce_scatter(output_tensors, flat, opts)

    def _reduce_scatter(self, outputs: list[torch.Tensor],
                        inputs: Callable[[], tuple[list[torch.Tensor], list[list[int]] | None]],
                        opts: Any) -> Any:
        """Reduce-scatter each input into its output. ``inputs()`` gives the flat inputs
        and, for uneven blocks, each input's block sizes (``None``: ``size()`` equal
        blocks)."""
        opts = opts or dist.ReduceScatterOptions()

        def prepare(stage: Staging) -> Prepared:
            op, factor = op_name(opts.reduceOp), premul_factor(opts.reduceOp)
            flat, sizes = inputs()

            def check(output: torch.Tensor, input: torch.Tensor) -> None:
                check_reduce_dtype(check_tensor(input, "input"), op, "input", factor)
                check_tensor(output, "output")
                if sizes is None:
                    self._check_blocks(input, output, "input")
                elif input.dtype != output.dtype:
                    raise ValueError(f"reduce_scatter's output is {output.dtype}, its "
                                     f"inputs {input.dtype}")

            pairs = self._staged_pairs(stage, outputs, flat, check)

            def run() -> list[torch.Tensor]:
                for i, (output, input) in enumerate(pairs):
                    if sizes is None:
                        src, dst = Host(input, True, factor), Host(output, True)
                        # an output inside its input (a block of it, as torch allows):
                        # the reduction reads a copy
                        send = src.array.copy() if np.may_share_memory(src.array, dst.array) \
                            else src.array
                        collectives.reduce_scatter(send, dst.array, op=op,
                                                   comm=self.comm, check=False)
                        dst.finish()
                    else:   # rank r gets block r (sizes[i][r] elements) of the reduction of
                        # every rank's input: an all-reduce of input (a copy: the concatenated list)
                        self._allreduce_host(input, op, factor)
                        start = sum(sizes[i][:self.rank()])
                        _copy_parts([output], [input[start:start + sizes[i][self.rank()]]])
                return outputs

            count: Any = _count(outputs) if sizes is None else _sizes_field(sizes)
            return run, dict(count=count, dtype=_dtype_field(outputs),
                             op=op_label(opts.reduceOp))

        return self._call("reduce_scatter", prepare)

    # gather, scatter ----------------------------------------------------------------------
    def _rooted_lists(self, kind: str, lists: list[list[torch.Tensor]], one: torch.Tensor,
                      root: int) -> list[torch.Tensor]:
        self._root(kind, root)
        if self.rank() != root:
            if lists and any(len(x) for x in lists):
                raise ValueError(f"{kind}: only the root (rank {root}) passes a tensor list")
            return []
        if len(lists) != 1 or len(lists[0]) != self.size():
            got = len(lists[0]) if len(lists) == 1 else f"{len(lists)} lists"
            raise ValueError(f"{kind} needs a list of {self.size()} tensors on the root, "
                             f"not {got}")
        for t in lists[0]:
            check_tensor(t, "tensor")
            if t.numel() != one.numel() or t.dtype != one.dtype:
                raise ValueError(f"{kind}: every tensor of the root's list must hold "
                                 f"{one.numel()} x {one.dtype}, not {t.numel()} x {t.dtype}")
        return list(lists[0])

    def _rooted(self, kind: str, lists: list[list[torch.Tensor]], tensors: list[torch.Tensor],
                root: int, run: Callable[[torch.Tensor, list[torch.Tensor]], Any]) -> MPIWork:
        """A gather (``lists``: the root's outputs; ``tensors``: the input) or a scatter (the
        root's inputs; the output), checked and staged; ``run(one, listed)`` runs it on
        their host tensors (``listed`` is ``[]`` off the root)."""
        gather = kind == "gather"
        name = "input" if gather else "output"

        def prepare(stage: Staging) -> Prepared:
            if len(tensors) != 1:
                raise ValueError(f"{kind} takes one {name} tensor, not {len(tensors)}")
            one = check_tensor(tensors[0], f"{name}_tensor")
            listed = [stage.host(t, load=not gather, store=gather)
                      for t in self._rooted_lists(kind, lists, one, root)]
            host = stage.host(one, load=gather, store=not gather)
            return (lambda: run(host, listed)), dict(count=one.numel(), dtype=str(one.dtype),
                                                     root=root)

        return self._call(kind, prepare)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = (opts or dist.GatherOptions()).rootRank

        def run(src: torch.Tensor, outs: list[torch.Tensor]) -> Any:
            send = Host(src)
            whole = torch.empty((len(outs), src.numel()), dtype=src.dtype)   # (root: size rows)
            recv = byte_view(whole) if self.rank() == root else None
            self._native("gather", lambda: self.comm.Igather(
                send.array.view(np.uint8), recv, root=root),
                count=src.numel(), dtype=str(src.dtype), root=root)
            _copy_parts(outs, whole)
            return _as_gloo_value(output_tensors)

        return self._rooted("gather", output_tensors, input_tensors, root, run)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = (opts or dist.ScatterOptions()).rootRank

        def run(dst: torch.Tensor, inputs: list[torch.Tensor]) -> Any:
            send = (byte_view(torch.stack([t.reshape(-1) for t in inputs]))
                    if self.rank() == root else None)
            recv = Host(dst)
            self._native("scatter", lambda: self.comm.Iscatter(
                send, recv.array.view(np.uint8), root=root),
                count=dst.numel(), dtype=str(dst.dtype), root=root)
            recv.finish()
            return output_tensors

        return self._rooted("scatter", input_tensors, output_tensors, root, run)

    # all-to-all -----------------------------------------------------------------------------
    def _alltoallv(self, kind: str, send: Callable[[], torch.Tensor], recv: torch.Tensor,
                   send_counts: list[int], recv_counts: list[int],
                   finish: Callable[[], Any]) -> Prepared:
        """``MPI_Ialltoallv`` of flat contiguous host buffers (counts in ``recv``'s elements)."""
        itemsize, dtype = recv.element_size(), str(recv.dtype)
        sc = np.array(send_counts, dtype=np.int64) * itemsize
        rc = np.array(recv_counts, dtype=np.int64) * itemsize

        def splits() -> BaseException | None:
            theirs = np.empty(self.size(), dtype=np.int64)
            self._ctx.p2p.Alltoall(sc, theirs)
            if (theirs != rc).any():
                return ValueError(f"{kind}: rank {self.rank()} expects "
                                  f"{(rc // itemsize).tolist()} elements from ranks 0..; they "
                                  f"send it {(theirs // itemsize).tolist()}")
            return None

        def run() -> Any:
            buf = send()
            self._native(kind, lambda: self.comm.Ialltoallv(
                [byte_view(buf), sc], [byte_view(recv), rc]), count=None, dtype=dtype)
            return finish()

        return run, dict(splits=splits, dtype=dtype, count=itemsize)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        def prepare(stage: Staging) -> Prepared:
            for name, lst in (("output", output_tensors), ("input", input_tensors)):
                if len(lst) != self.size():
                    raise ValueError(f"all_to_all needs {self.size()} {name} tensors, "
                                     f"not {len(lst)}")
                for t in lst:
                    check_tensor(t, f"{name}_tensor")
            dtypes = {t.dtype for t in (*output_tensors, *input_tensors)}
            if len(dtypes) != 1:
                raise ValueError(f"all_to_all's tensors must have one dtype, not {dtypes}")
            ins = [stage.host(t) for t in input_tensors]
            outs = [stage.host(t, load=False, store=True) for t in output_tensors]
            recv = torch.empty(_count(outs), dtype=input_tensors[0].dtype)

            def finish() -> list[torch.Tensor]:
                _copy_parts(outs, recv.split([o.numel() for o in outs]))
                return output_tensors

            return self._alltoallv(
                "alltoall", lambda: torch.cat([t.reshape(-1) for t in ins]), recv,
                [t.numel() for t in ins], [t.numel() for t in outs], finish)

        return self._call("alltoall", prepare)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Any:
        """``all_to_all_single``: even, or rows of dim 0 split as given."""
        def prepare(stage: Staging) -> Prepared:
            check_tensor(output, "output")
            check_tensor(input, "input")
            if output.dtype != input.dtype:
                raise ValueError(f"all_to_all_single: output is {output.dtype}, input "
                                 f"{input.dtype}")
            out_rows = self._splits("output", output, output_split_sizes)
            in_rows = self._splits("input", input, input_split_sizes)
            out_row = output.numel() // max(output.shape[0], 1) if output.dim() else 1
            in_row = input.numel() // max(input.shape[0], 1) if input.dim() else 1
            if output.numel() and input.numel() and out_row != in_row:
                raise ValueError(f"all_to_all_single: rows of output ({out_row} elements) and "
                                 f"input ({in_row}) differ")
            src = stage.host(input)
            recv = Host(stage.host(output, load=False, store=True))

            def finish() -> list[torch.Tensor]:
                recv.finish()
                return [output]

            return self._alltoallv(
                "alltoall_single", lambda: Host(src).work.reshape(-1), recv.work.reshape(-1),
                [r * in_row for r in in_rows], [r * out_row for r in out_rows], finish)

        return self._call("alltoall_single", prepare)

    def _splits(self, name: str, tensor: torch.Tensor, sizes: list[int]) -> list[int]:
        rows = tensor.shape[0] if tensor.dim() else tensor.numel()
        if not sizes:
            if rows % self.size():
                raise ValueError(f"all_to_all_single: {name}'s {rows} rows do not split "
                                 f"evenly over {self.size()} ranks; pass split sizes")
            return [rows // self.size()] * self.size()
        sizes = list(map(int, sizes))
        if len(sizes) != self.size() or min(sizes) < 0 or sum(sizes) != rows:
            raise ValueError(f"all_to_all_single: {name} split sizes {sizes} must be "
                             f"{self.size()} counts summing to its {rows} rows")
        return sizes

    # barriers ---------------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> Any:
        def prepare(stage: Staging) -> Prepared:
            def run() -> list[torch.Tensor]:
                self._native("barrier", lambda: self.comm.Ibarrier(), naps=True)
                return []   # (gloo's future value: no tensors)

            return run, {}

        return self._call("barrier", prepare)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier``: rank 0 waits ``timeout`` for every other rank and
        raises ``RuntimeError`` naming the first (``wait_all_ranks``: every) rank that did
        not arrive; the others wait as long for rank 0's release and raise if it does not
        come. Runs after the group's queued operations. Its tokens travel on the group's
        collective communicator, where no point-to-point message of the user's (those use
        the group's point-to-point duplicate, any tag) or of mpicoll's algorithms (their
        context's duplicate) can meet them; the tag counts the barriers, so a late token
        of a barrier that failed matches no later one."""
        limit = seconds(timeout) or self._lane.timeout or 1800.0
        self._monitored += 1
        tag = self._monitored % p2p.check_tag(0x7FFF)
        comm = self.comm

        def check() -> BaseException | None:
            return self._failures.poll("monitored_barrier")

        def run() -> None:
            self._sends = _pending(self._sends)
            if self.rank() != 0:
                self._sends.append(comm.Isend(_TOKEN, dest=0, tag=tag))
                release = comm.Irecv(_SINK, source=0, tag=tag)
                if _wait_all([release], limit, check):
                    release.Cancel()
                    raise RuntimeError(f"Rank {self.rank()}: monitored_barrier was not "
                                       f"released by rank 0 within {limit * 1e3:.0f} ms")
                return
            others = list(range(1, self.size()))
            requests = [comm.Irecv(_SINK, source=r, tag=tag) for r in others]
            missing = _wait_all(requests, limit, check)
            if missing:
                for r in missing:
                    requests[r - 1].Cancel()
                shown = missing if wait_all_ranks else missing[:1]
                names = ", ".join(str(r) for r in shown)
                raise RuntimeError(f"Rank{'s' if len(shown) > 1 else ''} {names} failed to "
                                   f"pass monitoredBarrier in {limit * 1e3:.0f} ms")
            for r in others:
                self._sends.append(comm.Isend(_TOKEN, dest=r, tag=tag))

        self.submit("monitored_barrier", run).wait(timedelta(seconds=2 * limit + 5))

    # point-to-point ---------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803
        return p2p.post(self, tensors, dstRank, tag, send=True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        return p2p.post(self, tensors, srcRank, tag, send=False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return p2p.post(self, tensors, MPI.ANY_SOURCE, tag, send=False)

    # life cycle -------------------------------------------------------------------------------
    def set_timeout(self, timeout: timedelta) -> None:
        """Make ``timeout`` the group's: ``Work.wait()``'s default limit from now on
        (``pg.set_timeout(...)`` on torch's group calls it; so does ``options._timeout``
        reflect it)."""
        self._lane.timeout = seconds(timeout)
        self.options._timeout = timeout

    _set_default_timeout = set_timeout   # gloo's and NCCL's name

    def shutdown(self) -> None:
        """Finish the queued operations, stop the group's lanes and free its
        communicators (``destroy_process_group``). Lanes that make no progress for
        :data:`SHUTDOWN_STALL_S` seconds (an operation the other ranks never joined) are
        aborted: under ULFM the communicators are revoked; without ULFM the job ends
        with that message (an MPI call cannot be cancelled). The default group's
        :data:`.reconfigure.PARENT` goes with it. Idempotent."""
        if self._shut:
            return
        self._shut = True
        for lane in (self._lane, self._futures.lane):
            if not lane.close(SHUTDOWN_STALL_S):
                lane.abort(CollectiveTimeoutError(
                    f"mpicoll: {lane.name} made no progress for {SHUTDOWN_STALL_S:g} s "
                    f"while shutting down (an operation the other ranks never joined)"))
                lane.close(0.0)
        self._futures.close()
        if any(c is parent for c in self._owned for parent in reconfigure.PARENT):
            reconfigure.PARENT.clear()   # later groups (another default group's) from the world
        for comm in self._owned:
            comms.free(comm)
        _live.discard(self)

    def abort(self) -> None:
        """Fail the work in flight and every queued work; the group is broken (under ULFM
        its communicators are revoked, so the MPI call in flight ends; without ULFM using
        the group again or destroying it with an operation in flight ends the job)."""
        error = CollectiveError(f"mpicoll: process group {self._lane.name} was aborted")
        self._lane.abort(error)
        self._futures.lane.abort(error)


@functools.cache
def _warn_synchronous() -> None:
    """Say once that operations run on the calling thread (MPI below THREAD_MULTIPLE)."""
    warnings.warn("MPI is initialised below MPI_THREAD_MULTIPLE: the mpicoll "
                  "torch.distributed backend runs every operation synchronously on the "
                  "calling thread (async_op=True overlaps nothing)", RuntimeWarning,
                  stacklevel=4)


def _as_gloo_value(outputs: list[list[torch.Tensor]]) -> Any:
    """The result of a work with these lists of output tensors as gloo's future holds it
    (``returnFutureWithOutput``): one list as itself, several as the list of them, none
    as ``[]``."""
    return outputs[0] if len(outputs) == 1 else outputs


def _pending(requests: list[Any]) -> list[Any]:
    """The requests of ``requests`` not complete yet (all of them after an error: a send
    to a failed rank must not be freed)."""
    try:
        return [r for r in requests if not r.Test()]
    except MPI.Exception:
        failures.keep_requests(requests)
        return []


def _wait_all(requests: list[Any], limit: float,
              check: Callable[[], BaseException | None]) -> list[int]:
    """Test ``requests`` until all complete or ``limit`` seconds pass; returns the 1-based
    indices of those that did not (``[]``: all completed). ``check`` (called between
    tests) returns an error to raise instead (a failed peer)."""
    deadline = time.monotonic() + limit
    done = [False] * len(requests)
    pause = 1e-5
    while True:
        error = check()
        if error is not None:
            failures.keep_requests(requests)
            raise error
        done = [d or req.Test() for d, req in zip(done, requests)]
        if all(done) or time.monotonic() >= deadline:
            return [i + 1 for i, d in enumerate(done) if not d]
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)


def _gather_source(src: np.ndarray, dst: np.ndarray, rank: int) -> Any:
    """What an all-gather of ``src`` into ``dst`` sends: ``IN_PLACE`` where ``src`` is
    exactly this rank's block of ``dst`` (FSDP2 gathers so), a copy where the two overlap
    otherwise, else ``src`` itself."""
    if not np.may_share_memory(src, dst):
        return src
    flat = dst.reshape(-1)
    block = flat[rank * src.size:(rank + 1) * src.size]
    if (src.dtype == dst.dtype and src.flags.c_contiguous and block.size == src.size
            and block.__array_interface__["data"][0] == src.__array_interface__["data"][0]):
        return IN_PLACE
    return src.copy()
