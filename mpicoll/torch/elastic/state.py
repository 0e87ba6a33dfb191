"""Horovod's ``TorchState``: a model, an optimizer, samplers, LR schedulers and plain
objects, committed, restored and synchronised together.

Each model, optimizer, LR scheduler and :class:`ElasticSampler` given as a keyword
argument gets a handler that keeps a deep copy of its ``state_dict()`` at each commit
(a memory copy), loads it back on restore, and broadcasts rank 0's on sync; every other
keyword argument is a plain object (:class:`mpicoll.elastic.ObjectState`).

Syncs go through ``mpicoll.torch`` when ``hvd.init()`` has run, else straight over the
runtime's world (a program that only uses ``torch.distributed``, DDP say, needs no
``hvd.init()``). After a reset, :meth:`TorchState.reset` rebuilds the "mpicoll" process
groups on the new world (:func:`mpicoll.torch.distributed.reconfigure.follow_world`), so a
DDP module built once goes on with the survivors.

An FSDP2 model (DTensor parameters) and the optimizers over it get handlers that commit a
full copy of their state on every rank, and after a reset shard it again over the
survivors (:mod:`mpicoll.torch.elastic.sharded`); a ``DeviceMesh`` given as a keyword
argument is renumbered over the survivors too.
"""
from __future__ import annotations

import io
from typing import Any

import torch

from ... import collectives
from ...elastic import state as elastic_state
from ...elastic.state import ObjectState
from .. import functions
from ..distributed.reconfigure import align_ddp_buckets, end_joining, follow_world
from . import sharded
from .sampler import ElasticSampler
from .sharded import snapshot
from .world import hvd_started, rank

__all__ = ["TorchState", "snapshot", "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
           "DiLoCoStateHandler", "SchedulerStateHandler", "SamplerStateHandler",
           "ShardedModelStateHandler", "ShardedOptimizerStateHandler", "MeshStateHandler"]


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``obj`` of rank ``root_rank``, on every rank (``hvd.broadcast_object``, or over the
    world without ``hvd.init()``)."""
    if hvd_started():
        return functions.broadcast_object(obj, root_rank=root_rank)
    return elastic_state.broadcast_object(obj, root_rank)


def broadcast_tensors(tensors: dict[str, torch.Tensor], root_rank: int = 0) -> None:
    """Every rank's ``tensors`` (a ``state_dict()``) become rank ``root_rank``'s, in place
    (``hvd.broadcast_parameters``, or mpicoll's broadcast over the world)."""
    if hvd_started():
        functions.broadcast_parameters(tensors, root_rank=root_rank)
        return
    for tensor in tensors.values():
        host = tensor.detach().cpu().contiguous()
        collectives.broadcast(host.view(-1).view(torch.uint8).numpy(), root=root_rank)
        if host.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(host)


class StateHandler:
    """Commit / restore / sync for one object with ``state_dict`` / ``load_state_dict``.

    Attributes:
        value: the object. saved: its ``state_dict()`` at the last commit (a deep copy).
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = snapshot(value.state_dict())

    def save(self) -> None:
        self.saved = snapshot(self.value.state_dict())

    def restore(self) -> None:
        # a copy again: an optimizer's load_state_dict keeps the given tensors as its state
        self.value.load_state_dict(snapshot(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))

    def set_value(self, value: Any) -> None:
        """A new object under the same name (``state.model = other``): commit it."""
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: sync broadcasts rank 0's parameters and buffers."""

    def sync(self) -> None:
        broadcast_tensors(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (or ``DistributedOptimizer``)."""

    def sync(self) -> None:
        if hvd_started():
            functions.broadcast_optimizer_state(self.value, root_rank=0)
        else:
            super().sync()


class DiLoCoStateHandler(StateHandler):
    """A :class:`mpicoll.torch.DiLoCo`: sync takes rank 0's ``θ_g``, outer state and
    step, and keeps this rank's error-feedback residuals and codec state (its own)."""

    def sync(self) -> None:
        mine = self.value.state_dict()
        state = broadcast_object(mine, root_rank=0)
        state.update(residuals=mine["residuals"], codec=mine["codec"])
        self.value.load_state_dict(state)


class ShardedModelStateHandler(StateHandler):
    """An FSDP2 model: the commit is a full copy of its state on every rank (an all-gather
    of every parameter: collective); restore waits for the reset, which shards the copy
    again over the survivors (:meth:`reshard`); sync loads rank 0's full state into every
    rank's shards."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.optimizers: list[ShardedOptimizerStateHandler] = []
        self.save()

    def save(self) -> None:
        self.saved = sharded.full_model_state(self.value)

    def restore(self) -> None:
        """Nothing yet: the world has lost ranks; :meth:`reshard` puts the commit back."""

    def reshard(self) -> None:
        """After the world changed: shard the commit over the renumbered mesh, point the
        optimizers at the new parameters and give them their commit back."""
        sharded.reshard(self.value, self.saved, [h.value for h in self.optimizers])
        # the FSDP2 parameters hold the commit now; this puts back the rest (buffers,
        # parameters FSDP does not manage)
        sharded.load_model_state(self.value, self.saved)
        for handler in self.optimizers:
            handler.load(handler.saved)

    def sync(self) -> None:
        full = sharded.full_model_state(self.value)
        broadcast_tensors(full, root_rank=0)
        sharded.load_model_state(self.value, full)


class ShardedOptimizerStateHandler(StateHandler):
    """An optimizer over an FSDP2 model's parameters: its commit is the full optimizer
    state dict (collective); the model's handler restores it after resharding."""

    def __init__(self, value: Any, model: ShardedModelStateHandler) -> None:
        self.value, self.model = value, model
        model.optimizers.append(self)
        self.save()

    def save(self) -> None:
        self.saved = sharded.full_optimizer_state(self.model.value, self.value)

    def load(self, state: dict) -> None:
        """Load a full optimizer state dict into this rank's shards (local)."""
        sharded.load_optimizer_state(self.model.value, self.value, snapshot(state))

    def restore(self) -> None:
        """Nothing yet: the model's :meth:`ShardedModelStateHandler.reshard` loads it."""

    def sync(self) -> None:
        mine = sharded.full_optimizer_state(self.model.value, self.value)
        self.load(broadcast_object(mine, root_rank=0))


class MeshStateHandler(StateHandler):
    """A ``DeviceMesh``: no state; renumbered over the survivors after a reset."""

    def __init__(self, value: Any) -> None:
        self.value, self.saved = value, None

    def save(self) -> None:
        pass

    restore = sync = save

    def reset(self) -> None:
        sharded.follow_mesh(self.value)


class SchedulerStateHandler(StateHandler):
    """An LR scheduler."""


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: restore and sync also split the rest of the epoch
    among the current ranks (its ``load_state_dict`` does)."""


def _scheduler_types() -> tuple[type, ...]:
    scheduler = torch.optim.lr_scheduler
    return tuple(t for t in (getattr(scheduler, "LRScheduler", None),
                             getattr(scheduler, "_LRScheduler", None)) if t is not None)


def _handler_for(value: Any, handlers: dict[str, StateHandler]) -> StateHandler | None:
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    from ..diloco import DiLoCo  # noqa: PLC0415  (it imports the runtime: only here)

    if isinstance(value, torch.nn.Module) and sharded.is_sharded(value):
        return ShardedModelStateHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        mine = {id(p) for group in value.param_groups for p in group["params"]}
        for handler in handlers.values():
            if isinstance(handler, ShardedModelStateHandler) and any(
                    id(p) in mine for p in handler.value.parameters()):
                return ShardedOptimizerStateHandler(value, handler)
    if isinstance(value, DeviceMesh):
        return MeshStateHandler(value)
    for kind, handler in ((torch.nn.Module, ModelStateHandler),
                          (DiLoCo, DiLoCoStateHandler),
                          (torch.optim.Optimizer, OptimizerStateHandler),
                          (_scheduler_types(), SchedulerStateHandler),
                          (ElasticSampler, SamplerStateHandler)):
        if kind and isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process (Horovod's ``hvd.elastic.TorchState``).

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer`` (optional).
        **kwargs: more models, optimizers, LR schedulers, :class:`ElasticSampler`
            objects, and plain objects (``epoch=0``, ``batch=0``): each is an attribute.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value, handlers) if value is not None else None
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
                object.__setattr__(self, name, value)
        object.__setattr__(self, "_handlers", handlers)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
        values = [handler.value for handler in self._handlers.values()]
        end_joining(values)
        align_ddp_buckets(values)

    def reset(self) -> None:
        """After a reset: the "mpicoll" process groups go on over the new world; so do
        the DeviceMeshes held, and the FSDP2 models are sharded again over the
        survivors from their commit."""
        follow_world()
        for handler in self._handlers.values():
            if isinstance(handler, MeshStateHandler):
                handler.reset()
        for handler in self._handlers.values():
            if isinstance(handler, ShardedModelStateHandler):
                handler.reshard()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def serialize(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"handlers": {name: h.saved for name, h in self._handlers.items()},
                    "objects": self._saved_state}, buffer)
        return buffer.getvalue()

    def deserialize(self, payload: bytes) -> None:
        loaded = torch.load(io.BytesIO(payload), weights_only=False)
        for name, saved in loaded["handlers"].items():
            if name in self._handlers:
                self._handlers[name].saved = saved
        self._saved_state = {**self._saved_state, **loaded["objects"]}  # (as ObjectState)
