"""The "mpicoll" process groups after an elastic reconfiguration: rebuilt in place.

When the runtime's world changes (:mod:`mpicoll.elastic` shrank it to the survivors of a
failure), :func:`follow_world` rebuilds every live mpicoll group of this process on the new
world, keeping the objects torch and the user hold: the default group (``dist.group.WORLD``)
and every group made from it stay the same ``ProcessGroup`` objects, so a DDP module (whose
reducer holds its group) or a group kept in a variable go on with the survivors.

For each group, oldest first (every rank rebuilds the groups it belongs to in the same
order, as it created them):

- its members are its old members that survived, renumbered as ranks of the new world
  (MPI keeps their order);
- its communicators are made again on the new world (the default group's: duplicates of
  the new world; another group's: ``MPI_Comm_create_group`` of its surviving members),
  the old ones forgotten (revoked), its lanes replaced
  (:meth:`~.process_group.MPIProcessGroup.rebind`);
- its rank and size change where torch keeps them: the c10d ``ProcessGroup`` and
  ``Backend`` objects (``dist.get_rank()``, ``dist.get_world_size()``, DDP's reducer, which
  divides by the group's size at every backward), and torch's map of the group's global
  ranks (``dist.get_rank(group)``, ``dist.get_process_group_ranks``).

Collective over the new world (each group's rebuild over its surviving members). Idempotent:
a group already on the current world is left alone. The elastic APIs call it after their
reset (:mod:`mpicoll.torch.elastic`, ``TorchState.reset``).

When the world grew (:mod:`mpicoll.elastic.grow`: new processes joined), the new processes
run the program from its start while the running ranks are in their reset; the two sides
make the same collectives in the same order:

- the running ranks answer the new processes' rendezvous (rank 0's store address, one
  broadcast: :func:`~.startup.answer_joiners`), then rebuild the default group over the
  grown world (its new members are the new processes, whose ``init_process_group`` makes
  the same communicators); a group of explicit ranks keeps its members;
- a DDP module built by a new process does not synchronise at its construction (DDP's
  shape check and broadcast of rank 0's parameters, which the running ranks do not make):
  the elastic state's first sync gives it rank 0's state, as it gives the optimizer's
  (:func:`end_joining`); a DDP module that the state does not hold raises at its first
  forward in the new process, rather than training from other parameters;
- every running DDP module over a grown group forgets its bucket layout (torch's
  ``DistributedDataParallel._update_process_group``), and at the state's first sync after
  the growth the DDP modules in the state, on the running ranks and the new processes
  alike, lay their buckets out as rank 0 says (:func:`align_ddp_buckets`): a running
  rank's layout followed its earlier backward passes, a new process's does not.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from ...elastic import grow
from ...elastic.shrink import survivors
from ...runtime import comms
from ...runtime import world as runtime_world
from . import startup
from .groups import cpu_backend

__all__ = ["follow_world", "survivors", "shrunk", "adopt_wrapper", "group_comms",
           "member_comm", "PARENT", "start_joining", "end_joining", "joining",
           "align_ddp_buckets", "remade_before_callbacks"]

log = logging.getLogger("mpicoll.torch")

#: The communicator groups other than the default one are made from: a duplicate of the
#: world the default mpicoll group owns (empty: the world itself), so that a creation
#: left in MPI after a member died (:func:`mpicoll.runtime.progress.create`) does not
#: share the user's world.
PARENT: list[Any] = []


def group_comms(world: Any, ranks: list[int]) -> tuple[Any, tuple[Any, ...]]:
    """The communicator of the group of the ranks ``ranks`` of ``world`` and the
    communicators it owns: the default group's (``ranks`` empty) is a duplicate of
    ``world`` and owns a second one (:data:`PARENT`, which later groups are made from);
    another group's is :func:`member_comm` of :data:`PARENT` (or of ``world``), owning none."""
    if ranks:
        return member_comm(PARENT[0] if PARENT else world, ranks), ()
    comm = comms.dup(world, "group")
    owned = (comms.dup(world, "group"),)
    PARENT[:] = owned
    return comm, owned


def member_comm(parent: Any, ranks: list[int], tag: int = 0) -> Any:
    """The communicator of the ranks ``ranks`` of ``parent`` (``MPI_Comm_create_group``:
    collective over those ranks only; ``MPI.COMM_NULL`` elsewhere)."""
    group = parent.Get_group().Incl(ranks)
    try:
        return comms.create_group(parent, group, tag, "group")
    finally:
        group.Free()


def _groups() -> list[tuple[Any, Any]]:
    """(torch's ``ProcessGroup``, its mpicoll backend) of every live mpicoll group, oldest
    first."""
    if not dist.is_initialized():
        return []
    found = [(pg, cpu_backend(pg)) for pg in list(dist.distributed_c10d._world.pg_map)
             if _is_mpicoll(pg)]
    return sorted([pair for pair in found if not pair[1]._shut], key=lambda pair: pair[1].serial)


def adopt_wrapper(backend: Any) -> None:
    """Make the torch ``ProcessGroup`` that holds ``backend`` name it as torch names every
    custom backend's group: ``dist.shrink_group`` registers the new backend under gloo's
    type on CPU, and DDP's logger then reads it as gloo's (a segmentation fault in
    ``c10d::Logger::set_env_variables``). Run at the new group's first operation (torch
    has registered the group by then)."""
    for pg in list(dist.distributed_c10d._world.pg_map):
        if cpu_backend(pg) is backend:
            custom = dist.ProcessGroup.BackendType.CUSTOM
            pg._register_backend(torch.device("cpu"), custom, backend)
            pg._set_default_backend(custom)
            return


def follow_world() -> int:
    """Rebuild every mpicoll group built for an older world on the current one (see the
    module's docstring). Returns how many were rebuilt."""
    generation = runtime_world.generation()
    stale = [(pg, b) for pg, b in _groups() if b.generation != generation]
    if not stale:
        return 0
    new_world = runtime_world.comm()
    default = next((b for _, b in stale if not b.options.global_ranks_in_group), None)
    grew = default is not None and default.size() < new_world.Get_size()
    if grew:
        startup.answer_joiners(new_world)
    if default is None:
        PARENT.clear()        # the default group is not mpicoll's: groups from the world
    elif PARENT and comms.record_of(PARENT[0]) is None:
        PARENT.clear()        # the old world's, released with it
    group_ranks = dist.distributed_c10d._world.pg_group_ranks
    from . import extension  # noqa: PLC0415

    set_rank_size = extension.load().set_process_group_rank_size
    for pg, backend in stale:
        old_world = runtime_world.state_world(backend.generation).group   # (maybe freed)
        members = backend.options.global_ranks_in_group
        # the default group ([]): every rank of the new world
        ranks = survivors(old_world, members, new_world) if members else []
        comm, owned = group_comms(new_world, ranks)
        old_size = backend.size()
        backend.rebind(comm, owned, ranks)
        set_rank_size(pg, comm.Get_rank(), comm.Get_size())
        group_ranks[pg] = {g: i for i, g in enumerate(ranks or range(new_world.Get_size()))}
        log.info("process group %s rebuilt on the new world: %d -> %d ranks",
                 backend.options.group_name, old_size, comm.Get_size())
    if grew:
        _rebuild_ddp_buckets([pg for pg, _ in stale])
    return len(stale)


def _cannot_grow() -> tuple[str, str] | None:
    """What of this process's torch objects over "mpicoll" groups cannot take in new
    processes (:data:`mpicoll.elastic.grow.refusers`): a ``DistributedDataParallel`` with
    ``static_graph=True`` (a new process's first iteration makes the collectives of a
    static graph's first, which the running ranks are past) and a ``DeviceMesh`` (FSDP2's:
    its sub-groups' ranks follow the world's size)."""
    if not dist.is_initialized():
        return None
    import gc  # noqa: PLC0415

    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    for obj in gc.get_objects():
        if (isinstance(obj, DistributedDataParallel) and obj.static_graph
                and _is_mpicoll(obj.process_group)):
            return ("a DistributedDataParallel(static_graph=True) module is in use",
                    ("a new process would make the collectives of a static graph's first "
                     "iteration, which the running ranks are past (use static_graph=False "
                     "to grow)"))
        if isinstance(obj, DeviceMesh) and any(_is_mpicoll(g) for g in obj.get_all_groups()):
            return ("a DeviceMesh (FSDP2's) is in use",
                    ("its groups' ranks follow the world's size, and the new processes "
                     "cannot make the running ranks' (launch at the final size)"))
    return None


grow.refusers.append(_cannot_grow)


def _ddp_modules() -> list[Any]:
    """Every live ``DistributedDataParallel`` module of this process."""
    import gc  # noqa: PLC0415

    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    return [obj for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)]


#: DDP modules whose buckets the elastic state's next sync lays out again on every rank
#: (:func:`align_ddp_buckets`): a running rank's over a grown group, a new process's.
_to_align: weakref.WeakSet[Any] = weakref.WeakSet()


def _rebuild_ddp_buckets(groups: list[Any]) -> None:
    """Make the DDP modules over ``groups`` forget their bucket layout (torch's
    ``_update_process_group``), for :func:`align_ddp_buckets`."""
    for module in _ddp_modules():
        if any(module.process_group is pg for pg in groups):
            module._update_process_group(module.process_group)
            _to_align.add(module)


def align_ddp_buckets(values: list[Any]) -> None:
    """The elastic state's sync after the world grew, on the running ranks and the new
    processes alike: each DDP module among ``values`` (or wrapping one of them; in their
    order, the same on every rank) marked for it lays its buckets out as rank 0 says (DDP's own bucket rebuild,
    from the parameters' order: two broadcasts), so the first backward after the growth
    reduces the same layout everywhere (a running rank's buckets follow its earlier
    backward passes' order, a new process's the parameters' reversed order)."""
    for value in values:
        ddp = next((d for d in _to_align if value is d or value is d.module), None)
        if ddp is not None:       # the state holds the DDP module, or the module it wraps
            _to_align.discard(ddp)
            ddp.reducer._push_all_rebuilt_params()
            ddp.reducer._rebuild_buckets()
            ddp._has_rebuilt_buckets = True


#: In a process that joined a running job, until its elastic state's first sync: the
#: modules of the DDP modules built meanwhile (their start-up synchronisation is left to
#: that sync), with the hooks that refuse a forward before it. ``None``: not joining.
_held: dict[int, tuple[Any, Any]] | None = None


def joining() -> bool:
    """Whether this process joined a running job and has not had its first sync yet."""
    return _held is not None


def _is_mpicoll(group: Any) -> bool:
    from . import extension  # noqa: PLC0415

    module = extension.loaded()      # None: no mpicoll group was ever made here
    return module is not None and isinstance(cpu_backend(group), module.Backend)


def start_joining() -> None:
    """In a process that joined a running job (before its program runs): DDP modules over
    an "mpicoll" group skip the collectives DDP makes at construction (the running ranks
    do not make them); :func:`end_joining` is the elastic state's first sync."""
    global _held
    import torch.nn.parallel.distributed as ddp  # noqa: PLC0415

    if _held is not None:
        return
    _held = {}
    verify, sync = ddp._verify_param_shape_across_processes, ddp._sync_module_states

    def verify_held(process_group: Any, tensors: Any, logger: Any = None) -> Any:
        if _held is not None and _is_mpicoll(process_group):
            return None
        return verify(process_group, tensors, logger)

    def sync_held(module: Any, process_group: Any, *args: Any, **kwargs: Any) -> Any:
        if _held is not None and _is_mpicoll(process_group):
            def refuse(*_: Any) -> None:
                raise RuntimeError(
                    "mpicoll: this process joined a running job, and a DDP module it "
                    "built is not in the elastic state, whose first sync gives the new "
                    "processes rank 0's parameters: give it to the state "
                    "(TorchState(model=ddp_model)) and build it before the elastic function")
            _held[id(module)] = (module, module.register_forward_pre_hook(refuse))
            return None
        return sync(module, process_group, *args, **kwargs)

    ddp._verify_param_shape_across_processes = verify_held
    ddp._sync_module_states = sync_held


def end_joining(synced: list[Any]) -> None:
    """The elastic state's first sync in a process that joined: the DDP modules among
    ``synced`` (or whose modules are) got rank 0's state; a held module not among them
    keeps refusing its forward."""
    global _held
    if _held is None:
        return
    for value in synced:
        held = _held.pop(id(getattr(value, "module", value)), None)
        if held is not None:
            held[1].remove()
            # the DDP module (the state may hold the module it wraps): its buckets as the
            # running ranks' (align_ddp_buckets)
            _to_align.update(d for d in _ddp_modules() if d.module is held[0])
    _held = None


def remade_before_callbacks(engine: bool) -> list[str]:
    """Running rank 0 at a growth (``engine``: the hvd engine is to be started again):
    the calls whose making it repeats before the reset callbacks, for the new processes'
    hello (:func:`mpicoll.elastic.grow.check_made_in_order`)."""
    default = dist.is_initialized() and _is_mpicoll(dist.group.WORLD)
    return [call for call, made in ((grow.HVD_INIT, engine), (grow.DIST_INIT, default))
            if made]


def shrunk(backend: Any, excluded: list[int]) -> tuple[Any, tuple[Any, ...], list[int]]:
    """torch's ``dist.shrink_group`` on an mpicoll group (``Backend.shrink``): the
    communicator, owned communicators and global ranks of a new backend of ``backend``'s
    members but the group ranks ``excluded``. Collective over the members kept (the
    excluded ones do not call it).

    After a process failure (ULFM: the group's communicator revoked, or MPI knows a member
    dead) the survivors first agree on the dead (``MPI_Comm_shrink``), which must all be
    in ``excluded`` (else ``RuntimeError`` on every survivor); live members may be
    excluded too (``MPI_Comm_create_group`` of the rest). Shrinking the default group
    makes the survivors the runtime's world (what ``comm=None`` and later groups' global
    ranks mean), as torch makes the new group the default one.
    """
    from ... import context  # noqa: PLC0415
    from ...runtime import failures  # noqa: PLC0415

    size = backend.size()
    keep = [r for r in range(size) if r not in set(excluded)]
    base, base_members, made = comms.plain(backend.comm), list(range(size)), None
    picks: list[int] | None = None       # the kept members' ranks in ``base``, where known
    failed = failures.ENABLED and bool(failures.failed_ranks(base, 0.0)
                                       or backend._failures.ranks)
    if failures.ENABLED and failures.revoked(base) and not failed:
        # revoked by the group's own abort, nobody dead: MPI_Comm_shrink would wait for the
        # excluded members, which do not call it; the kept ones make theirs from the world's
        world = comms.plain(runtime_world.comm())
        picks = MPI.Group.Translate_ranks(base.Get_group(), keep, world.Get_group())
        base = world
    elif failed or (failures.ENABLED and failures.revoked(base)):
        made = comms.shrink(base, "group")
        base_members = survivors(made, list(range(made.Get_size())), base)
        dead = sorted(set(range(size)) - set(base_members))
        if not set(dead) <= set(excluded):
            comms.free(made)
            raise RuntimeError(f"shrink_group: rank(s) {dead} of the group failed but "
                               f"ranks_to_exclude is {sorted(excluded)}")
        base = made
    if len(keep) == base.Get_size() and made is not None:
        comm = made
    else:
        comm = member_comm(base, picks if picks is not None else
                           [base_members.index(r) for r in keep], tag=1)
        if made is not None:
            comms.free(made)
    members = backend.options.global_ranks_in_group
    if members:
        return comm, (), [members[r] for r in keep]
    context.set_world(comm)             # the default group: the survivors are the world
    return (*group_comms(comm, []), [])
