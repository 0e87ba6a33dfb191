"""Server-side optimizers: one small class per rule, state per shard, plain hyperparameters.

Each server applies the aggregated gradient ``g`` of a shard with one of:

============ ==========================================================================
``sgd``      ``w -= lr * g``
``momentum`` ``v = momentum * v + g``; ``w -= lr * v``  (PyTorch's form)
``adam``     ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``; bias-corrected
             ``w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``, ``t`` counted per
             shard (the number of updates applied to it)
``sum``      ``w = g``: the value becomes the round's aggregated gradient (``bsp`` only); the
             workers pull it and run their own optimizer
============ ==========================================================================

``weight_decay`` (sgd, momentum, adam) adds ``weight_decay * w`` to ``g`` first.
Hyperparameters are plain numbers (never pickled objects), so every rank can check that
all ranks were given the same ones and checkpoints store them as JSON.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["ShardOptimizer", "SGD", "Momentum", "Adam", "Sum", "OPTIMIZERS", "DEFAULTS",
           "make_optimizer", "check_hyperparameters"]

#: Every hyperparameter, with its default.
DEFAULTS: dict[str, float] = {"lr": 0.01, "momentum": 0.9, "beta1": 0.9, "beta2": 0.999,
                              "eps": 1e-8, "weight_decay": 0.0}


class ShardOptimizer:
    """The update rule of one shard, with its state arrays.

    Attributes:
        state: name -> flat array (same length and dtype as the shard); checkpointed.
        steps: updates applied so far (Adam's ``t``); checkpointed.
    """

    name = ""
    uses: tuple[str, ...] = ()
    state_names: tuple[str, ...] = ()

    def __init__(self, count: int, dtype: np.dtype, hyper: dict[str, float]) -> None:
        self.hyper = {k: float(hyper[k]) for k in self.uses}
        self.state = {n: np.zeros(count, dtype=dtype) for n in self.state_names}
        self.steps = 0

    def _decayed(self, param: np.ndarray, grad: np.ndarray) -> np.ndarray:
        wd = self.hyper.get("weight_decay", 0.0)
        return grad + wd * param if wd else grad

    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        """Update ``param`` in place with aggregated gradient ``grad`` (may be scratch)."""
        self.steps += 1
        self._apply(param, grad, self.state)

    def begin_update(self) -> None:
        """Start an update applied in parts with :meth:`apply_part` (counts one step)."""
        self.steps += 1

    def apply_part(self, param: np.ndarray, grad: np.ndarray, lo: int, hi: int) -> None:
        """Update elements ``[lo, hi)`` of the shard: ``param`` and ``grad`` are those
        elements; the state arrays are sliced the same way. Every rule is elementwise, so
        the parts of one update give exactly what one :meth:`apply` gives."""
        self._apply(param, grad, {k: v[lo:hi] for k, v in self.state.items()})

    def _apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        raise NotImplementedError


class SGD(ShardOptimizer):
    """Plain stochastic gradient descent."""

    name = "sgd"
    uses = ("lr", "weight_decay")

    def _apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        g = self._decayed(param, grad)
        param -= self.hyper["lr"] * g


class Momentum(ShardOptimizer):
    """SGD with (heavy-ball) momentum, as ``torch.optim.SGD(momentum=...)``."""

    name = "momentum"
    uses = ("lr", "momentum", "weight_decay")
    state_names = ("velocity",)

    def _apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        g = self._decayed(param, grad)
        v = state["velocity"]
        v *= self.hyper["momentum"]
        v += g
        param -= self.hyper["lr"] * v


class Adam(ShardOptimizer):
    """Adam with bias correction; ``t`` is this shard's update count."""

    name = "adam"
    uses = ("lr", "beta1", "beta2", "eps", "weight_decay")
    state_names = ("m", "v")

    def _apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        h = self.hyper
        g = self._decayed(param, grad)
        m, v = state["m"], state["v"]
        m *= h["beta1"]
        m += (1.0 - h["beta1"]) * g
        v *= h["beta2"]
        v += (1.0 - h["beta2"]) * (g * g)
        mhat = m / (1.0 - h["beta1"] ** self.steps)
        vhat = v / (1.0 - h["beta2"] ** self.steps)
        param -= h["lr"] * mhat / (np.sqrt(vhat) + h["eps"])


class Sum(ShardOptimizer):
    """No optimizer: the stored value becomes the aggregated gradient."""

    name = "sum"

    def _apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        if param is not grad:
            np.copyto(param, grad)


OPTIMIZERS: dict[str, type[ShardOptimizer]] = {c.name: c for c in (SGD, Momentum, Adam, Sum)}


def check_hyperparameters(optimizer: str, hyper: dict[str, Any]) -> dict[str, float]:
    """Validate ``optimizer`` and its hyperparameters; return them completed with defaults.

    Raises:
        ValueError: unknown optimizer or hyperparameter, a value that is not a number, or
            one outside its range (as torch.optim's checks: ``lr``, ``eps``, ``momentum``
            and ``weight_decay`` finite and not negative, betas in [0, 1)).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)}")
    out = dict(DEFAULTS)
    for k, v in hyper.items():
        if k not in DEFAULTS:
            raise ValueError(f"unknown hyperparameter {k!r}; known: {sorted(DEFAULTS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"hyperparameter {k}={v!r} must be a number")
        high = 1.0 if k.startswith("beta") else math.inf
        if not 0.0 <= float(v) < high:
            raise ValueError(f"hyperparameter {k}={v!r} must be in [0, {high:g})")
        out[k] = float(v)
    return out


def make_optimizer(name: str, count: int, dtype: np.dtype, hyper: dict[str, float]) -> ShardOptimizer:
    """A fresh optimizer for a shard of ``count`` elements of ``dtype``."""
    return OPTIMIZERS[name](count, dtype, hyper)
