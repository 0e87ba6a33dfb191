"""Train a PyTorch model through the parameter server (optional: needs ``torch``).

::

    from mpicoll.ps.torch import PSOptimizer
    model = Net()                                     # same architecture on every rank
    opt = PSOptimizer(model.named_parameters(), num_servers=1, consistency="bsp",
                      optimizer="adam", lr=1e-3)
    if opt.is_server:
        opt.serve()                                   # until every worker has closed
    else:
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()                                # push grads, pull new weights into model
        opt.close()

The server-side optimizer (``sgd``, ``momentum``, ``adam``) replaces ``torch.optim``;
parameters travel as numpy views of CPU tensors (no copy for contiguous CPU float tensors,
a staging copy otherwise). Collective over ``comm`` like :class:`ParameterServer`; the first
worker's initial weights are used everywhere.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from .core import ParameterServer
from .errors import PSError

__all__ = ["PSOptimizer"]


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


class PSOptimizer:
    """A torch-optimizer-shaped front end of a :class:`ParameterServer`.

    Args:
        named_parameters: ``model.named_parameters()`` (name -> ``torch.nn.Parameter``).
        **kwargs: everything :class:`ParameterServer` takes (``comm``, ``num_servers``,
            ``consistency``, ``staleness``, ``optimizer``, hyperparameters ...).
    Raises:
        PSError: a parameter's dtype has no numpy equivalent (e.g. bfloat16).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 **kwargs: Any) -> None:
        self.params = dict(named_parameters)
        values = {}
        for name, p in self.params.items():
            try:
                values[name] = _as_numpy(p)
            except TypeError as exc:
                raise PSError(f"parameter {name!r} ({p.dtype}) cannot be sent: {exc}") from None
        self.ps = ParameterServer(values, **kwargs)
        self.is_server = self.ps.is_server
        self.is_worker = self.ps.is_worker
        self._views = {}
        if self.is_worker:
            for name, p in self.params.items():
                direct = p.device.type == "cpu" and p.is_contiguous()
                self._views[name] = p.data.numpy() if direct else None
            self.pull()

    def serve(self) -> None:
        """Servers: serve until every worker has closed."""
        self.ps.serve()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        for p in self.params.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def _write_back(self, values: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                if self._views[name] is None:
                    p.copy_(torch.from_numpy(values[name]).to(p.device))

    def _out(self) -> dict[str, np.ndarray]:
        return {n: v for n, v in self._views.items() if v is not None}

    def pull(self) -> None:
        """Load the servers' current parameters into the model."""
        self._write_back(self.ps.pull(out=self._out()))

    def step(self) -> None:
        """Push the gradients (zeros where ``.grad`` is None), pull the new weights."""
        grads = {}
        for name, p in self.params.items():
            grads[name] = (np.zeros(tuple(p.shape), dtype=self._dtype(p)) if p.grad is None
                           else _as_numpy(p.grad))
        with torch.no_grad():
            values = self.ps.push_pull(grads, out=self._out())
        self._write_back(values)

    @staticmethod
    def _dtype(p: torch.Tensor) -> np.dtype:
        return torch.empty(0, dtype=p.dtype).numpy().dtype

    def save(self, path: str) -> None:
        """Checkpoint (every worker, same step); see :meth:`ParameterServer.save`."""
        self.ps.save(path)

    def stats(self) -> dict:
        """See :meth:`ParameterServer.stats`."""
        return self.ps.stats()

    def close(self) -> None:
        """Workers: finish (servers return from :meth:`serve`)."""
        self.ps.close()

    def free(self) -> None:
        """Release the communicators (after serve/close)."""
        self.ps.free()
