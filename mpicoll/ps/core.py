"""``ParameterServer``: the collective set-up and the user-facing methods.

The constructor is collective over ``comm`` and returns on every rank by itself:

1. every rank checks its own arguments (:func:`~mpicoll.ps.settings.check_settings`) and
   the ranks exchange the verdicts, so bad arguments raise the same ``ValueError``
   everywhere;
2. the ranks exchange their settings and parameter specs (small control metadata, pickled
   by mpi4py's lowercase methods; tensors never are) and either all raise the same
   :class:`PSError` or all derive the same placement;
3. ranks ``0 .. num_servers-1`` become servers and the rest workers;
4. the parameters get their values: on restore rank 0 (the *scheduler*) reads the
   checkpoint manifest and broadcasts it, then every server loads its shards; otherwise
   the first worker sends its values to the servers (INIT requests), which take them
   inside their constructor, not in :meth:`ParameterServer.serve`. Either way a last
   collective step ends the constructor on every rank, so the user may make collective
   calls of their own between the constructor and ``serve()``, and no worker pulls
   before the values exist.
"""
from __future__ import annotations

import atexit
import logging
import sys
import uuid
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..runtime import comms, failures
from ..runtime import exit as runtime_exit
from ..runtime import world as runtime_world
from . import checkpoint as ckpt
from . import protocol as P
from .colocated import CollOp, ColocatedEngine
from .compressed import check_compressible
from .device import call_side, device_views, host_arrays
from .errors import PSError
from .placement import DEFAULT_SPLIT_BYTES, ParamSpec, Placement, specs_from_params
from .failures import FailureWatch
from .node_aggregation import NodeGroup, decide, node_indices, worker_groups
from .replicas import Routing
from .replicated import ReplicatedServer
from .server import Server, stats_from_vector
from .settings import COLOCATED, CONSISTENCY, Settings, check_settings
from .worker import Handle, WorkerClient

__all__ = ["ParameterServer", "CONSISTENCY", "COLOCATED"]

log = logging.getLogger("mpicoll.ps")


def _collective_check(comm: MPI.Comm, error: str | None, kind: type = PSError) -> None:
    """Raise the same error on every rank if any rank reported one."""
    errors = comm.allgather(error)
    bad = {r: e for r, e in enumerate(errors) if e}
    if bad:
        lines = "; ".join(f"rank {r}: {e}" for r, e in bad.items())
        raise kind(f"ParameterServer set-up failed: {lines}")


def _collective_verdict(comm: MPI.Comm, error: str | None) -> None:
    """:func:`_collective_check` for a step whose ranks arrive at different times: wait
    by polling (a blocking collective would spin on the cores the others need)."""
    flag = np.array([1 if error else 0], dtype=np.int64)
    any_error = np.zeros(1, dtype=np.int64)
    P.wait_all([comm.Iallreduce([flag, MPI.INT64_T], [any_error, MPI.INT64_T], op=MPI.MAX)])
    if any_error[0]:
        _collective_check(comm, error)


def _check_dtypes(specs: list[ParamSpec], optimizer: str) -> None:
    """Raise ``ValueError`` unless ``optimizer`` can update every parameter."""
    if optimizer != "sum":
        bad = [s.name for s in specs if s.dtype.kind not in "fc"]
        if bad:
            raise ValueError(f"optimizer={optimizer!r} needs floating parameters; {bad} are not")


def _as_arrays(params: dict[str, Any], specs: list[ParamSpec]) -> dict[str, np.ndarray]:
    """The initial values as numpy arrays, checked on the rank that sends them at set-up, so
    that a value that cannot be sent fails on every rank instead of leaving the receivers
    waiting.

    Raises:
        TypeError: numpy cannot read a value, or reads another shape or dtype than the
            value claims.
    """
    out = {}
    for spec in specs:
        try:
            arr = np.asarray(params[spec.name])
        except Exception as exc:  # noqa: BLE001  (e.g. torch's RuntimeError)
            raise TypeError(f"params[{spec.name!r}] cannot be read as a numpy array: "
                            f"{exc}") from exc
        if arr.shape != spec.shape or arr.dtype != spec.dtype:
            raise TypeError(f"params[{spec.name!r}] reads as a {arr.dtype} array of shape "
                            f"{arr.shape}, not {spec.dtype} {spec.shape}")
        out[spec.name] = arr
    return out


#: workers not closed yet (:func:`_unclosed_at_exit`; held, not weakly: a worker
#: dropped unclosed is one that leaves the others waiting)
_OPEN: list = []


@atexit.register   # (after the runtime's import: runs before its exit handler)
def _unclosed_at_exit() -> None:
    """A worker that exits without :meth:`ParameterServer.close` (a clean exit in the
    middle of training, or a forgotten close) would leave the servers and the other
    workers waiting for it forever: the job ends instead, saying why."""
    left = [ps for ps in _OPEN if not ps._closed]
    if left and not runtime_exit.failure_seen():
        print(f"mpicoll.ps: rank {left[0].rank} of the parameter server exits with its "
              f"worker open (close() was not called): ending the job, whose servers and "
              f"other workers would wait for it forever", file=sys.stderr, flush=True)
        runtime_exit.abort(1)


class ParameterServer:
    """A parameter server over MPI: some ranks store parameters, the others train.

    The constructor is collective over ``comm`` and returns on every rank by itself: the
    servers take the initial values (or their checkpointed shards) inside it, so every rank
    may make collective calls of its own on ``comm`` between the constructor and
    :meth:`serve`. Ranks ``0 .. num_servers-1`` are servers (call :meth:`serve`), the
    others are workers (call :meth:`pull`, :meth:`push`, :meth:`push_pull` ..., then
    :meth:`close`).

    Args:
        params: dict name -> array. On workers, the names, shapes and dtypes of the
            parameters (every worker the same); the first worker's values initialize the
            servers. Servers may pass the same dict or ``None``. Host arrays or device
            arrays (CuPy, ``__cuda_array_interface__`` objects), not both in one dict; the
            server state always lives in host memory (:mod:`mpicoll.ps.device`).
        comm: mpi4py intracommunicator (default: the world in force,
            ``MPI.COMM_WORLD`` unless :mod:`mpicoll.elastic` reconfigured it); duplicated.
        num_servers: how many ranks are servers (1 .. size-1), or ``"colocated"``: no
            server processes; every rank is a worker and keeps (serves) its own shards of a
            placement over all ranks, and push_pull becomes a reduce-scatter to the shard
            owners plus an all-gather of the updated shards (see
            :mod:`mpicoll.ps.colocated`). Co-located, every call is collective (all ranks
            push/pull/save at the same step), only ``consistency="bsp"`` is supported and
            ``init`` must be True.
        consistency: ``"bsp"`` (bulk synchronous), ``"asp"`` (asynchronous) or ``"ssp"``
            (stale synchronous, bound ``staleness``).
        staleness: the ``ssp`` bound ``s`` (>= 0).
        optimizer: ``"sgd"``, ``"momentum"``, ``"adam"`` or ``"sum"`` (``bsp`` only: pulls
            return the round's summed gradient).
        average: divide aggregated gradients by the number of workers (default: True
            except for ``"sum"``).
        split_bytes: tensors of at least this many bytes are split over all servers.
        chunk_bytes: largest payload message.
        init: send the first worker's values to the servers now (``False``: a worker calls
            :meth:`init` later).
        restore: a checkpoint directory written by :meth:`save` to start from instead.
        reshard: allow restoring a checkpoint saved with another layout (number of
            servers or workers, split threshold).
        max_sleep: longest idle pause of a polling rank, in seconds.
        keep_aggregate: (co-located layout with ``optimizer="sum"`` only) ``False``: after
            a ``push_pull`` the owners do not keep the round's aggregate — it is written
            straight into the callers' ``out`` arrays, which saves one copy of each rank's
            shard per step (what separates push_pull from an all-reduce at 2 ranks); a
            ``pull()`` or ``save()`` before the next push then raises :class:`PSError`.
            For pure gradient averaging (``mpicoll.torch.DistributedOptimizer(...,
            backend="ps")``).
        backup_workers: ``b`` (``bsp`` with separate servers and a server-side
            optimizer; ``0 <= b <`` number of workers): a round closes as soon as all but
            ``b`` active workers have pushed it and is updated with the average of the
            pushes it holds; a push that arrives for a closed round is dropped and counted
            (``stats()``: ``late_pushes_dropped``, ``short_rounds``), and that worker's
            next pull returns the newest parameters and moves its :attr:`clock` forward.
            Which pushes are counted depends on timing, so with ``b > 0`` runs are not
            reproducible bit for bit. End training at a round count (``while ps.clock <
            steps``): a worker whose pushes were dropped reaches it in fewer steps.
        compression: compress pushes and pulls with this codec (a name of
            :func:`mpicoll.compression.get_codec`: ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"onebit"``, ``"topk:0.01"``, ``"randomk:0.01"`` ..., or a
            :class:`~mpicoll.compression.Codec`; ``None``/``"none"``: uncompressed).
            Pushes carry each shard's gradient plus the worker's residual (worker-side error
            feedback); pulls carry the change since that worker's last pull (server-side
            error feedback; with ``optimizer="sum"`` the round's aggregate plus the
            server's residual), see :mod:`mpicoll.ps.compressed`. Every parameter must
            be float32 or float64.
        replicas: ``1``: every slot (the shards the placement puts on one server) lives
            on a primary server rank and a backup server rank (the next one, in a ring);
            the primary forwards every push, init and close to the backup and
            acknowledges it to the worker only once the backup holds it. Under ULFM
            (Open MPI, ``mpirun --with-ft ulfm``) a dead server's slots fail over to their
            backups with no acknowledged update lost, a spare server becomes the new
            backup, and a dead worker is closed (rounds go on without it); see
            :mod:`mpicoll.ps.replicated`. Needs ``num_servers >= 2``; not with
            ``"colocated"``, ``compression`` or ``backup_workers``. ``0`` (default): no
            copies, and under ULFM any failure raises
            :class:`~mpicoll.ProcessFailedError` on every survivor.
        feedback: error feedback of compressed pushes (each worker's residual per shard)
            and of ``optimizer="sum"`` pulls (the server's residual per shard); ``False``
            keeps no residuals (the spelling of :func:`mpicoll.compression.allreduce` and
            the torch compressors). Pulls of parameters always send ``param - replica``,
            which corrects itself (see :mod:`mpicoll.ps.compressed`). No effect without
            ``compression``; must be the same on every rank.
        **hyperparameters: ``lr``, ``momentum``, ``beta1``, ``beta2``, ``eps``,
            ``weight_decay`` (plain numbers).
    Raises:
        ValueError: bad arguments on some rank (raised on every rank), e.g. an unknown
            codec, a ratio outside (0, 1], parameters a codec cannot encode.
        PSError: ranks disagree (arguments, parameter specs), or the checkpoint does not fit.
    """

    def __init__(self, params: dict[str, Any] | None, comm: MPI.Comm | None = None,
                 num_servers: int = 1, consistency: str = "bsp", staleness: int = 0,
                 optimizer: str = "sgd", *, average: bool | None = None,
                 split_bytes: int = DEFAULT_SPLIT_BYTES,
                 chunk_bytes: int = P.DEFAULT_CHUNK_BYTES, init: bool = True,
                 restore: str | None = None, reshard: bool = False, max_sleep: float = 1e-3,
                 keep_aggregate: bool = True, backup_workers: int = 0,
                 compression: Any = None, feedback: bool = True, replicas: int = 0,
                 local_aggregation: Any = "auto", **hyperparameters: Any) -> None:
        user = runtime_world.comm() if comm is None else comm
        self.comm = comms.dup(user, "ps")
        self.rank = self.comm.Get_rank()
        self.worker_comm = MPI.COMM_NULL
        self._node_comm = MPI.COMM_NULL
        self._leader_comm = MPI.COMM_NULL
        try:
            settings, specs, values = self._check_arguments(
                params, dict(num_servers=num_servers, consistency=consistency,
                             staleness=staleness, optimizer=optimizer,
                             hyperparameters=hyperparameters, average=average,
                             split_bytes=split_bytes, chunk_bytes=chunk_bytes, init=init,
                             restore=restore, reshard=reshard,
                             keep_aggregate=keep_aggregate, backup_workers=backup_workers,
                             compression=compression, feedback=feedback,
                             replicas=replicas, local_aggregation=local_aggregation))
            specs = self._agree(settings, specs)
            self._take_roles(settings, specs, max_sleep)
            self._init_or_restore(settings, values)
            if self.is_worker:
                _OPEN.append(self)
        except (ValueError, PSError):
            self.free()      # raised on every rank (each step's verdict is collective)
            raise
        except MPI.Exception as exc:
            # under ULFM a rank that died during set-up fails a collective here (or a
            # revoked communicator does): ProcessFailedError on every survivor, the
            # communicators revoked (not freed: that would wait for the dead rank)
            failures.raise_translated(exc, self.comm, "the ParameterServer constructor")
            raise

    # ------------------------------------------------------------------ set-up steps
    def _check_arguments(self, params: dict[str, Any] | None, arguments: dict[str, Any]
                         ) -> tuple[Settings, list[ParamSpec] | None, dict[str, Any] | None]:
        """Check this rank's arguments; raise the same ``ValueError`` on every rank if any
        rank's are bad (collective).

        Returns:
            (settings, this rank's parameter specs or ``None`` (a server that passed no
            parameters), the initial values as arrays on the rank that sends them or
            ``None``).
        """
        error: str | None = None
        settings, specs, values = None, None, None
        try:
            settings = check_settings(self.comm.Get_size(), **arguments)
            device = call_side(params=params)     # device arrays: read through views
            if params is not None or not settings.is_server(self.rank):
                specs = specs_from_params(device_views(params) if device else params)
                _check_dtypes(specs, settings.optimizer)
                check_compressible(specs, settings.compression)
            if self.rank == settings.first_worker and settings.restore is None and \
                    settings.init:
                values = _as_arrays(host_arrays(params) if device else params, specs)
        except (TypeError, ValueError, PSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        _collective_check(self.comm, error, kind=ValueError)
        return settings, specs, values

    def _agree(self, settings: Settings, specs: list[ParamSpec] | None) -> list[ParamSpec]:
        """Compare every rank's settings and parameter specs (collective).

        Returns:
            the first worker's parameter specs.
        Raises:
            PSError: (on every rank) ranks passed other settings or parameters.
        """
        configs = self.comm.allgather(settings.as_plain())
        all_specs = self.comm.allgather(None if specs is None else [s.as_plain() for s in specs])
        first = settings.first_worker
        diff = [r for r, c in enumerate(configs) if c != configs[0]]
        if diff:  # identical on every rank: computed from gathered values
            named = "; ".join(f"{k}: rank 0 {configs[0][k]!r}, rank {r} {configs[r][k]!r}"
                              for r in diff for k in configs[0] if configs[r][k] != configs[0][k])
            raise PSError(f"ranks {diff} passed other settings than rank 0: {named}")
        diff = [r for r, s in enumerate(all_specs) if s is not None and s != all_specs[first]]
        if diff:
            theirs = {r: sorted(map(tuple, all_specs[r]), key=str) for r in diff}
            mine = sorted(map(tuple, all_specs[first]), key=str)
            named = "; ".join(f"rank {r}: {[s for s in t if s not in mine]} where the first "
                              f"worker has {[s for s in mine if s not in t]}"
                              for r, t in theirs.items())
            raise PSError(f"ranks {diff} passed parameters (names, shapes, dtypes) that differ "
                          f"from the first worker's (rank {first}): {named}")
        return [ParamSpec(n, tuple(s), np.dtype(d)) for n, s, d in all_specs[first]]

    def _take_roles(self, settings: Settings, specs: list[ParamSpec], max_sleep: float) -> None:
        """Set the public attributes and make this rank's server, client or engine."""
        size, rank = self.comm.Get_size(), self.rank
        first_worker = settings.first_worker
        self._settings = settings
        self.num_servers = size if settings.colocated else settings.num_servers
        for name in ("colocated", "consistency", "staleness", "backup_workers", "optimizer",
                     "hyperparameters", "average", "chunk_bytes", "compression", "feedback",
                     "replicas"):
            setattr(self, name, getattr(settings, name))
        self.worker_ranks = list(range(first_worker, size))
        self.is_server = settings.is_server(rank)
        self.is_worker = not self.is_server
        self.worker_index = None if self.is_server else rank - first_worker
        self.worker_comm = comms.split(self.comm, 0 if self.is_server else 1, rank, "ps")
        self._server: Server | None = None
        self._client: WorkerClient | None = None
        self._engine: ColocatedEngine | None = None
        self._node: NodeGroup | None = None
        self._closed = False
        node_of = node_indices(self.comm)
        #: every rank's node index (mpicoll.topology's node layout of ``comm``)
        self.node_of = node_of
        #: the worker ranks of each node that holds workers, nodes in layout order
        self.node_groups = worker_groups(node_of, self.worker_ranks)
        self.local_aggregation = decide(settings.local_aggregation, self.node_groups,
                                        self.backup_workers, self.replicas, settings.init)
        #: the ranks the servers (or the co-located engines) see as workers, each standing
        #: for `weights` workers; with local aggregation the node leaders
        leaders = [g[0] for g in self.node_groups]
        counted = leaders if self.local_aggregation else self.worker_ranks
        weights = {g[0]: len(g) for g in self.node_groups} if self.local_aggregation else None
        if settings.colocated and self.local_aggregation:
            self.num_servers = len(leaders)          # one shard owner per node: its leader
        self.server_ranks = list(range(self.num_servers))
        self.placement = Placement(specs, self.num_servers, settings.split_bytes)
        #: (key the server side keeps a worker's clock under, that worker's index)
        self._clock_keys = [(w, self.worker_ranks.index(w)) for w in counted]
        watch = FailureWatch(self.comm, tolerant=bool(self.replicas)) if failures.ENABLED else None
        if self.local_aggregation:
            group = next((g for g in self.node_groups if rank in g), None)
            self._node_comm = comms.split(self.comm, MPI.UNDEFINED if group is None else
                                          self.node_groups.index(group), rank, "ps")
        if settings.colocated:
            engine_comm, engine_nodes, engine_weights = self.comm, node_of, None
            if self.local_aggregation:
                self._leader_comm = comms.split(self.comm, 0 if rank in leaders else
                                                MPI.UNDEFINED, rank, "ps")
                engine_comm = self._leader_comm
                engine_nodes = [node_of[w] for w in leaders]
                engine_weights = [len(g) for g in self.node_groups]
                self._clock_keys = [(k, self.worker_ranks.index(w))
                                    for k, w in enumerate(leaders)]
            if engine_comm != MPI.COMM_NULL:
                self._engine = ColocatedEngine(engine_comm, self.placement, self.optimizer,
                                               self.hyperparameters, self.average,
                                               self.chunk_bytes, max_sleep,
                                               settings.keep_aggregate, self.compression,
                                               self.feedback, node_of=engine_nodes,
                                               weights=engine_weights)
        elif self.is_server:
            def make(slot: int) -> Server:
                return Server(self.comm, self.placement, slot, counted,
                              self.consistency, self.staleness, self.optimizer,
                              self.hyperparameters, self.average, self.chunk_bytes,
                              max_sleep, self.backup_workers, self.compression, self.feedback,
                              node_of={w: node_of[w] for w in counted}, weights=weights)
            self._server = ReplicatedServer(
                self.comm, self.placement, Routing(self.num_servers, self.replicas),
                self.worker_ranks, make, max_sleep, watch) if self.replicas else make(rank)
        elif rank in counted:
            self._client = WorkerClient(self.comm, self.placement, self.chunk_bytes, max_sleep,
                                        adopt_version=self.backup_workers > 0,
                                        codec=self.compression, feedback=self.feedback,
                                        pull_deltas=self.optimizer != "sum")
            if self.replicas:
                self._client.routing = Routing(self.num_servers, self.replicas)
        for part in (self._engine, self._server, self._client):    # this rank's, if any
            if part is not None:
                part.watch = watch
        if self.is_worker and self.local_aggregation:
            # this worker's NodeGroup: the leader's calls go to its client or engine
            self._node = NodeGroup(self._node_comm, self.placement.specs,
                                   self._leader_call if self._node_comm.Get_rank() == 0
                                   else None, max_sleep, watch)

    def _leader_call(self, kind: str, grads: dict[str, Any] | None,
                     out: dict[str, Any] | None, check: bool = False) -> Any:
        """``"push"``, ``"pull"`` or ``"push_pull"`` through this rank's co-located engine
        or client (a handle); a node leader's for its node."""
        if self._engine is not None:
            return self._engine.start(kind, self._engine.step(CollOp[kind.upper()], grads,
                                                              out))
        client = self._need_worker(f"{kind}()")
        if kind == "pull":
            return client.pull_async(out)
        if kind == "push":
            return client.push_async(grads, check)
        return client.push_pull_async(grads, out, check)

    def _start(self, kind: str, grads: dict[str, Any] | None = None,
               out: dict[str, Any] | None = None, check: bool = True) -> Handle:
        """Start this worker's ``kind`` (through its node group, if any)."""
        if self._node is not None or self._engine is not None:
            self._open(f"{kind}()")
        if self._node is not None:
            return self._node.start(kind, self._node.step(CollOp[kind.upper()], grads, out))
        return self._leader_call(kind, grads, out, check)

    def _init_or_restore(self, settings: Settings, values: dict[str, np.ndarray] | None
                         ) -> None:
        """Give the parameters their values, collectively: from the checkpoint, or the
        first worker's (nothing with ``init=False``: a worker calls :meth:`init` later)."""
        if settings.restore is not None:
            self._restore(settings.restore, settings.reshard)
        elif settings.colocated:
            self._colocated_init(values)
        elif settings.init:
            self._init_servers(values)

    def _init_servers(self, values: dict[str, np.ndarray] | None) -> None:
        """Separate layout: the first worker sends every shard's initial value (INIT
        requests) and each server takes its shards here, inside the constructor; a
        collective verdict ends it, so every rank returns by itself and no worker pulls
        before the values exist."""
        error = None
        try:
            if self._server is not None:
                self._server.receive_initial_values(self.worker_ranks[0])
            elif self.worker_index == 0:
                self._client.init_async(values).wait()
        except PSError as exc:
            error = str(exc)
        _collective_verdict(self.comm, error)

    def _colocated_init(self, values: dict[str, np.ndarray] | None) -> None:
        """Co-located layout: every owner takes its shards of the first rank's ``values``
        (one Bcast per tensor, collective)."""
        engine = self._engine
        for name, spec in self.placement.specs.items():
            buf = np.ascontiguousarray(values[name], dtype=spec.dtype).reshape(-1) \
                if self.rank == 0 else np.empty(spec.size, dtype=spec.dtype)
            if spec.size:
                self.comm.Bcast([buf.view(np.uint8), MPI.BYTE], root=0)
            if engine is None:     # local aggregation: a node's other workers own nothing
                continue
            for sh in self.placement.shards[name]:
                state = engine.states.get(sh.ident)
                if state is not None:
                    state.initialize(buf[sh.lo:sh.hi])

    # ------------------------------------------------------------------ roles
    @property
    def num_workers(self) -> int:
        """Number of worker ranks."""
        return len(self.worker_ranks)

    @property
    def clock(self) -> int:
        """This worker's clock: pushes made so far, i.e. the round its next push is for
        (``None`` on servers); with backup workers it also skips rounds that closed
        without this worker."""
        part = self._node or self._engine or self._client
        return None if part is None else part.clock

    def _open(self, what: str) -> None:
        if self._closed:
            raise PSError(f"{what} after close()")

    def _need_worker(self, what: str) -> WorkerClient:
        if self._client is None:
            raise PSError(f"{what} is for workers; rank {self.rank} is a server (call serve())")
        self._open(what)
        return self._client

    # ------------------------------------------------------------------ server
    def serve(self) -> None:
        """Serve the workers' requests; returns once every worker has called close().

        Raises:
            PSError: called on a worker.
        """
        if self._engine is not None:
            raise PSError(f"serve() is not used with num_servers={COLOCATED!r}: every rank is "
                          f"a worker and serves its shards inside its own calls")
        if self._server is None:
            raise PSError(f"serve() is for servers; rank {self.rank} is a worker")
        self._server.serve()
        self._closed = True

    # ------------------------------------------------------------------ worker API
    def init(self, params: dict[str, Any]) -> None:
        """Set the servers' initial values (one worker, when constructed with ``init=False``).

        Raises:
            PSError: a parameter is already initialized (duplicate init), or bad arrays.
        """
        if self._engine is not None:
            raise PSError(f"init(): the parameters are already initialized (with "
                          f"num_servers={COLOCATED!r} the constructor does it)")
        self._need_worker("init()").init_async(params).wait()

    def pull(self, out: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Fetch the parameters this worker's clock allows (blocking).

        Args:
            out: optional arrays to fill (name -> array); others are allocated. Device
                arrays in ``out`` (all of them, none on the host): the values land there,
                and missing names get new CuPy arrays on that device.
        Returns:
            dict name -> array.
        """
        return self.pull_async(out).wait()

    def pull_async(self, out: dict[str, Any] | None = None) -> Handle:
        """Start :meth:`pull`; ``handle.wait()`` returns the dict."""
        return self._start("pull", out=out)

    def push(self, grads: dict[str, Any], check: bool = True) -> None:
        """Send gradients for every parameter and advance this worker's clock (blocking
        until every server has received them).

        Args:
            grads: name -> array, the same names, shapes and dtypes as the parameters;
                host or device arrays (copied to host memory when the call starts).
            check: check names, shapes and dtypes here first (``False`` leaves every check
                to the servers).
        Raises:
            PSError: bad gradients, device and host arrays mixed, or a server rejected
                them (the reason is in the message).
        """
        self.push_async(grads, check).wait()

    def push_async(self, grads: dict[str, Any], check: bool = True) -> Handle:
        """Start :meth:`push`; do not modify ``grads`` before ``handle.wait()``."""
        return self._start("push", grads, check=check)

    def push_pull(self, grads: dict[str, Any], out: dict[str, Any] | None = None,
                  check: bool = True) -> dict[str, np.ndarray]:
        """Push gradients, then pull the parameters for the next clock (one round trip).
        Device gradients: the values land in device arrays (``out``'s, else new ones)."""
        return self.push_pull_async(grads, out, check).wait()

    def push_pull_async(self, grads: dict[str, Any], out: dict[str, Any] | None = None,
                        check: bool = True) -> Handle:
        """Start :meth:`push_pull`."""
        return self._start("push_pull", grads, out, check)

    def close(self) -> None:
        """Finish this worker: complete outstanding requests and tell every server.

        Servers stop counting a closed worker in rounds and staleness bounds, so a worker
        that finishes early does not hold the others up. Idempotent. On servers: no-op
        (they finish in :meth:`serve`). Co-located, this rank keeps serving its shards to
        the others and returns once every rank has closed. With local aggregation every
        worker of a node closes at the same step (the node's leader then closes for it).
        """
        if self._closed or self._server is not None:
            return
        self._through_node("close", CollOp.CLOSE, self._close_leader)
        self._closed = True
        if self in _OPEN:
            _OPEN.remove(self)

    def _through_node(self, kind: str, op: CollOp, lead: Callable[[], Any]) -> Any:
        """The result of ``lead()`` (a handle of this rank's client or engine); with
        local aggregation through the node (:meth:`NodeGroup.agree_and_lead`)."""
        if self._node is None:
            return lead().wait()
        return self._node.start(kind, self._node.agree_and_lead(op, lead)).wait()

    def _close_leader(self) -> Any:
        """A node leader's close of its engine or client (a handle)."""
        if self._engine is not None:
            return self._engine.start("close", self._engine.close())
        self._client.wait_all()
        return self._client.control_async(P.Op.CLOSE)

    def free(self) -> None:
        """Release the private communicators (collective; after serve()/close(); after a
        process failure they are only forgotten: :func:`mpicoll.runtime.comms.free`)."""
        for c in (self._leader_comm, self._node_comm, self.worker_comm, self.comm):
            comms.free(c)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Counters: placement (bytes and shards per server), per-server and this worker's.

        On a worker, asks every server for its counters (pushes, pulls, updates, bytes in
        and out, staleness max/mean/histogram; with backup workers ``late_pushes_dropped``
        and ``short_rounds``, the shard updates applied before every active worker had
        pushed) and adds its own (``late_pushes_dropped``: its shard pushes the servers
        dropped). On a server, its own counters. Byte counters count what travels
        (compressed payloads with ``compression=``); ``bytes_*_uncompressed`` what the same
        messages carry without compression.

        Returns:
            ``{"bytes_per_server": [...], "shards_per_server": [...], "servers": [...],
            "worker": {...}}`` (``"server"`` instead of ``"servers"``/``"worker"`` on a server).
        """
        out: dict[str, Any] = {
            "bytes_per_server": self.placement.bytes_per_server(),
            "shards_per_server": [len(self.placement.shards_on(s))
                                  for s in range(self.num_servers)],
            "consistency": self.consistency, "staleness_bound": self.staleness,
            "backup_workers": self.backup_workers, "local_aggregation": self.local_aggregation,
            "compression": self._settings.compression_name, "replicas": self.replicas}
        if self._server is not None:
            out["server"] = self._server.stats()
            return out
        self._open("stats()")
        res = self._through_node("stats", CollOp.STATS, self._stats_leader)
        # the leaders' engines' counters, or the servers' STATS vectors
        out["servers"] = res if self.colocated else \
            [stats_from_vector(res[s]) for s in range(self.num_servers)]
        c = self.worker_counters()
        if self._node is None and self._engine is None:     # a client's pulls' staleness
            c["staleness_mean"] = c.pop("staleness_sum") / max(1, c["staleness_count"])
        else:
            c.update(staleness_max=0, staleness_mean=0.0)
            if self._node is None:
                c["staleness_count"] = c["pulls"]
        out["worker"] = {**c, "clock": self.clock}
        return out

    def _stats_leader(self) -> Any:
        """A node leader's request for the servers' (or the leaders' engines') counters."""
        if self._engine is not None:
            return self._engine.start("stats", self._engine.stats_steps())
        return self._client.control_async(P.Op.STATS,
                                          dest_size=len(P.STATS_FIELDS) + P.STALENESS_BINS)

    def worker_counters(self) -> dict[str, int]:
        """This worker's own counters, read locally (no message, not collective): pushes,
        pulls, ``bytes_sent``/``bytes_received`` (what travelled) and
        ``bytes_sent_uncompressed``/``bytes_received_uncompressed`` (what the same
        messages carry uncompressed). Empty on a server.
        """
        leader = self._engine.worker_counters if self._engine is not None else \
            None if self._client is None else self._client.counters
        if self._node is not None:
            return self._node.worker_counters(leader)
        return dict(leader or {})

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """Checkpoint parameters, optimizer state and clocks into directory ``path``.

        Collective over the workers (every worker calls it at the same step); the servers
        write their shards from inside :meth:`serve`, each file atomically, then the first
        worker writes the manifest (atomically, last: the commit point).

        Raises:
            PSError: called on a server, or a server could not write.
        """
        if self._node is not None or self.colocated:
            self._open("save()")
            (self._node or self._engine).wait_current()
            if self.colocated:
                self._colocated_save(path)
                return
        client = self._client if self._node is not None else self._need_worker("save()")
        if client is not None:
            client.wait_all()
        try:
            self._save(client, path)
        except MPI.Exception as exc:   # a worker died (ULFM): the workers' collectives fail
            failures.raise_translated(exc, self.worker_comm, "save()")
            raise

    def _save(self, client: WorkerClient | None, path: str) -> None:
        ckpt_id = self.worker_comm.bcast(
            "ckpt-" + uuid.uuid4().hex[:12] if self.worker_index == 0 else None, root=0)
        error = None
        try:
            if client is not None:      # local aggregation: the node's leader saves for it
                client.control_async(P.Op.SAVE, f"{path}\n{ckpt_id}".encode("utf-8")).wait()
            if self.compression is not None:
                ckpt.write_codec_file(path, ckpt_id, self.rank,
                                      {} if client is None else client.codec_state())
        except PSError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"rank {self.rank}: writing the compression state failed: {exc}"
        errors = [e for e in self.worker_comm.allgather(error) if e]
        if errors:
            raise PSError(f"save({path!r}) failed: {errors[0]}")
        clocks = self.worker_comm.allgather(self.clock)
        if self.worker_index == 0:
            self._commit_checkpoint(path, ckpt_id, clocks)
        P.wait_all([self.worker_comm.Ibarrier()])

    def _commit_checkpoint(self, path: str, ckpt_id: str, clocks: list[int]) -> None:
        """Write the manifest (the commit point), then delete older checkpoints' files.
        ``clocks``: every worker's; co-located with local aggregation every leader's,
        which is its node's workers' clock."""
        if self.colocated and self.local_aggregation:
            group_of = {w: k for k, g in enumerate(self.node_groups) for w in g}
            clocks = [clocks[group_of[w]] for w in self.worker_ranks]
        manifest = {"format": ckpt.FORMAT, "id": ckpt_id, "layout": self.placement.describe(),
                    "num_workers": self.num_workers, "worker_clocks": clocks,
                    "colocated": self.colocated,
                    "consistency": self.consistency, "staleness": self.staleness,
                    "backup_workers": self.backup_workers,
                    "compression": self._settings.compression_name,
                    "feedback": self.feedback,
                    "codec_files": [] if self.compression is None else
                    [ckpt.codec_file(ckpt_id, r) for r in range(self.comm.Get_size())],
                    "optimizer": self.optimizer, "hyperparameters": self.hyperparameters,
                    "average": self.average,
                    "files": [ckpt.server_file(ckpt_id, s) for s in range(self.num_servers)],
                    "node_groups": self._node_groups_by_index()}
        ckpt.write_manifest(path, manifest)
        ckpt.remove_stale(path, ckpt_id)

    def _node_groups_by_index(self) -> list[list[int]] | None:
        """The node groups as worker indices (checkpoints record them; ``None``: local
        aggregation off)."""
        if not self.local_aggregation:
            return None
        return [[self.worker_ranks.index(w) for w in g] for g in self.node_groups]

    def _colocated_save(self, path: str) -> None:
        """Co-located :meth:`save`: collective over every rank not yet closed; each rank
        writes its own shards, the first one the manifest. With local aggregation the
        leaders' engines save (one shard owner per node) and every worker of a node gets
        their verdict."""
        def lead() -> Any:
            eng = self._engine      # its operations are complete (see save())
            eng.check_aggregate_kept("save()")
            ckpt_id = "ckpt-" + uuid.uuid4().hex[:12]    # the first saving rank's id is used
            return eng.start("save", eng.save_steps((path, ckpt_id), self._commit_checkpoint))
        errors = self._through_node("save", CollOp.SAVE, lead)
        if errors:
            raise PSError(f"save({path!r}) failed: {errors[0]}")

    def _restore(self, path: str, reshard: bool) -> None:
        manifest, error = None, None
        if self.rank == 0:
            try:
                manifest = ckpt.read_manifest(path)
            except (OSError, ValueError) as exc:
                error = f"cannot read checkpoint {path!r}: {exc}"
        manifest, error = self.comm.bcast((manifest, error), root=0)
        if error is None:
            error = self._layout_mismatch(manifest, reshard)
        if error:
            raise PSError(error)   # same on every rank: decided from broadcast values
        clocks = self._restored_clocks(manifest)
        holder = self._server or self._engine
        if holder is not None:
            # servers keep clocks by worker rank, the manifest by worker index: with another
            # number of servers the same workers have other ranks
            worker_clock = {key: clocks[i] for key, i in self._clock_keys}
            loader = ckpt.ShardLoader(path, manifest)
            try:
                for state in holder.states.values():
                    loader.load(state, worker_clock)
            except (OSError, ValueError, KeyError) as exc:
                error = f"restoring from {path!r}: {exc}"
            finally:
                loader.close()
        if self.is_worker:
            clock = clocks[self.worker_index]
            for part in (self._engine, self._client, self._node):
                if part is not None:
                    part.clock = clock
        _collective_check(self.comm, error)
        self._restore_codec_state(path, manifest, reshard)

    def _restored_clocks(self, manifest: dict) -> list[int]:
        """Every worker's clock after a restore, by worker index: the saved ones, but the
        largest saved one for every worker when the number of workers changed or in the
        co-located layout (``bsp``: every rank pushes at the same clock), and with local
        aggregation the largest of a node's for all its workers (they share one clock).
        An ``asp``/``ssp`` checkpoint may hold different clocks for any of them."""
        saved = [int(c) for c in manifest["worker_clocks"]]
        if manifest["num_workers"] != self.num_workers or self.colocated:
            return [max(saved, default=0)] * self.num_workers
        for idx in self._node_groups_by_index() or []:
            top = max(saved[i] for i in idx)
            for i in idx:
                saved[i] = top
        return saved

    def _restore_codec_state(self, path: str, manifest: dict, reshard: bool) -> None:
        """Load every rank's compression state when the checkpoint has it for this very
        layout, codec and ``feedback`` (collective); otherwise log on the first rank that
        it is dropped (residuals at zero, first pulls uncompressed)."""
        if self.compression is None:
            return
        why = None
        if not manifest.get("codec_files"):
            why = "the checkpoint holds no compression state"
        elif (manifest.get("compression"), manifest.get("feedback", True)) != \
                (self._settings.compression_name, self.feedback):
            why = (f"it was saved with compression={manifest.get('compression')!r}, "
                   f"feedback={manifest.get('feedback', True)!r}")
        elif reshard and self._layout_mismatch(manifest, False) is not None:
            why = "the layout changed (number of servers, workers or split_bytes)"
        elif manifest.get("node_groups") != self._node_groups_by_index():
            why = "local aggregation groups the workers otherwise"
        if why is not None:
            if self.rank == 0:
                log.warning("restore(%r): compression state dropped (%s): residuals restart "
                            "at zero, the first pull of each shard is uncompressed", path, why)
            return
        error = None
        holder = self._engine or self._server or self._client
        try:
            if holder is not None:    # a node's other workers keep no codec state
                holder.load_codec_state(ckpt.read_codec_file(path, manifest["id"], self.rank))
        except (OSError, ValueError, KeyError) as exc:
            error = f"restoring the compression state from {path!r}: {exc}"
        _collective_check(self.comm, error)

    def _layout_mismatch(self, manifest: dict, reshard: bool) -> str | None:
        layout = manifest["layout"]
        here = self.placement.describe()
        if layout["params"] != here["params"]:
            return ("checkpoint holds other parameters (names, shapes or dtypes) than "
                    "this ParameterServer")
        if manifest["optimizer"] != self.optimizer:
            return (f"checkpoint was saved with optimizer={manifest['optimizer']!r}, not "
                    f"{self.optimizer!r}")
        if reshard:
            return None
        if layout != here or manifest["num_workers"] != self.num_workers or \
                manifest.get("colocated", False) != self.colocated:
            then = " colocated" if manifest.get("colocated") else ""
            now = " colocated" if self.colocated else ""
            return (f"checkpoint layout differs ({layout['num_servers']}{then} servers, "
                    f"{manifest['num_workers']} workers, split_bytes {layout['split_bytes']}; "
                    f"now {self.num_servers}{now} servers, {self.num_workers} workers, "
                    f"split_bytes {self.placement.split_bytes}); pass reshard=True to "
                    f"redistribute")
        return None
