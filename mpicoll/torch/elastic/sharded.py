"""FSDP2 modules and DeviceMeshes that go on with the survivors of a failure (issue 34).

An FSDP2 module (``torch.distributed.fsdp.fully_shard``) keeps 1/n of each parameter and
of its optimizer state on each of n ranks: when a rank dies its shard is gone with it. So
an elastic commit of such a module keeps a **full copy** of the model's and optimizer's
state on every rank (``torch.distributed.checkpoint.state_dict``'s full state dicts: one
all-gather per tensor at each commit, and the memory of the whole model and optimizer
state on every rank, n times what FSDP holds per rank). After the world shrinks:

1. every one-dimensional ``DeviceMesh`` of a "mpicoll" group is renumbered in place over
   the group's survivors (:func:`follow_mesh`; its group was rebuilt by
   :func:`~mpicoll.torch.distributed.reconfigure.follow_world`). A mesh of several
   dimensions (2 x 2) cannot be filled by the survivors (3): ``ValueError`` on every rank;
2. every FSDP2 parameter is sharded again over the renumbered mesh from the full copy
   (:func:`reshard`): FSDP's own ``FSDPParam`` builds its new padded shard, its
   ``nn.Parameter`` is new, and the optimizer is pointed at the new parameters;
3. the sync loads rank 0's full state into every rank's shards.

Written against torch 2.13's FSDP2 internals (``FSDPParam._init_sharded_param``,
``FSDPMeshInfo``, ``DeviceMesh._layout``/``_rank_map``): a torch that changes them makes
:func:`reshard` raise ``RuntimeError`` naming what it did not find.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["snapshot", "is_sharded", "full_model_state", "full_optimizer_state",
           "load_model_state", "load_optimizer_state",
           "follow_mesh", "reshard"]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` has FSDP2 (DTensor) parameters."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return any(isinstance(p, DTensor) for p in model.parameters())


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # noqa: PLC0415

    return StateDictOptions(full_state_dict=True)


def snapshot(value: Any, device: Any = None) -> Any:
    """A copy of ``value`` (a ``state_dict()``) sharing no memory with it: tensors cloned
    (onto ``device`` if given; about 4x faster than ``copy.deepcopy`` of a tensor),
    containers rebuilt, anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if device is None else value.detach().to(device, copy=True)
    if isinstance(value, dict):
        return type(value)((k, snapshot(v, device)) for k, v in value.items()) \
            if type(value) is not dict else {k: snapshot(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(snapshot(v, device) for v in value)
    return copy.deepcopy(value)


def full_model_state(model: torch.nn.Module) -> dict:
    """The full (unsharded) state dict of ``model``, as host tensors on every rank
    (collective over the model's mesh: an all-gather per parameter)."""
    from torch.distributed.checkpoint import state_dict as dcp  # noqa: PLC0415

    return snapshot(dcp.get_model_state_dict(model, options=_options()), "cpu")


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict:
    """The full state dict of ``optimizer`` over ``model``'s parameters, as host tensors on
    every rank (collective: an all-gather per state tensor)."""
    from torch.distributed.checkpoint import state_dict as dcp  # noqa: PLC0415

    return snapshot(dcp.get_optimizer_state_dict(model, optimizer, options=_options()),
                    "cpu")


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """Load a :func:`full_model_state` into ``model``'s shards: each rank keeps its own
    slices. ``state`` is left as it was (torch's loader replaces the values of the dict it
    is given with DTensors)."""
    from torch.distributed.checkpoint import state_dict as dcp  # noqa: PLC0415

    dcp.set_model_state_dict(model, dict(state), options=_options())


def load_optimizer_state(model: torch.nn.Module, optimizer: Any, state: dict) -> None:
    """Load a :func:`full_optimizer_state` into
    ``optimizer``'s shards over ``model``'s parameters."""
    from torch.distributed.checkpoint import state_dict as dcp  # noqa: PLC0415

    dcp.set_optimizer_state_dict(model, optimizer, state, options=_options())


def follow_mesh(mesh: Any) -> bool:
    """Renumber a one-dimensional ``mesh`` in place over its group's members now (after
    :func:`~mpicoll.torch.distributed.reconfigure.follow_world`). Returns whether it
    changed.

    Raises:
        ValueError: the mesh has several dimensions and one of its groups lost ranks
            (the survivors cannot fill it), on every rank (agreed with an all-reduce over
            the world's default group).
        RuntimeError: this torch's DeviceMesh lacks what is renumbered.
    """
    ranks = [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)]
    sizes = tuple(len(r) for r in ranks)
    changed = sizes != tuple(mesh.shape)
    if mesh.ndim != 1:
        # a rank whose own rows kept every member must raise too: agree over the world
        flag = torch.tensor([int(changed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        changed = bool(flag.item())
    if not changed:
        return False
    if mesh.ndim != 1:
        raise ValueError(
            f"a DeviceMesh of shape {tuple(mesh.shape)} cannot be filled by the "
            f"{dist.get_world_size()} ranks of the shrunk world (only one-dimensional "
            f"meshes follow a shrunk world): rebuild the mesh and its modules, or restart "
            f"from a checkpoint")
    try:
        from torch.distributed._mesh_layout import _MeshLayout  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(f"this torch's DeviceMesh cannot be renumbered: {exc}") from exc
    for name in ("_layout", "_rank_map", "_flatten_rank_map", "_coordinate_on_dim"):
        if not hasattr(mesh, name):
            raise RuntimeError(f"this torch's DeviceMesh has no {name}: it cannot be "
                               f"renumbered after a failure")
    members = ranks[0]
    mesh._layout = _MeshLayout.from_sizes_strides((len(members),), (1,))
    mesh._rank_map = torch.tensor(members, dtype=torch.int)
    mesh._flatten_rank_map = tuple(members)
    mesh._rank = dist.get_rank()
    mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()
    mesh._hash = None
    return True


def _fqn_of(model: torch.nn.Module) -> dict[tuple[int, str], str]:
    """(id of a module, parameter name in it) -> the parameter's name in ``model``."""
    return {(id(module), name): f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False)}


def _end_iteration(model: torch.nn.Module, fsdp_module: type) -> None:
    """FSDP's own recovery after a forward or backward that raised
    (``FSDPModule.reset_iter_state``: per-iteration state cleared, parameters back to
    their shards), on each root FSDP module of ``model``, without waiting for the
    all-gather that failed (its Work raises)."""
    for module in model.modules():
        if not isinstance(module, fsdp_module):
            continue
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", ()):
            group._all_gather_result = None
        if getattr(state, "_is_root", None) is not False and hasattr(module,
                                                                     "reset_iter_state"):
            module.reset_iter_state()


def reshard(model: torch.nn.Module, full: dict, optimizers: list[Any] = ()) -> int:
    """Shard every FSDP2 parameter of ``model`` again over its (renumbered) mesh, from
    ``full`` (a :func:`full_model_state`), and point
    ``optimizers`` at the new parameters (their state is dropped: load it after).
    Returns how many parameters were resharded.

    Raises:
        ValueError: a mesh cannot be filled (:func:`follow_mesh`), or FSDP2 shards over
            a replicated (HSDP) mesh.
        RuntimeError: this torch's FSDP2 lacks what is rebuilt.
    """
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
        from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: PLC0415
            FSDPMeshInfo, HSDPMeshInfo)
    except ImportError as exc:
        raise RuntimeError(f"this torch's FSDP2 cannot be resharded: {exc}") from exc
    names = _fqn_of(model)
    _end_iteration(model, FSDPModule)
    replaced: dict[int, torch.nn.Parameter] = {}
    seen_meshes: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for info in {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info)
                     if i is not None}.values():
            if isinstance(info, HSDPMeshInfo) or not isinstance(info, FSDPMeshInfo):
                raise ValueError(f"FSDP2 over a {type(info).__name__} cannot be "
                                 f"resharded after a failure: only plain FSDP over a "
                                 f"one-dimensional mesh")
            if id(info.mesh) not in seen_meshes:
                follow_mesh(info.mesh)
                seen_meshes.add(id(info.mesh))
            info.shard_mesh_size = info.mesh.size(info.shard_mesh_dim)
            info.shard_mesh_rank = info.shard_process_group.rank()
        for fp in group.fsdp_params:
            owner = fp._module_info
            name = names.get((id(owner.module), owner.param_name))
            if name is None or name not in full:
                raise RuntimeError(f"FSDP2 parameter {owner.param_name!r} of "
                                   f"{type(owner.module).__name__} is not in the committed "
                                   f"state")
            before = fp.sharded_param
            value = full[name].to(device=fp.device, dtype=before.dtype)
            fp._init_sharded_param(torch.nn.Parameter(value, requires_grad=before.requires_grad),
                                   fp.device, None, fp.mesh_info)
            if fp.post_forward_mesh_info is not None:
                fp._init_sharded_post_forward_param_metadata(value)
            fp.all_gather_outputs = []
            fp.__dict__.pop("_unsharded_param", None)
            replaced[id(before)] = fp.sharded_param
    for optimizer in optimizers:
        for param_group in optimizer.param_groups:
            param_group["params"] = [replaced.get(id(p), p) for p in param_group["params"]]
        optimizer.state.clear()
    return len(replaced)
