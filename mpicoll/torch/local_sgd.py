"""Local SGD and hierarchical SGD: when each rank steps alone and when replicas are averaged.

Shared by :func:`mpicoll.torch.DistributedOptimizer` (all-reduce backend) and the
parameter-server optimizer (:mod:`mpicoll.torch.ps_optimizer`); imports neither.

Three settings (``sync_every=H``, ``node_sync_every=M``, ``warmup_steps=K``) define, for
optimizer step ``k`` (1, 2, ...), its *sync level* ``G``: :data:`WORLD` for the warm-up
steps ``k <= K`` and then for every ``H``-th step after it (``(k - K) % H == 0``),
:data:`NODE` for every ``M``-th step after it that is not a world step, :data:`NONE`
otherwise. :class:`LocalSGDSchedule` also remembers over which group the replicas are known
to be identical when a step starts (``I``: :data:`WORLD` at the start, as for ordinary
training, which assumes broadcast initial parameters). Then a step

- with ``I >= G`` (the replicas of group ``G`` start equal) averages the *gradients* over
  ``G`` and steps: for ``G = WORLD`` this is ordinary synchronous training, so ``H = 1`` and
  the warm-up are exactly (bit for bit) the ordinary optimizer; with ``M = 1`` every step
  averages gradients within the node (torch's post-local SGD with intra-node subgroups);
- with ``I < G`` steps on the rank's own gradients, then averages the parameters (and,
  with ``average_state=True``, the optimizer state) over ``G``: the local SGD step
  (torch's ``PeriodicModelAverager`` / ``HierarchicalModelAverager`` order: step, then
  average).

Either way the replicas of ``G`` hold identical parameters after the step (``I := G``).

:class:`Averager` averages lists of tensors over the node or over every rank with
mpicoll's all-reduce (:data:`ALGORITHMS`: ring over every rank, recursive doubling within
a node) on a communicator private to its client (the hvd engine's side communicator, the
parameter server's workers'), on the caller's thread: every rank gets the same bits.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable, NamedTuple

import torch
from mpi4py import MPI

from ..checked import agree
from ..collectives import allreduce
from ..context import get_context
from ..validation import check_int
from ..runtime import comms
from ..runtime import world as runtime_world
from .engine.dtypes import reduce_dtype

__all__ = ["NONE", "NODE", "WORLD", "LocalSGDSettings", "StepPlan", "LocalSGDSchedule",
           "check_settings", "agree_settings", "Averager", "state_tensors", "LocalSGD"]

#: Sync levels, ordered: a larger level's group contains the smaller one's.
NONE, NODE, WORLD = 0, 1, 2
LEVEL_NAMES = {NONE: "none", NODE: "node", WORLD: "world"}

#: The all-reduce of each level's averages; both give bit-identical results on every rank
#: (ring: each value reduced on one rank and copied; recursive doubling: both partners of an
#: exchange add the lower rank's operand first). Within a node bandwidth is cheap and each
#: message step costs latency, so the node level takes the fewest steps.
ALGORITHMS = {NODE: "recursive_doubling", WORLD: "ring"}


class LocalSGDSettings(NamedTuple):
    """Validated settings (see :func:`check_settings`)."""

    sync_every: int = 1
    node_sync_every: int | None = None
    warmup_steps: int = 0
    average_state: bool = True

    @property
    def enabled(self) -> bool:
        """Whether any step can be other than ordinary synchronous training."""
        return self.sync_every != 1 or self.node_sync_every is not None


class StepPlan(NamedTuple):
    """What one step does: average the gradients over ``grads`` before it, the parameters
    (and state) over ``params`` after it (:data:`NONE`: nothing)."""

    step: int
    level: int
    grads: int
    params: int


def check_settings(sync_every: Any = 1, node_sync_every: Any = None, warmup_steps: Any = 0,
                   average_state: Any = True) -> LocalSGDSettings:
    """Validate the local SGD settings on this rank (no communication).

    Args:
        sync_every: ``H >= 1``: average over every rank after every ``H``-th step (1:
            ordinary synchronous training).
        node_sync_every: ``None`` or ``M`` with ``1 <= M < H``: average over the node
            after every ``M``-th step.
        warmup_steps: ``K >= 0`` fully synchronous steps first (post-local SGD, as torch's
            ``start_localSGD_iter`` / averagers' ``warmup_steps``; the steps after it are
            counted from its end, which torch's averagers do not: docs/torch.md).
        average_state: average the optimizer state with the parameters.
    Returns:
        The settings.
    Raises:
        TypeError: a setting of the wrong type.
        ValueError: a setting out of range.
    """
    h = check_int("sync_every", sync_every, 1)
    m = None
    if node_sync_every is not None:
        m = check_int("node_sync_every", node_sync_every, 1)
        if m >= h:
            raise ValueError(f"node_sync_every ({m}) must be smaller than sync_every ({h}): "
                             f"the node averages more often than all ranks")
    k = check_int("warmup_steps", warmup_steps, 0)
    if not isinstance(average_state, bool):
        raise TypeError(f"average_state must be a bool, not {type(average_state).__name__}")
    return LocalSGDSettings(h, m, k, average_state)


def agree_settings(comm: MPI.Intracomm, error: BaseException | None,
                   settings: LocalSGDSettings | None, layout: str = "") -> None:
    """Collectively check that every rank of ``comm`` has valid, equal settings (and the
    same parameter ``layout``): return normally only then.

    Raises:
        The local ``error`` on the rank that had it, :class:`mpicoll.RemoteError` on the
        others (:func:`mpicoll.checked.agree`); ``ValueError`` with the same message on
        every rank when ranks disagree.
    """
    agree(get_context(comm), error, collective="DistributedOptimizer(sync_every=...)")
    mine = (tuple(settings), layout)
    every = comm.allgather(mine)
    if any(other != every[0] for other in every):
        listing = "; ".join(f"rank {r}: sync_every={s[0]}, node_sync_every={s[1]}, "
                            f"warmup_steps={s[2]}, average_state={s[3]}, parameters {lay}"
                            for r, (s, lay) in enumerate(every))
        raise ValueError(f"local SGD settings or parameters differ across ranks "
                         f"(every rank must pass the same ones): {listing}")


class LocalSGDSchedule:
    """The step plans of :class:`LocalSGDSettings` (pure: no communication)."""

    def __init__(self, settings: LocalSGDSettings) -> None:
        self.settings = settings
        #: Optimizer steps finished.
        self.steps = 0
        #: Over which group the replicas are identical now (see the module docstring).
        self.identical = WORLD

    def level(self, step: int) -> int:
        """The sync level of step ``step`` (1-based)."""
        s = self.settings
        local = step - s.warmup_steps
        if local <= 0 or local % s.sync_every == 0:
            return WORLD
        if s.node_sync_every is not None and local % s.node_sync_every == 0:
            return NODE
        return NONE

    def peek(self) -> StepPlan:
        """The plan of the next step."""
        step = self.steps + 1
        level = self.level(step)
        if self.identical >= level:
            return StepPlan(step, level, level, NONE)
        return StepPlan(step, level, NONE, level)

    def advance(self) -> StepPlan:
        """Record that the next step finished; return its plan."""
        plan = self.peek()
        self.steps = plan.step
        self.identical = plan.level
        return plan

    def state_dict(self) -> dict:
        """The step count and the identical level (for checkpoints)."""
        return {"steps": self.steps, "identical": self.identical}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.steps = int(state["steps"])
        self.identical = int(state["identical"])


def state_tensors(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]
                  ) -> list[torch.Tensor]:
    """The optimizer state averaged with the parameters: every floating-point tensor of
    each parameter's state with as many elements as the parameter (``momentum_buffer``,
    Adam's ``exp_avg``/``exp_avg_sq``, ``max_exp_avg_sq``, RMSprop's ``square_avg`` ...),
    in parameter order and then key order. Step counters and other scalars are left
    alone (equal on every rank: every rank steps as often)."""
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        for key in sorted(state, key=str):
            value = state[key]
            if key != "step" and isinstance(value, torch.Tensor) \
                    and value.is_floating_point() and not value.is_sparse \
                    and value.numel() == p.numel():
                out.append(value)
    return out


def layout_of(tensors: Iterable[torch.Tensor]) -> str:
    """A short fingerprint of tensors' dtypes and shapes (what ranks must agree on)."""
    described = repr([(str(t.dtype), tuple(t.shape)) for t in tensors]).encode()
    return f"crc32 {zlib.crc32(described):08x}"


class Averager:
    """Averages tensors over every rank of a communicator or over this rank's node.

    Collective over ``comm`` at construction (the node layout of
    :class:`mpicoll.topology.Topology`: ``MPICOLL_RANKS_PER_NODE`` emulates nodes).

    Args:
        comm: a communicator that only the averager's client uses, on the thread that
            averages (the averager makes none of its own, and frees none).
    Attributes:
        comm: ``comm`` (every rank).
        node_comm: this rank's node.
        bytes_sent: bytes this rank's averages sent, by level name (counted as a ring
            all-reduce's ``2 (n - 1) / n`` of the vector).
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        topology = get_context(self.comm).topology
        self.node_comm = topology.node_comm
        self.num_nodes = topology.num_nodes
        self.bytes_sent = {"node": 0, "world": 0}

    def group(self, level: int) -> MPI.Intracomm | None:
        """The communicator of ``level`` (``None`` for :data:`NONE`)."""
        return {NONE: None, NODE: self.node_comm, WORLD: self.comm}[level]

    def average(self, tensors: list[torch.Tensor], level: int, check: bool = True) -> None:
        """Replace each tensor by its average over ``level``'s group, in place.

        Tensors are packed per dtype into one host buffer (CUDA tensors are staged;
        bfloat16 in float32, rounded back once), which one ring all-reduce averages. ``check``: run mpicoll's agreement step first (ranks
        with other counts or dtypes raise :class:`mpicoll.MismatchError` on every rank
        instead of hanging); ``False`` only for tensors whose layout the ranks already
        agreed on (the parameters and their gradients, checked at construction).
        """
        comm = self.group(level)
        if comm is None or comm.Get_size() == 1 or not tensors:
            return
        n = comm.Get_size()
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            with torch.no_grad():
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in group]).to(
                    reduce_dtype(dtype))                  # (bfloat16: averaged in float32)
                buf = flat.numpy()
                allreduce(buf, buf, op="average", comm=comm, algorithm=ALGORITHMS[level],
                          check=check)
                for t, part in zip(group, torch.split(flat, [t.numel() for t in group])):
                    t.copy_(part.view(t.shape))           # to the tensor's device
            self.bytes_sent[LEVEL_NAMES[level]] += 2 * (n - 1) * buf.nbytes // n


class LocalSGD:
    """The local SGD driver of one distributed optimizer.

    Args:
        optimizer: the wrapped optimizer (its ``state`` is averaged with ``average_state``).
        params: the parameters, in the same order on every rank.
        settings: from :func:`check_settings`.
        averager: the :class:`Averager` over the ranks that train (``None``, with
            ``regroup``: built by ``regroup`` at the first use, collectively).
        average_world_params: optional replacement for the world-level average of the
            parameters (the parameter server pushes them to its servers).
        regroup: optional; builds the averager of the ranks that train now, at the first
            use after the runtime's world changed (:func:`mpicoll.runtime.world.generation`:
            ``hvd.elastic`` shrank or grew it) or the averager's communicator was released
            (its hvd engine stopped); collective (every rank's first step then). The new
            rank 0's schedule is taken, so every rank syncs at the same steps again (the
            parameters are identical by then: the elastic state's ``sync()``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 settings: LocalSGDSettings, averager: Averager | None,
                 average_world_params: Callable[[], None] | None = None,
                 regroup: Callable[[], Averager] | None = None) -> None:
        self.optimizer = optimizer
        self.params = params
        self.settings = settings
        self.schedule = LocalSGDSchedule(settings)
        self.averager = averager
        self._world_params = average_world_params
        self._regroup = regroup
        #: The world generation the averager was built for (-1: none built yet).
        self.generation = runtime_world.generation() if averager is not None else -1
        #: Times the averager moved to a new world (``hvd.elastic`` resets).
        self.rebuilds = 0
        #: The plans of the finished steps' averages, counted by level name.
        self.counts = {"grads.node": 0, "grads.world": 0, "params.node": 0,
                       "params.world": 0}

    def _follow_world(self) -> None:
        """Build the averager again if the world changed or its communicator is gone."""
        if self._regroup is None or (runtime_world.generation() == self.generation
                                     and comms.record_of(self.averager.comm) is not None):
            return
        self.averager = self._regroup()
        self.generation = runtime_world.generation()
        self.schedule.load_state_dict(
            self.averager.comm.bcast(self.schedule.state_dict(), root=0))
        self.rebuilds += 1

    def peek(self) -> StepPlan:
        """The plan of the coming step."""
        self._follow_world()
        return self.schedule.peek()

    def local_gradients(self, level: int) -> None:
        """Average this step's gradients over the node (``level`` :data:`NODE`); a dense
        zero gradient stands in for a missing one, a sparse one is made dense."""
        if level != NODE:
            return
        self._follow_world()
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        self.averager.average(grads, NODE, check=False)   # the parameters' layout

    def after_step(self) -> StepPlan:
        """Average what the finished step's plan says (parameters, then state); advance."""
        self._follow_world()
        plan = self.schedule.advance()
        if plan.grads != NONE:
            self.counts[f"grads.{LEVEL_NAMES[plan.grads]}"] += 1
        if plan.params == NONE:
            return plan
        state = state_tensors(self.optimizer, self.params) if self.settings.average_state \
            else []
        # the optimizer state appears lazily (and only where a parameter had a gradient):
        # its layout is checked on every average that includes it
        if plan.params == WORLD and self._world_params is not None:
            self._world_params()
            self.averager.average(state, WORLD)
        else:
            self.averager.average(list(self.params) + state, plan.params,
                                  check=self.settings.average_state)
        self.counts[f"params.{LEVEL_NAMES[plan.params]}"] += 1
        return plan

    def stats(self) -> dict:
        """Steps, averages done per kind, and the bytes this rank's averages sent."""
        return {"steps": self.schedule.steps, "identical": LEVEL_NAMES[self.schedule.identical],
                "rebuilds": self.rebuilds, **self.counts, "bytes_sent": dict(self.averager.bytes_sent)}
