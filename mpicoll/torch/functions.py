"""Model-level helpers: broadcast parameters, optimizer state and Python objects.

Objects travel as pickled bytes in a ``uint8`` tensor (a buffer collective, never a pickle
collective); optimizer state travels as one small pickled *structure* plus one tensor
broadcast per state tensor.

Every function takes ``process_set=`` (Horovod 0.28 has it on ``broadcast_object`` only;
here on all four, with the same rules): only the set's ranks call it (another rank gets
``ValueError`` before anything is sent), ``root_rank`` is a *global* rank of the set, and
``allgather_object`` returns the set's objects in the set's rank order.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Iterable, NamedTuple

import torch

from ..errors import RemoteError
from . import mpi_ops
from .process_sets import check_usable
from .state import rank

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def _named(params: Any) -> list[tuple[Any, torch.Tensor]]:
    if isinstance(params, dict):
        return sorted(params.items(), key=lambda kv: str(kv[0]))
    if isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
        if items and all(name is not None for name, _ in items):
            items.sort(key=lambda kv: str(kv[0]))
        return items
    raise ValueError(f"params must be a dict (state_dict), named_parameters() or a list of "
                     f"tensors, not {type(params).__name__}")


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` or ``named_parameters()`` (broadcast sorted by
            name), or a list of tensors (in the given order, the same on every rank).
        root_rank: the (global) rank whose values everyone gets.
        process_set: a registered :class:`~mpicoll.torch.ProcessSet` (default: all ranks);
            only its ranks call this.
    Raises:
        ValueError: ``params`` of another type; this rank or ``root_rank`` not in
            ``process_set``. mpicoll.MismatchError: ranks disagree on names, shapes or
            dtypes.
    """
    check_usable(process_set)
    handles = []
    for index, (name, tensor) in enumerate(_named(params)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"parameter {name or index!r} is a {type(tensor).__name__}, "
                             f"not a tensor")
        tag = f"broadcast.param.{name if name is not None else index}"
        handles.append(mpi_ops.broadcast_async_(tensor.data, root_rank, name=tag,
                                                process_set=process_set))
    for handle in handles:
        mpi_ops.synchronize(handle)


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(data, dtype=torch.uint8)


def _pickled(obj: Any) -> tuple[torch.Tensor | None, Exception | None]:
    """``(obj`` pickled into a uint8 tensor``, None)``, or ``(None, the error)``: the
    ranks still make the operation's first step, so that they stay in step."""
    try:
        return _to_bytes_tensor(obj), None
    except Exception as exc:  # noqa: BLE001  (pickle raises many kinds)
        return None, exc


def _raise_unpicklable(tag: str, error: Exception | None, failed: list[int]) -> None:
    """After the lengths' step: this rank's pickling error, or ``RemoteError`` naming the
    ranks whose objects could not be pickled (none: nothing)."""
    if error is not None:
        raise error
    if failed:
        raise RemoteError(f"{tag}: rank(s) {failed} could not pickle their object",
                          {r: "could not pickle its object" for r in failed})


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank of ``process_set``.

    Args:
        obj: any picklable object (only the root's is used).
        root_rank: a global rank (in ``process_set`` if one is given).
        name: names the two broadcasts (default ``broadcast_object``).
        process_set: a registered set (default: all ranks); only its ranks call this.
    Raises:
        ValueError: this rank or ``root_rank`` not in ``process_set``.
    """
    check_usable(process_set)
    tag = name or "broadcast_object"
    me = rank()
    payload, error = _pickled(obj) if me == root_rank else (None, None)
    length = torch.tensor([-1 if error is not None else
                           payload.numel() if payload is not None else 0], dtype=torch.int64)
    mpi_ops.broadcast_(length, root_rank, name=f"{tag}.len", process_set=process_set)
    _raise_unpicklable(tag, error, [root_rank] if int(length.item()) < 0 else [])
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    mpi_ops.broadcast_(payload, root_rank, name=f"{tag}.data", process_set=process_set)
    if me == root_rank:
        return obj
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Return every rank's ``obj`` (pickled): a list in rank order, of ``process_set``'s
    ranks in the set's order (``ps.rank()``) when one is given.

    Raises:
        ValueError: this rank is not in ``process_set``.
    """
    check_usable(process_set)
    tag = name or "allgather_object"
    payload, error = _pickled(obj)
    lengths = mpi_ops.allgather(torch.tensor([-1 if error is not None else payload.numel()],
                                             dtype=torch.int64),
                                name=f"{tag}.len", process_set=process_set)
    members = process_set.ranks if process_set is not None else range(len(lengths))
    _raise_unpicklable(tag, error, [r for r, n in zip(members, lengths.tolist()) if n < 0])
    data = mpi_ops.allgather(payload, name=f"{tag}.data", process_set=process_set)
    return [pickle.loads(part.numpy().tobytes()) for part in torch.split(data, lengths.tolist())]


class _TensorSlot(NamedTuple):
    """Placeholder for a state tensor in the broadcast structure."""

    index: int
    shape: tuple
    dtype: torch.dtype


def _map_tensors(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` (a state dict) with each tensor and :class:`_TensorSlot` replaced by
    ``leaf(it)``, dicts, lists and tuples rebuilt around them."""
    if isinstance(value, (torch.Tensor, _TensorSlot)):
        return leaf(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, leaf) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: Any = None) -> None:
    """Give every rank (of ``process_set``) ``root_rank``'s optimizer state and
    hyperparameters.

    The structure of ``optimizer.state_dict()`` is broadcast as a small object; every state
    tensor is broadcast as a tensor; other ranks then ``load_state_dict`` it (so optimizers
    whose state is still empty on some ranks work too).

    Raises:
        ValueError: this rank or ``root_rank`` not in ``process_set``.
    """
    check_usable(process_set)
    me = rank()
    tensors: list[torch.Tensor] = []

    def strip(tensor: torch.Tensor) -> _TensorSlot:       # the root: tensors out
        tensors.append(tensor.detach().cpu().contiguous())
        return _TensorSlot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype)

    def fill(slot: _TensorSlot) -> torch.Tensor:           # the others: tensors in
        tensors.append(torch.empty(slot.shape, dtype=slot.dtype))
        return tensors[-1]

    structure = _map_tensors(optimizer.state_dict(), strip) if me == root_rank else None
    structure = broadcast_object(structure, root_rank, name="broadcast_optimizer_state",
                                 process_set=process_set)
    state = structure if me == root_rank else _map_tensors(structure, fill)
    broadcast_parameters([(f"broadcast_optimizer_state.{i}", t) for i, t in enumerate(tensors)],
                         root_rank, process_set)
    if me != root_rank:
        optimizer.load_state_dict(state)

