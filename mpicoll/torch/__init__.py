"""Horovod-compatible PyTorch adapter: ``import mpicoll.torch as hvd``.

A Horovod training script runs with only its import changed::

    import mpicoll.torch as hvd
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

The package by role:

- public API, under Horovod's module names: :mod:`.state` (init, layout), :mod:`.mpi_ops`
  (tensor collectives and their autograd functions), :mod:`.grouped` (grouped collectives),
  :mod:`.functions` (parameters, optimizer state, objects), :mod:`.ops` (reduction ops),
  :mod:`.process_sets`, :mod:`.sparse`, :mod:`.optimizer` (``DistributedOptimizer``),
  :mod:`.sync_batch_norm`, :mod:`.compression` (compressors, and the compressed reductions);
- :mod:`.elastic`: Horovod's ``hvd.elastic`` (training that goes on after a rank dies);
- :mod:`.ps_optimizer`: training through the parameter server (``backend="ps"``,
  ``PSOptimizer``); :mod:`.optim_wrapping`: what both optimizers share;
- :mod:`.engine`: the one thread that calls MPI (negotiation, fusion, execution, handles);
- :mod:`.device`: CUDA tensors (streams, staging copies).

The Adasum kernel is :mod:`mpicoll.algorithms.adasum`. See docs/torch.md.
"""
from __future__ import annotations

from .compression.compressors import Compression, Compressor
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .grouped import (grouped_allgather, grouped_allgather_async, grouped_allreduce,
                      grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                      grouped_reducescatter, grouped_reducescatter_async)
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                      broadcast_, broadcast_async, broadcast_async_, join, poll, reducescatter,
                      reducescatter_async, synchronize)
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .optimizer import DistributedOptimizer
from .diloco import DiLoCo
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .process_sets import ProcessSetGrid, process_grid
from .state import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                    gloo_enabled, init, is_initialized, local_rank, local_size, mpi_built,
                    mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                    size, start_timeline, stop_timeline)
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm
from ..errors import (CollectiveError, HostsUpdatedInterrupt, MismatchError,
                      ProcessFailedError, RemoteError)
from . import elastic
from . import distributed as _distributed  # noqa: F401  registers the "mpicoll" torch.distributed backend
from . import hooks  # DDP communication hooks: mpicoll.torch.hooks.int8_hook

#: Horovod's name for a failure elastic mode recovers from: :class:`~mpicoll.ProcessFailedError`
#: (a dead peer under ULFM), nothing else (see :mod:`mpicoll.torch.elastic`).
HorovodInternalError = elastic.HorovodInternalError

__all__ = ["init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "rank", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_threads_supported", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather",
           "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "sparse_allreduce_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
           "grouped_reducescatter", "grouped_reducescatter_async",
           "poll", "synchronize", "barrier", "join", "allgather_object", "broadcast_object",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer", "DiLoCo",
           "SyncBatchNorm",
           "Compression", "Compressor", "Average", "Sum", "Adasum", "Min", "Max", "Product",
           "ReduceOp", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "process_grid", "ProcessSetGrid", "CollectiveError", "MismatchError", "RemoteError",
           "HorovodInternalError", "ProcessFailedError", "HostsUpdatedInterrupt", "elastic", "hooks"]
