"""What both distributed-optimizer front ends share: naming parameters and wrapping the
user's optimizer Horovod style.

:func:`check_named_parameters` validates ``named_parameters`` against an optimizer's
``param_groups``; :func:`wrap_optimizer` returns an instance of a new subclass of the user's
optimizer class that shares the user's optimizer state (``param_groups``, ``state``,
hooks), so ``isinstance``, ``state_dict`` and learning-rate schedulers keep working;
:class:`FrontEnd` holds the methods both wrapped classes have (local SGD's set-up,
``local_sgd``, ``skip_synchronize``).

Used by :mod:`mpicoll.torch.optimizer` (all-reduce backend) and
:mod:`mpicoll.torch.ps_optimizer` (parameter-server backend); imports neither.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from mpi4py import MPI

from ..elastic import grow
from . import local_sgd as lsgd

__all__ = ["FrontEnd", "check_named_parameters", "wrap_optimizer"]

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
    wrapped._mpicoll_user_optimizer = optimizer      # (FrontEnd.load_state_dict)
    return wrapped


class FrontEnd:
    """The methods both distributed optimizers' wrapped classes share (a mixin of
    :func:`wrap_optimizer`): local SGD (:mod:`mpicoll.torch.local_sgd`),
    :meth:`skip_synchronize` and :meth:`load_state_dict`."""

    _local_sgd: lsgd.LocalSGD | None
    #: ``False`` inside :meth:`skip_synchronize`.
    _should_synchronize = True

    def load_state_dict(self, state_dict: dict) -> None:
        """The optimizer class's own, after which the user's optimizer shares the new
        ``state`` and ``param_groups`` again (torch's replaces both objects: a learning-rate
        scheduler built on the user's optimizer would go on changing the old ones, and the
        ranks that loaded, as :func:`~mpicoll.torch.broadcast_optimizer_state` and an
        elastic restore do, would train at another rate than the others)."""
        type(self).__bases__[0].load_state_dict(self, state_dict)
        self._mpicoll_user_optimizer.__dict__.update(state=self.state,
                                                     param_groups=self.param_groups)

    def _setup_local_sgd(self, settings: tuple, params: list[torch.Tensor], refusal: str | None,
                         comm: Callable[[], MPI.Intracomm | None],
                         on_error: Callable[[], Any] = lambda: None, **driver: Any) -> None:
        """Validate the local SGD ``settings`` (:func:`~.local_sgd.check_settings`'s
        arguments, in order); when they differ from ordinary training (on this rank),
        agree on them and on the ``params``' layout with every rank of ``comm()``
        (collective) and build the driver (``driver``: :class:`~.local_sgd.LocalSGD`'s
        optional arguments).

        ``refusal``: why this front end does not support enabled settings (a
        ``ValueError`` on every rank), or ``None``. ``comm()`` returns ``None`` on ranks
        that do not train (the parameter server's separate servers just serve): no driver
        there. ``on_error`` runs before an error of the agreement is raised."""
        self._local_sgd = None
        try:
            checked = lsgd.check_settings(*settings)
        except (TypeError, ValueError) as exc:
            checked, error = None, exc
        else:
            if not checked.enabled:
                return
            error = None if refusal is None else ValueError(refusal)
        if error is None and driver.get("regroup") is not None and grow.joining():
            # a process that joined a running job, before its elastic state's first sync
            # (the running ranks are there): no collective now; the driver builds its
            # averager over the grown world at the first step, as the running ranks do
            self._local_sgd = lsgd.LocalSGD(self, params, checked, None, **driver)
            return
        group = comm()
        if group is None:
            return
        try:
            lsgd.agree_settings(group, error, checked, lsgd.layout_of(params))
        except Exception:
            on_error()
            raise
        self._local_sgd = lsgd.LocalSGD(self, params, checked, lsgd.Averager(group), **driver)

    @property
    def local_sgd(self) -> lsgd.LocalSGD | None:
        """The :class:`~mpicoll.torch.local_sgd.LocalSGD` driver (``None`` without
        ``sync_every``/``node_sync_every``, and on the parameter server's separate server
        ranks): ``local_sgd.stats()``, ``local_sgd.schedule.steps``."""
        return self._local_sgd

    def _reduces_world(self) -> bool:
        """Whether the coming step averages the gradients over every rank (all-reduce, or
        the parameter server's push and pull): always, unless local SGD makes it a local
        or node-level step."""
        return self._local_sgd is None or self._local_sgd.peek().grads == lsgd.WORLD

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize: it does not communicate
        (call :meth:`synchronize` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True
