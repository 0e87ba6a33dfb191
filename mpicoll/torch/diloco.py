"""DiLoCo and Streaming DiLoCo: inner steps alone, outer steps on averaged pseudo-gradients.

``DiLoCo(model, inner_optimizer, outer_optimizer, sync_every=H)`` is DiLoCo's Algorithm 1
(Douillard et al., 2023):

1. ``θ_g``, the global parameters, are the model's parameters at construction: rank 0's,
   broadcast (the model's own parameters on every rank are set to them);
2. each rank takes ``H`` inner steps with ``inner_optimizer``, whose state stays its own;
3. the pseudo-gradient ``Δ = θ_g - θ_local`` is averaged over the ranks;
4. the parameters are set back to ``θ_g`` and ``outer_optimizer`` steps with
   ``grad = mean Δ`` (typically SGD with Nesterov momentum);
5. ``θ_g`` becomes the result, and the ranks go on from it.

Streaming DiLoCo (Douillard et al., 2025) adds, as torchft's ``DiLoCo`` does
(``fragment_sync_delay``, ``fragment_update_alpha``, ``should_quantize``):

- ``fragments=F``: the parameters are cut into ``F`` fragments (contiguous runs balanced by
  element count, or the modules given), each synced every ``H`` steps, ``H / F`` steps
  apart (:mod:`.diloco_plan`);
- ``overlap=τ``: a fragment's pseudo-gradient is taken ``τ`` inner steps before its outer
  step and its all-reduce runs meanwhile; on arrival the outer step is taken from ``θ_g``
  and the fragment becomes ``lerp(θ_g, θ_local, alpha)`` (``θ_local``: this rank's
  parameters after the ``τ`` steps);
- ``compression=``: the pseudo-gradients travel through one of mpicoll's codecs (``"int4"``
  among them) with error feedback.

``θ_g`` is bitwise equal on every rank after every outer step: the all-reduce gives every
rank the same bits (ring or hierarchical; the compressed ring likewise) and the outer
optimizer is deterministic.

A client of the runtime (docs/design.md): its communicator is a duplicate made by
:mod:`mpicoll.runtime.comms` (owner ``"diloco"``), and the overlapped all-reduces run on a
:class:`mpicoll.runtime.progress.Lane` (inline below ``MPI_THREAD_MULTIPLE``: then the
all-reduce completes before ``step()`` returns and nothing overlaps). It makes no thread
and no communicator of its own. See docs/diloco.md.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from mpi4py import MPI

from ..checked import agree
from ..collectives import allreduce, broadcast
from ..compression import ErrorFeedback, get_codec
from ..compression import allreduce as compressed_allreduce
from ..compression import last_stats
from ..context import get_context
from ..elastic import grow
from ..errors import MismatchError
from ..runtime import comms
from ..runtime import world as runtime_world
from ..runtime.progress import Lane, Work, completed
from .diloco_plan import DiLoCoSchedule, DiLoCoSettings, balanced_runs, check_settings
from .local_sgd import layout_of

__all__ = ["DiLoCo"]

#: Parameter dtypes DiLoCo keeps ``θ_g`` of (the all-reduce runs on numpy buffers).
DTYPES = (torch.float16, torch.float32, torch.float64)

#: Format of :meth:`DiLoCo.state_dict`.
STATE_FORMAT = 1


class _Group:
    """The parameters of one dtype in one fragment, with ``θ_g`` and the pseudo-gradient
    as flat host tensors (the pseudo-gradient buffer is what the all-reduce reduces in
    place)."""

    def __init__(self, fragment: int, params: list[torch.Tensor]) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.sizes = [p.numel() for p in params]
        count = sum(self.sizes)
        self.global_ = torch.empty(count, dtype=self.dtype)
        self.delta = torch.zeros(count, dtype=self.dtype)
        self.key = f"fragment{fragment}.{str(self.dtype).replace('torch.', '')}"

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into one view per parameter, shaped like it."""
        return [part.view(p.shape) for part, p in zip(torch.split(flat, self.sizes), self.params)]

    def local(self) -> torch.Tensor:
        """This rank's parameters, flat, on the host (a new tensor)."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.params])


class _Fragment:
    """One fragment: its parameters (model order) grouped by dtype."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.index = index
        self.params = params
        self.groups = [_Group(index, [p for p in params if p.dtype == d])
                       for d in sorted({p.dtype for p in params}, key=str)]
        self.numel = sum(p.numel() for p in params)


def _module_fragments(model: torch.nn.Module, params: list[torch.Tensor],
                      modules: Sequence[Any]) -> list[list[int]]:
    """The parameter indices (model order) of each module given as a fragment.

    Raises:
        TypeError: an entry that is not an ``nn.Module``.
        ValueError: a module without parameters, a parameter in two modules or not in the
            model, or a parameter of the model in none of them.
    """
    index = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, int] = {}
    out = []
    for f, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"fragments[{f}] must be an nn.Module, not {type(module).__name__}")
        mine = []
        for p in module.parameters():
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"fragments[{f}] holds a parameter that is not the model's")
            if i in owner:
                raise ValueError(f"fragments[{f}] and fragments[{owner[i]}] share a parameter "
                                 f"(parameter {i} of the model)")
            owner[i] = f
            mine.append(i)
        if not mine:
            raise ValueError(f"fragments[{f}] has no parameters")
        out.append(sorted(mine))
    missing = [i for i in range(len(params)) if i not in owner]
    if missing:
        raise ValueError(f"the fragments leave out parameters {missing} of the model (every "
                         f"parameter must be in one fragment)")
    return out


def _as_tuples(value: Any) -> Any:
    """``value`` with every list made a tuple, recursively (a saved fingerprint)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def _check_optimizer(name: str, opt: Any) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"{name} must be a torch.optim.Optimizer, not {type(opt).__name__}")


class DiLoCo:
    """DiLoCo / Streaming DiLoCo over every rank of a communicator.

    Collective at construction (every rank of ``comm``, with the same settings and
    parameter shapes), and at every :meth:`step` that sends or receives a fragment: every
    rank must call :meth:`step` equally often (ranks that do not raise ``MismatchError``,
    at the latest in :meth:`close`). Construction sets every rank's parameters to rank
    0's: restore a checkpoint after it. Buffers are not synced; frozen parameters
    (``requires_grad=False``) are never moved by the outer optimizer.

    Args:
        model: the model; its parameters (``model.parameters()``, in that order) are
            synced. float16/32/64 tensors (float32/64 with ``compression``), on any device
            (``θ_g`` and the pseudo-gradients live in host memory).
        inner_optimizer: steps each rank's parameters on its own gradients (every
            :meth:`step`); its state is never communicated.
        outer_optimizer: steps ``θ_g`` with the averaged pseudo-gradient as its gradient
            (the paper: SGD, lr 0.7, Nesterov momentum 0.9), over the model's parameters;
            or a list of ``F`` optimizers, one per fragment.
        sync_every: ``H``: inner steps between two outer steps of a fragment.
        fragments: ``F`` (an int: contiguous runs of parameters balanced by element count)
            or a sequence of ``nn.Module`` s of the model whose parameters partition the
            model's. ``H`` must be a multiple of ``F``.
        overlap: ``τ`` inner steps the fragment's all-reduce overlaps; ``0 <= τ < H / F``.
        alpha: with ``overlap > 0``, an arriving fragment becomes
            ``lerp(θ_g, θ_local, alpha) = θ_g + alpha (θ_local - θ_g)``; ``[0, 1]``.
        compression: ``None`` (exact all-reduce), a codec name (``"int8"``, ``"int4"``,
            ``"fp16"``, ``"topk:0.01"``, ...) or a :class:`~mpicoll.compression.Codec`;
            with error feedback on the pseudo-gradient (one residual per fragment and
            dtype, this rank's own).
        comm: the ranks (``None``: the runtime's current world); DiLoCo works on a
            duplicate of it.
    Raises:
        TypeError, ValueError: bad arguments; raised on every rank when any rank has
            them (the same type; the message names the rank), and ``ValueError`` on every
            rank when the ranks' settings or parameter shapes differ.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Any, sync_every: int, fragments: Any = 1,
                 overlap: int = 0, alpha: float = 0.5, compression: Any = None,
                 comm: MPI.Intracomm | None = None) -> None:
        parent = runtime_world.comm() if comm is None else comm
        if not isinstance(parent, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intracommunicator, not "
                            f"{type(comm).__name__}")
        error: BaseException | None = None
        try:
            self._configure(model, inner_optimizer, outer_optimizer, sync_every, fragments,
                            overlap, alpha, compression)
        except (TypeError, ValueError) as exc:
            error = exc
        #: Whether DiLoCo follows the runtime's world (``comm=None``): after an elastic
        #: reconfiguration it moves to the new world (:meth:`_follow_world`).
        self._follows = comm is None
        #: The fragment whose all-reduce is in flight and its work (``None``: none).
        self._pending: tuple[int, Work] | None = None
        self._closed = False
        if self._follows and error is None and grow.joining():
            # a process that joined a running job, before its elastic state's first sync
            # (the running ranks are there): no collective now; the first use moves to
            # the grown world as the running ranks do, and the sync gives θ_g
            self.comm, self._lane, self.generation = None, None, -1
            return
        self.comm = comms.dup(parent, "diloco")
        try:
            self._agree(error)
        except BaseException:
            comms.free(self.comm)
            raise
        self._setup_world()
        self._broadcast_initial()

    # ------------------------------------------------------------------ construction
    def _setup_world(self) -> None:
        """What depends on the ranks of ``self.comm``: the node layout, the algorithm,
        the lane (collective over ``self.comm``)."""
        self.generation = runtime_world.generation()
        topology = get_context(self.comm).topology
        #: The all-reduce of uncompressed pseudo-gradients: hierarchical (intra-node
        #: reduce-scatter, inter-node all-reduce of the shards, intra-node all-gather)
        #: when some node holds several of the ranks and there are several nodes.
        self.algorithm = "hierarchical" if topology.num_nodes > 1 and \
            max(topology.node_sizes) > 1 else "ring"
        self.num_nodes = topology.num_nodes
        self._topology = topology
        self._nodes = self.comm.allgather(topology.node_index)
        self._lane = Lane("mpicoll.torch.diloco", self.comm) if self.settings.overlap else None

    def _follow_world(self) -> None:
        """After an elastic reconfiguration (the runtime's world generation changed, see
        :mod:`mpicoll.elastic`), move to the new world: the all-reduce in flight ran on the
        old one and is dropped (the lost rank's pseudo-gradient with it: the next outer
        step averages over the survivors), the old duplicate is freed and a new one made.
        Collective over the new world; the elastic restore that follows sets ``θ_g`` and
        the outer state from the last commit (:meth:`load_state_dict`)."""
        if not self._follows or runtime_world.generation() == self.generation \
                or grow.joining():     # (a new process's: at its state's first sync)
            return
        self._pending = None
        lane, self._lane = self._lane, None
        try:
            if lane is not None:
                lane.close()
        finally:
            comms.free(self.comm)       # the old world's duplicate
        self.comm = comms.dup(runtime_world.comm(), "diloco")
        self._setup_world()

    def _configure(self, model: Any, inner: Any, outer: Any, sync_every: Any,
                   fragments: Any, overlap: Any, alpha: Any, compression: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, not {type(model).__name__}")
        _check_optimizer("inner_optimizer", inner)
        modules = list(fragments) if isinstance(fragments, (list, tuple)) else None
        if modules == []:
            raise ValueError("fragments must not be an empty list")
        count = fragments if modules is None else len(modules)
        self.settings: DiLoCoSettings = check_settings(sync_every, count, overlap, alpha)
        outers = list(outer) if isinstance(outer, (list, tuple)) else [outer]
        for i, opt in enumerate(outers):
            _check_optimizer("outer_optimizer" if len(outers) == 1 else
                             f"outer_optimizer[{i}]", opt)
        if len(outers) not in (1, self.settings.fragments):
            raise ValueError(f"outer_optimizer: a list of {len(outers)} optimizers for "
                             f"{self.settings.fragments} fragments (one, or one per fragment)")
        params = list(model.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        codec = None if compression is None else get_codec(compression)
        for i, p in enumerate(params):
            if p.dtype not in DTYPES:
                raise TypeError(f"parameter {i} has dtype {p.dtype}; DiLoCo syncs "
                                f"float16, float32 and float64 parameters")
            if codec is not None:
                codec.check_dtype(str(p.dtype).replace("torch.", ""), f"parameter {i}")
        if modules is None:
            members = [list(range(a, b)) for a, b in
                       balanced_runs([p.numel() for p in params], self.settings.fragments)]
        else:
            members = _module_fragments(model, params, modules)
        if any(opt is inner for opt in outers):
            raise ValueError("outer_optimizer is the inner optimizer: DiLoCo needs an outer "
                             "optimizer of its own over the model's parameters")
        held = [{id(p) for group in opt.param_groups for p in group["params"]} for opt in outers]
        for f, idx in enumerate(members):   # (an outer step would not move the others)
            missing = [i for i in idx if params[i].requires_grad and
                       id(params[i]) not in held[f if len(outers) > 1 else 0]]
            if missing:
                raise ValueError(f"outer_optimizer{f'[{f}]' if len(outers) > 1 else ''} "
                                 f"does not hold the model's parameters {missing[:5]} "
                                 f"(fragment {f}): build it over them")
        self.model = model
        self.inner_optimizer = inner
        self.outer_optimizers = outers
        self.params = params
        self.codec = codec
        self.feedback = ErrorFeedback() if codec is not None and codec.lossy else None
        self.members = members
        self.fragments = [_Fragment(f, [params[i] for i in idx])
                          for f, idx in enumerate(members)]
        self.schedule = DiLoCoSchedule(self.settings)
        #: Inner steps taken.
        self.steps = 0
        #: Outer steps taken, per fragment.
        self.outer_steps = [0] * self.settings.fragments
        #: Bytes this rank's pseudo-gradient all-reduces sent: ``"total"`` and
        #: ``"inter_node"`` (uncompressed: computed from the algorithm's schedule;
        #: compressed: the payload bytes the codec's collective reports).
        self.bytes_sent = {"total": 0, "inter_node": 0}

    def _fingerprint(self) -> tuple:
        return (tuple(self.settings), layout_of(self.params), tuple(map(tuple, self.members)),
                None if self.codec is None else self.codec.name, len(self.outer_optimizers))

    def _agree(self, error: BaseException | None) -> None:
        """Every rank's verdict on its arguments, then equal settings: raise on every rank
        otherwise (control metadata: lowercase all-gather on DiLoCo's communicator)."""
        mine = (None if error is None else (type(error).__name__, str(error)),
                None if error is not None else self._fingerprint())
        every = self.comm.allgather(mine)
        bad = {r: e for r, (e, _) in enumerate(every) if e is not None}
        if bad:
            if error is not None:
                raise error
            kinds = {kind for kind, _ in bad.values()}
            listing = "; ".join(f"rank {r}: {kind}: {msg}" for r, (kind, msg) in bad.items())
            cls = TypeError if kinds == {"TypeError"} else ValueError
            raise cls(f"DiLoCo: other ranks rejected their arguments ({listing})")
        prints = [p for _, p in every]
        if any(p != prints[0] for p in prints):
            listing = "; ".join(f"rank {r}: sync_every={p[0][0]}, fragments={p[0][1]}, "
                                f"overlap={p[0][2]}, alpha={p[0][3]}, parameters {p[1]}, "
                                f"fragment members {p[2]}, compression={p[3]}, "
                                f"{p[4]} outer optimizer(s)"
                                for r, p in enumerate(prints))
            raise ValueError(f"DiLoCo: settings or parameters differ across ranks (every "
                             f"rank must pass the same ones): {listing}")

    def _broadcast_initial(self) -> None:
        """``θ_g`` := rank 0's parameters, on every rank, and the parameters := ``θ_g``."""
        with torch.no_grad():
            for fragment in self.fragments:
                for g in fragment.groups:
                    g.global_.copy_(g.local())
                    broadcast(g.global_.numpy(), root=0, comm=self.comm)
                    for p, view in zip(g.params, g.views(g.global_)):
                        p.copy_(view)

    # ------------------------------------------------------------------ training
    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        """One inner step; then, when the schedule says so, send a fragment (start the
        all-reduce of its pseudo-gradient) and take a fragment's outer step.

        Returns:
            What the inner optimizer's ``step`` returned (the closure's loss).
        Raises:
            RuntimeError: after :meth:`close`.
            mpicoll.CollectiveError (and its subclasses): the all-reduce failed.
        """
        self._check_open()
        self._follow_world()
        loss = self.inner_optimizer.step() if closure is None else \
            self.inner_optimizer.step(closure)
        self.steps += 1
        sent = self.schedule.sends(self.steps)
        if sent is not None:
            self._send(sent)
        arrived = self.schedule.arrives(self.steps)
        if arrived is not None:
            self._arrive(arrived)
        return loss

    def _send(self, index: int) -> None:
        """``Δ = θ_g - θ_local`` of fragment ``index``; start its all-reduce (on the lane
        with overlap, at once without)."""
        assert self._pending is None, "an all-reduce is already in flight"
        fragment = self.fragments[index]
        with torch.no_grad():
            for g in fragment.groups:
                torch.sub(g.global_, g.local(), out=g.delta)
        kind = f"DiLoCo fragment {index} all-reduce"
        if self._lane is None:
            work = completed(kind, self._reduce(fragment))
        else:
            work = self._lane.submit(kind, lambda: self._reduce(fragment))
        self._pending = (index, work)

    def _reduce(self, fragment: _Fragment) -> tuple[int, int]:
        """Average the fragment's pseudo-gradients over the ranks, in place (on the lane's
        thread with overlap). Returns the (total, inter-node) bytes this rank sent."""
        total = inter = 0
        for g in fragment.groups:
            buf = g.delta.numpy()
            if self.codec is None:
                allreduce(buf, buf, op="average", comm=self.comm, algorithm=self.algorithm,
                          check=True)
                sent, crossing = self._schedule_bytes(buf.nbytes)
                total += sent
                inter += crossing
            else:
                compressed_allreduce(buf, buf, op="average", comm=self.comm,
                                     compression=self.codec,
                                     feedback=self.feedback if self.feedback is not None
                                     else False, key=g.key, check=True)
                stats = last_stats()
                total += stats.bytes_sent
                inter += stats.inter_node_bytes
        return total, inter

    def _schedule_bytes(self, nbytes: int) -> tuple[int, int]:
        """``(total, inter-node)`` bytes this rank sends in an uncompressed all-reduce of
        ``nbytes``, computed from the placement: a ring sends ``2 (n - 1) / n`` of the
        vector to the next rank (crossing nodes when that rank is on another node); the
        hierarchical all-reduce ``2 (L - 1) / L`` inside the node and ``2 (m - 1) / m`` of
        its ``1 / L`` shard to other nodes (``L`` ranks per node, ``m`` nodes; counted as
        a ring among the nodes whichever algorithm runs there), or, with unequal nodes,
        the vector to its leader and the leaders ``2 (m - 1) / m`` of it among nodes."""
        n = self.comm.Get_size()
        rank = self.comm.Get_rank()
        if self.algorithm == "ring":
            sent = 2 * (n - 1) * nbytes // n
            return sent, sent if self._nodes[(rank + 1) % n] != self._nodes[rank] else 0
        topo, m = self._topology, self.num_nodes
        local, size = topo.local_rank, topo.local_size
        if topo.uniform:
            inner = 2 * (size - 1) * nbytes // size
            cross = 2 * (m - 1) * (nbytes // size) // m
            return inner + cross, cross
        if local:
            return nbytes, 0
        cross = 2 * (m - 1) * nbytes // m
        return cross + (nbytes if size > 1 else 0), cross

    def _arrive(self, index: int) -> None:
        """Wait for fragment ``index``'s all-reduce; take its outer step from ``θ_g``;
        ``θ_g`` := the result; the parameters := it (or, with overlap, its lerp toward
        this rank's parameters). Nothing when a new world dropped it (:meth:`_follow_world`,
        with no elastic restore since): the fragment's next exchange carries its progress."""
        if self._pending is None:
            return
        pending, work = self._pending
        assert pending == index, f"fragment {index} arrives but {pending} was sent"
        self._pending = None        # (also when it failed: nothing is in flight after)
        total, inter = work.wait()
        self.bytes_sent["total"] += total
        self.bytes_sent["inter_node"] += inter
        fragment = self.fragments[index]
        mix = self.settings.overlap > 0 and self.settings.alpha != 0.0
        outer = self.outer_optimizers[index if len(self.outer_optimizers) > 1 else 0]
        saved = [p.grad for p in self.params]
        with torch.no_grad():
            local = [p.detach().clone() for p in fragment.params] if mix else None
            for p in self.params:
                p.grad = None
            for g in fragment.groups:
                for p, theta, delta in zip(g.params, g.views(g.global_), g.views(g.delta)):
                    p.copy_(theta)          # (a frozen parameter gets no gradient: as in
                    if p.requires_grad:     # torch, no optimizer moves it, weight decay too)
                        p.grad = delta.to(p.device)
        try:
            outer.step()
        finally:
            for p, grad in zip(self.params, saved):
                p.grad = grad
        with torch.no_grad():
            for g in fragment.groups:
                g.global_.copy_(g.local())
            if mix:
                for p, mine in zip(fragment.params, local):
                    p.lerp_(mine, self.settings.alpha)
        self.outer_steps[index] += 1

    # ------------------------------------------------------------------ inspection
    def global_parameters(self) -> list[torch.Tensor]:
        """``θ_g`` of every parameter (model order), as views of DiLoCo's own buffers:
        read them, do not write them."""
        views = {id(p): view for fragment in self.fragments for g in fragment.groups
                 for p, view in zip(g.params, g.views(g.global_))}
        return [views[id(p)] for p in self.params]

    def in_flight(self) -> int | None:
        """The fragment whose all-reduce has been sent and not yet applied (``None``)."""
        return None if self._pending is None else self._pending[0]

    def stats(self) -> dict:
        """Inner steps, outer steps per fragment, the bytes sent, the algorithm and codec."""
        return {"steps": self.steps, "outer_steps": list(self.outer_steps),
                "fragments": [f.numel for f in self.fragments],
                "bytes_sent": dict(self.bytes_sent), "algorithm": self.algorithm,
                "compression": None if self.codec is None else self.codec.name}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What DiLoCo adds to a checkpoint: the settings, the inner step count, ``θ_g``
        (equal on every rank), the outer optimizer's state, the in-flight fragment's
        averaged pseudo-gradient (waited for: the all-reduce completes first), and this
        rank's error-feedback residuals and codec state (rank-specific).

        The model's own parameters (``θ_local``) and the inner optimizer's state are
        this rank's: save them with ``model.state_dict()`` and
        ``inner_optimizer.state_dict()``.
        """
        self._check_open()
        self._follow_world()
        pending = None
        if self._pending is not None:
            index, work = self._pending
            total, inter = work.wait()
            self._pending = (index, completed(work.kind, (total, inter)))
            pending = {"fragment": index, "bytes": [total, inter],
                       "delta": [g.delta.clone() for g in self.fragments[index].groups]}
        residuals = {key: torch.from_numpy(np.array(self.feedback.residual(key)))
                     for key in (() if self.feedback is None else self.feedback.keys())}
        return {
            "format": STATE_FORMAT,
            "settings": list(self._fingerprint()),
            "steps": self.steps,
            "outer_steps": list(self.outer_steps),
            "global": [t.clone() for t in self.global_parameters()],
            "outer_optimizer": [opt.state_dict() for opt in self.outer_optimizers],
            "pending": pending,
            "residuals": residuals,
            "codec": {} if self.codec is None else self.codec.state_dict(),
            "bytes_sent": dict(self.bytes_sent),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (local: no communication). An all-reduce in flight
        is waited for and dropped.

        Raises:
            ValueError: a state of other settings, parameters or compression.
        """
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not a DiLoCo state_dict (or of another format)")
        if _as_tuples(state["settings"]) != self._fingerprint():
            raise ValueError(f"the DiLoCo state was saved with other settings or "
                             f"parameters: {state['settings']} (now {list(self._fingerprint())})")
        self._follow_world()
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None
        with torch.no_grad():
            for view, saved in zip(self.global_parameters(), state["global"]):
                view.copy_(saved)
        for opt, saved in zip(self.outer_optimizers, state["outer_optimizer"]):
            opt.load_state_dict(saved)
        self.steps = int(state["steps"])
        self.outer_steps = [int(s) for s in state["outer_steps"]]
        self.bytes_sent = dict(state["bytes_sent"])
        if self.feedback is not None:
            self.feedback.reset()
            for key, residual in state["residuals"].items():
                self.feedback.store(key, residual.numpy().copy())
        if self.codec is not None:
            self.codec.load_state_dict(state["codec"])
        pending = state["pending"]
        if pending is not None:
            index = int(pending["fragment"])
            for g, delta in zip(self.fragments[index].groups, pending["delta"]):
                g.delta.copy_(delta)
            self._pending = (index, completed(f"DiLoCo fragment {index} all-reduce",
                                              tuple(pending["bytes"])))

    # ------------------------------------------------------------------ end
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DiLoCo: used after close()")

    def close(self) -> None:
        """Wait for an all-reduce in flight (its result is dropped), stop the lane, check
        that every rank took as many inner steps, and free the communicator. Collective
        (every rank); idempotent.

        Raises:
            mpicoll.MismatchError: on every rank, when the ranks took different numbers of
                inner steps (a rank whose data ran out early: the others, waiting in an
                outer all-reduce it will never join, raise it there).
        """
        self._close(agree_steps=True)

    def _close(self, agree_steps: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None:
                self._pending[1].wait()
                self._pending = None
            if agree_steps:     # (meets another rank's outer all-reduce, also checked)
                self._agree_steps()
        except MismatchError as exc:
            raise MismatchError(f"DiLoCo: the ranks called step() unequally often (every "
                                f"rank must call it equally often; 'count' is the inner "
                                f"steps taken): {exc}", exc.details) from None
        finally:
            if self._lane is not None:
                self._lane.close()
            comms.free(self.comm)

    def _agree_steps(self) -> None:
        """The agreement step with the inner step count, where the outer all-reduces run
        theirs (on the lane with overlap: a blocking ``MPI_Allgather`` on this thread
        would never match a peer lane's non-blocking one)."""
        def check() -> None:
            agree(get_context(self.comm), None, collective="DiLoCo.close", count=self.steps)

        if self._lane is None:
            check()
        else:
            self._lane.submit("DiLoCo.close", check).wait()

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # (an exception on its way out: no step check, which a failed world could not
        # answer; an uncaught exception ends the job, mpicoll.runtime.exit)
        self._close(agree_steps=exc_type is None)
