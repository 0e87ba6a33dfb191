"""What both distributed-optimizer front ends share: naming parameters and wrapping the
user's optimizer Horovod style.

:func:`check_named_parameters` validates ``named_parameters`` against an optimizer's
``param_groups``; :func:`wrap_optimizer` returns an instance of a new subclass of the user's
optimizer class that shares the user's optimizer state (``param_groups``, ``state``,
hooks), so ``isinstance``, ``state_dict`` and learning-rate schedulers keep working.

Used by :mod:`mpicoll.torch.optimizer` (all-reduce backend) and
:mod:`mpicoll.torch.ps_optimizer` (parameter-server backend); imports neither.
"""
from __future__ import annotations

import collections
from typing import Any

import torch

__all__ = ["check_named_parameters", "wrap_optimizer"]

#: Class attributes of a mixin that are not copied into the dynamic subclass.
_NOT_COPIED = ("__dict__", "__weakref__", "__annotations__")


def check_named_parameters(named_parameters: Any, param_groups: list,
                           default_prefix: str) -> list[tuple[str, torch.Tensor]]:
    """The validated ``(name, parameter)`` pairs for an optimizer's ``param_groups``.

    Args:
        named_parameters: ``model.named_parameters()`` (or any (name, parameter) pairs),
            or ``None``.
        param_groups: the optimizer's ``param_groups``.
        default_prefix: with ``named_parameters=None`` parameters are named
            ``<default_prefix>.<group>.<index>``.
    Returns:
        The (name, parameter) pairs.
    Raises:
        ValueError: not (name, parameter) pairs, duplicate names, or a parameter of the
            optimizer left unnamed.
    """
    if named_parameters is None:
        return [(f"{default_prefix}.{i}.{j}", p) for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually produced by model.named_parameters()")
    counts = collections.Counter(name for name, _ in named)
    duplicates = sorted(n for n, c in counts.items() if c > 1)
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; "
                         f"duplicates: {duplicates}")
    named_ids = {id(p) for _, p in named}
    all_params = [p for group in param_groups for p in group["params"]]
    unnamed = [i for i, p in enumerate(all_params) if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} optimizer "
                         f"parameter(s) are not in it (positions {unnamed} in the "
                         f"optimizer's param_groups); name every parameter")
    return named


def wrap_optimizer(optimizer: torch.optim.Optimizer, *mixins: type,
                   **class_attrs: Any) -> torch.optim.Optimizer:
    """An instance of a new subclass of ``type(optimizer)`` that shares its state.

    The subclass has the name of the user's class and the methods of ``mixins`` (later
    mixins override earlier ones) plus ``class_attrs``; the instance starts with the same
    ``__dict__`` contents as ``optimizer`` (the same ``param_groups``, ``state`` and hook
    objects, not copies). The caller then sets up its own attributes.

    Args:
        optimizer: the user's optimizer.
        mixins: classes whose attributes are copied into the subclass.
        class_attrs: further class attributes.
    Returns:
        The new instance (``isinstance(result, type(optimizer))`` holds).
    """
    base = optimizer.__class__
    attrs: dict[str, Any] = {}
    for mixin in mixins:
        attrs.update({k: v for k, v in mixin.__dict__.items() if k not in _NOT_COPIED})
    attrs.update(class_attrs)
    cls = type(base.__name__, (base,), attrs)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    return wrapped
