"""mpicoll as a ``torch.distributed`` backend: ``dist.init_process_group("mpicoll")``.

Importing this package (``import mpicoll.torch`` does it) registers the backend name
``"mpicoll"`` with :meth:`torch.distributed.Backend.register_backend` and lets
``init_process_group`` start under ``mpirun`` with no rendezvous argument::

    import torch.distributed as dist
    import mpicoll.torch  # registers "mpicoll"
    dist.init_process_group("mpicoll")        # mpirun -n N python train.py

Each group's backend is a real c10d ``Backend`` (:class:`MPIProcessGroup`, a Python
subclass of a small C++ extension's): torch wraps it in its own ``ProcessGroup`` and
registers it for the ``"cpu"`` and ``"cuda"`` devices, as it does gloo and NCCL. The
extension is built with torch's JIT on first use (the first group's creation) and cached
(:mod:`.extension`); ``import mpicoll.torch`` alone builds nothing.

Modules: :mod:`.startup` (the ``env://`` rendezvous from MPI), :mod:`.process_group`
(:class:`MPIProcessGroup`), :mod:`.options` (:class:`Options`), :mod:`.extension` (the
C++ ``Backend`` and ``Work`` trampolines), :mod:`.work` (torch's ``Work`` over the
runtime's), :mod:`.p2p` (send/recv), :mod:`.staging` (device tensors through host memory),
:mod:`.tensors` (reduce ops, host views), :mod:`.groups` (:func:`backend_of`,
:func:`monitored_barrier`, :func:`split_group`). Reference: docs/torch_distributed.md.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .groups import backend_of, monitored_barrier, split_group
from .options import BACKEND, Options
from .reconfigure import PARENT, group_comms, joining, start_joining
from .startup import install_env_handler, mpi_rendezvous, world
from .tensors import op_name as _op_name  # noqa: F401  (kept for callers of the old module)

__all__ = ["BACKEND", "MPIProcessGroup", "Options", "register", "mpi_rendezvous",
           "backend_of", "monitored_barrier", "split_group"]


def __getattr__(name: str) -> Any:
    """:class:`MPIProcessGroup` on first use (importing it builds the C++ extension)."""
    if name == "MPIProcessGroup":
        from .process_group import MPIProcessGroup  # noqa: PLC0415

        return MPIProcessGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _create(opts: Any, backend_options: Any = None) -> Any:
    """torch's backend constructor (extended API): the group's communicator from MPI.
    Under ULFM, a member that dies meanwhile is a :class:`mpicoll.ProcessFailedError`
    on every other member; a subgroup not made within the group's timeout (a member never
    called ``new_group``) a :class:`mpicoll.CollectiveTimeoutError`
    (:func:`mpicoll.runtime.progress.create`)."""
    from ...runtime import failures, progress  # noqa: PLC0415
    from . import process_group  # noqa: F401, PLC0415  (builds the extension: not watched)

    ranks = list(opts.global_ranks_in_group)
    if ranks:
        from ...elastic import grow  # noqa: PLC0415
        from .. import state  # noqa: PLC0415

        grow.check_made_in_order("new_group", {grow.HVD_INIT: state.started()})
    try:
        timeout = getattr(opts, "timeout", None)
        return progress.create(lambda made: _build(opts, backend_options, ranks, made),
                               world(), ranks, "new_group",
                               None if timeout is None else timeout.total_seconds(),
                               _never_made if joining() else None)
    except Exception:
        if ranks and failures.ENABLED:
            PARENT.clear()   # maybe still in use by a creation stuck in MPI: later
                              # groups are made from the world
        raise


def _never_made() -> str | None:
    """In a process that joined a running job: why a group it waits to make never will be
    (every running rank began the state's sync without making it), or ``None``."""
    from ...elastic import grow  # noqa: PLC0415

    if not grow.running_ranks_at_sync():
        return None
    return ("this process joined a running job, and the running ranks began the elastic "
            "state's first sync without making this group: they made the program's "
            "top-level groups before the growth, at the old size. Make a group whose ranks "
            "depend on the world size again in a reset callback "
            "(state.register_reset_callbacks), where the running ranks make it with the "
            "new processes")


def _build(opts: Any, backend_options: Any, ranks: list[int], made: list[Any]) -> Any:
    """:func:`_create`'s work (``ranks``: the group's global ranks); the communicator,
    once made, is appended to ``made``."""
    from mpi4py import MPI  # noqa: PLC0415

    from ..threads import fit as fit_threads  # noqa: PLC0415
    from .process_group import MPIProcessGroup  # noqa: PLC0415  (builds the extension)

    comm_world = world()
    if not ranks:  # the default group: every MPI process, ranks as MPI's
        if (opts.group_rank != comm_world.Get_rank()
                or opts.group_size != comm_world.Get_size()):
            raise RuntimeError(
                f"the mpicoll backend got rank {opts.group_rank} of {opts.group_size} from "
                f"torch's rendezvous, but MPI says rank {comm_world.Get_rank()} of "
                f"{comm_world.Get_size()}: start every process with mpirun, and where RANK "
                f"and WORLD_SIZE are set they must equal MPI's")
        fit_threads(None if joining() else comm_world)   # a new process: no collective
    comm, owned = group_comms(comm_world, ranks)
    if ranks and (comm == MPI.COMM_NULL or comm.Get_rank() != opts.group_rank):
        raise RuntimeError(f"the mpicoll backend could not build group {ranks}: "
                           f"default group and MPI.COMM_WORLD differ")
    made.append(comm)
    return MPIProcessGroup(comm, comm.Get_rank(), comm.Get_size(), opts.timeout,
                           backend_options, owned, group_name=opts.group_id, ranks=ranks)


def register() -> None:
    """Register ``"mpicoll"`` with torch and the MPI fallback of ``env://`` (idempotent);
    in a process that joined a running job, hold DDP's start-up synchronisation for the
    elastic state's first sync (:func:`.reconfigure.start_joining`)."""
    from ...elastic import grow  # noqa: PLC0415

    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    install_env_handler()
    if grow.joined is not None:
        start_joining()


register()
