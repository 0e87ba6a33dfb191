"""mpicoll as a ``torch.distributed`` backend: ``dist.init_process_group("mpicoll")``.

Importing this module (``import mpicoll.torch`` does it) registers the backend name
``"mpicoll"`` (CPU tensors) with :meth:`torch.distributed.Backend.register_backend`, and
lets ``init_process_group`` start under ``mpirun`` with no rendezvous argument::

    import torch.distributed as dist
    import mpicoll.torch  # registers "mpicoll"
    dist.init_process_group("mpicoll")        # mpirun -n N python train.py

Start-up: where ``RANK`` is not set but an MPI launcher's variables are (MPICH/hydra's
``PMI_RANK``, Open MPI's ``OMPI_COMM_WORLD_RANK``, PMIx's ``PMIX_RANK``), torch's ``env://``
rendezvous is answered from MPI: rank and size are ``MPI.COMM_WORLD``'s, and the store torch
requires is a :class:`torch.distributed.TCPStore` served by rank 0 on a free port, whose
host name and port rank 0 broadcasts over MPI (no ``MASTER_ADDR``/``MASTER_PORT``). Where
``RANK`` is set (torchrun, or the user's own variables), torch's own ``env://`` runs
unchanged, and the backend checks that ``RANK``/``WORLD_SIZE`` equal MPI's.

Operations run through mpicoll's collectives (``algorithm="auto"``; as for the rest of
mpicoll.torch, ``MPICOLL_ALLREDUCE_ALGORITHM`` forces one all-reduce algorithm, and
``MPICOLL_ALGORITHM`` one algorithm for every collective) on a private communicator per
process group, on zero-copy numpy views of contiguous CPU tensors. They are synchronous for
now: each call completes on the calling thread and returns a finished ``Work`` whose
``wait()`` and ``get_future()`` work. The first call of each kind per group runs mpicoll's
agreement check (``check=True``), so ranks that disagree on the first call's shape or dtype
get a :class:`mpicoll.MismatchError` instead of a hang; later calls check only where
``MPICOLL_CHECK`` asks for it.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .engine.dtypes import numpy_view, reduce_dtype
from .engine.settings import allreduce_algorithm

__all__ = ["BACKEND", "MPIProcessGroup", "register", "mpi_rendezvous"]

#: The backend name for ``dist.init_process_group``.
BACKEND = "mpicoll"

#: Environment variables that say a process was started by an MPI launcher.
_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")

_BITWISE = {"BAND": "band", "BOR": "bor", "BXOR": "bxor"}
_OPS = {"SUM": "sum", "AVG": "average", "PRODUCT": "prod", "MIN": "min", "MAX": "max", **_BITWISE}


def _op_name(reduce_op: Any) -> str:
    """mpicoll's name for a torch ``ReduceOp`` (raises ``ValueError`` for the others)."""
    for name, ours in _OPS.items():
        if reduce_op == getattr(dist.ReduceOp, name):
            return ours
    raise ValueError(f"the mpicoll backend does not support reduce op {reduce_op}")


def _done(result: Any) -> Any:
    """A finished ``Work`` whose future holds ``result``."""
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _check_tensor(tensor: Any, argname: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TypeError(f"{argname} is on {tensor.device}; the mpicoll backend handles CPU "
                        f"tensors only for now")
    return tensor


class _Host:
    """A flat numpy array for ``tensor``: a zero-copy view where it is contiguous (and not
    bfloat16 for a reduction), else a copy written back by :meth:`finish`."""

    def __init__(self, tensor: torch.Tensor, reduce: bool, argname: str) -> None:
        self.tensor = _check_tensor(tensor, argname)
        if reduce and reduce_dtype(tensor.dtype) is not tensor.dtype:
            self.work = tensor.detach().to(reduce_dtype(tensor.dtype)).contiguous()
        elif tensor.is_contiguous():
            self.work = tensor
        else:
            self.work = tensor.detach().contiguous()
        self.array = numpy_view(self.work)

    def finish(self) -> None:
        if self.work is not self.tensor:
            with torch.no_grad():
                self.tensor.copy_(self.work.view_as(self.tensor))


class MPIProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives are mpicoll's, on its own MPI communicator.

    Args:
        comm: the communicator (private to this group; ranks in group order).
        rank: this process's rank in the group (equals ``comm``'s).
        size: the group's size (equals ``comm``'s).
    """

    def __init__(self, comm: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._checked: set[str] = set()
        self._algorithm = allreduce_algorithm()

    # --- helpers -----------------------------------------------------------------------
    def _check(self, kind: str) -> bool | None:
        """``True`` on the first call of ``kind`` (agreement check), else the default."""
        if kind in self._checked:
            return None
        self._checked.add(kind)
        return True

    def _allreduce_one(self, tensor: torch.Tensor, op: str, check: bool | None) -> None:
        import mpicoll

        if op in _BITWISE.values() and (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"reduce op {op} needs an integer or bool tensor, not {tensor.dtype}")
        host = _Host(tensor, True, "tensor")
        mpicoll.allreduce(mpicoll.IN_PLACE, host.array, op=op, comm=self.comm,
                          algorithm=self._algorithm, check=check)
        host.finish()

    # --- torch's ProcessGroup interface ---------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        op = _op_name(opts.reduceOp)
        check = self._check("allreduce")
        for tensor in tensors:
            self._allreduce_one(tensor, op, check)
        return _done(tensors)

    allreduce_coalesced = allreduce  # one all-reduce per tensor, same options

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        import mpicoll

        check = self._check("broadcast")
        for tensor in tensors:
            host = _Host(tensor, False, "tensor")
            mpicoll.broadcast(host.array, root=opts.rootRank, comm=self.comm, check=check)
            host.finish()
        return _done(tensors)

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        import mpicoll

        _check_tensor(output, "output_tensor")
        src = _Host(input, False, "input_tensor")
        if output.dtype != input.dtype or output.numel() != input.numel() * self.size():
            raise ValueError(f"output tensor must hold {self.size()} x {input.numel()} elements "
                             f"of {input.dtype}, not {output.numel()} of {output.dtype}")
        dst = _Host(output, False, "output_tensor")
        mpicoll.allgather(src.array, dst.array, comm=self.comm,
                          check=self._check("allgather"))
        dst.finish()

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for outputs, input in zip(output_tensors, input_tensors):
            if len(outputs) != self.size():
                raise ValueError(f"all_gather needs {self.size()} output tensors, "
                                 f"not {len(outputs)}")
            gathered = torch.empty((self.size(), *input.shape), dtype=input.dtype)
            self._gather_into(gathered, input)
            with torch.no_grad():
                for out, part in zip(outputs, gathered):
                    out.copy_(part.view_as(out))
        return _done(output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._gather_into(output, input)
        return _done([output])

    all_gather_single = _allgather_base  # torch 2.13's name (all_gather_into_tensor)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self._gather_into(output, input)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        import mpicoll

        op = _op_name(opts.reduceOp)
        _check_tensor(output, "output")
        if output.dtype != input.dtype or input.numel() != output.numel() * self.size():
            raise ValueError(f"input tensor must hold {self.size()} x {output.numel()} elements "
                             f"of {output.dtype}, not {input.numel()} of {input.dtype}")
        src = _Host(input, True, "input")
        dst = _Host(output, True, "output")
        mpicoll.reduce_scatter(src.array, dst.array, op=op, comm=self.comm,
                               check=self._check("reduce_scatter"))
        dst.finish()
        return _done([output])

    reduce_scatter_single = _reduce_scatter_base  # torch 2.13's name

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any) -> Any:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any) -> Any:
        for output, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self.size():
                raise ValueError(f"reduce_scatter needs {self.size()} input tensors, "
                                 f"not {len(inputs)}")
            self._reduce_scatter_base(output, torch.cat([t.reshape(-1) for t in inputs]), opts)
        return _done(output_tensors)

    def barrier(self, opts: Any = None) -> Any:
        self.comm.Barrier()
        return _done(None)


def _in_mpi_launch() -> bool:
    return any(var in os.environ for var in _LAUNCHER_RANK_VARS)


def _world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _create(opts: Any, backend_options: Any = None) -> MPIProcessGroup:
    """torch's backend constructor (extended API): the group's communicator from MPI."""
    from mpi4py import MPI

    world = _world()
    ranks = list(opts.global_ranks_in_group)
    if not ranks:  # the default group: every MPI process, ranks as MPI's
        if opts.group_rank != world.Get_rank() or opts.group_size != world.Get_size():
            raise RuntimeError(
                f"the mpicoll backend got rank {opts.group_rank} of {opts.group_size} from "
                f"torch's rendezvous, but MPI says rank {world.Get_rank()} of "
                f"{world.Get_size()}: start every process with mpirun, and where RANK and "
                f"WORLD_SIZE are set they must equal MPI's")
        comm = world.Dup()
    else:
        group = world.Get_group().Incl(ranks)
        comm = world.Create_group(group)
        group.Free()
        if comm == MPI.COMM_NULL or comm.Get_rank() != opts.group_rank:
            raise RuntimeError(f"the mpicoll backend could not build group {ranks}: "
                               f"default group and MPI.COMM_WORLD differ")
    return MPIProcessGroup(comm, comm.Get_rank(), comm.Get_size())


def mpi_rendezvous(timeout: timedelta = timedelta(minutes=30)) -> tuple[Any, int, int]:
    """A shared store, rank and world size from MPI: rank 0 serves a ``TCPStore`` on a free
    port of its host and broadcasts host and port over ``MPI.COMM_WORLD`` (every rank
    calls it).

    Returns:
        ``(store, rank, world_size)``, as ``init_process_group(store=..., rank=...,
        world_size=...)`` takes them.
    """
    world = _world()
    rank, size = world.Get_rank(), world.Get_size()
    store = None
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timeout, wait_for_workers=False)
        address = (socket.gethostname(), store.port)
    else:
        address = None
    host, port = world.bcast(address, root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    return store, rank, size


_torch_env_handler = None


def _check_env_matches_mpi() -> None:
    """Under an MPI launcher with ``RANK`` set: raise before torch's rendezvous (which would
    wait for ranks that never come) unless ``RANK``/``WORLD_SIZE`` equal MPI's."""
    world = _world()
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank != str(world.Get_rank()) or (env_size is not None
                                             and env_size != str(world.Get_size())):
        raise RuntimeError(
            f"RANK={env_rank} WORLD_SIZE={env_size} in the environment, but MPI says rank "
            f"{world.Get_rank()} of {world.Get_size()}: unset RANK to take both from MPI, "
            f"or set them to MPI's")


def _env_handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's ``env://``, answered from MPI where the process runs under an MPI launcher and
    ``RANK`` is not set."""
    if _in_mpi_launch():
        if "RANK" not in os.environ:
            timeout = kwargs.get("timeout", timedelta(minutes=30))
            yield mpi_rendezvous(timeout)
            raise RuntimeError("unable to perform re-rendezvous using the MPI store")
        _check_env_matches_mpi()
    yield from _torch_env_handler(url, **kwargs)  # type: ignore[misc]


def register() -> None:
    """Register ``"mpicoll"`` with torch and the MPI fallback of ``env://`` (idempotent)."""
    global _torch_env_handler
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    handlers = rendezvous._rendezvous_handlers
    if _torch_env_handler is None and handlers.get("env") is not _env_handler:
        _torch_env_handler = handlers["env"]
        handlers["env"] = _env_handler


register()
