"""Train a PyTorch model through the parameter server (optional: needs ``torch``).

Two front ends over one :class:`~mpicoll.ps.ParameterServer`:

:func:`distributed_optimizer` — what ``mpicoll.torch.DistributedOptimizer(optimizer,
named_parameters=..., backend="ps", **ps_options)`` returns: the user's optimizer (an
instance of a subclass of its class, sharing its state, so ``isinstance``, ``state_dict``
and schedulers keep working) whose ``step()`` goes through the parameter server:

- by default (``server_optimizer="sum"``, ``bsp``) ``step()`` pushes the ``.grad``\\ s,
  pulls back their average over the workers into the ``.grad``\\ s in place, then runs the
  wrapped optimizer's own update on every worker (all workers keep identical weights; the
  first worker's initial weights are broadcast to the others at construction);
- with a server-side optimizer (``server_optimizer="sgd"|"momentum"|"adam"``: the
  :class:`ParameterServer`'s ``optimizer`` argument, renamed because ``optimizer`` is the
  wrapped torch optimizer; any consistency) the servers update the weights and ``step()``
  pulls them into the parameters; the wrapped optimizer's update rule is then *not* used
  (give its hyperparameters to the servers).

::

    import mpicoll.torch as mt
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  backend="ps", num_servers="colocated")
    for x, y in loader:                 # every rank trains (co-located layout)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    opt.close()

With separate servers (``num_servers=k``) ranks ``0..k-1`` are servers: ``if opt.is_server:
opt.serve()`` instead of the loop.

:class:`PSOptimizer` — a torch-optimizer-shaped front end with the server-side optimizer
only (no wrapped torch optimizer)::

    from .ps_optimizer import PSOptimizer
    opt = PSOptimizer(model.named_parameters(), num_servers=1, optimizer="adam", lr=1e-3)
    if opt.is_server:
        opt.serve()
    else:
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()

Parameters and gradients travel as numpy views of CPU tensors (no copy for contiguous CPU
tensors, a staging copy otherwise). Collective over ``comm`` like :class:`ParameterServer`.

Both take ``compression=``: a codec name (``"int8"``, ``"onebit"``, ``"topk:0.01"`` ...), a
:class:`mpicoll.compression.Codec`, or a torch compressor (``hvd.Compression.int8``,
``.topk(0.01)`` ...: its ``codec`` attribute is used, and its ``feedback`` flag becomes the
server's ``feedback=``; ``Compression.none`` means none, ``Compression.fp16`` ``"fp16"``);
see :func:`codec_option` and :func:`feedback_option`. Compressors with a local momentum or
a warm-up are refused (on every rank): those are ``DistributedOptimizer``'s all-reduce path.

Checkpoints: :meth:`~_PSTraining.save` is :meth:`ParameterServer.save`, which writes each
rank's compression state (push residuals, pull replicas, the servers' residuals);
``restore=path`` among the options of a new optimizer of the same layout, codec and
``feedback`` brings it back (with ``server_optimizer="sum"`` save the model and the torch
optimizer's ``state_dict()`` as usual too), and training continues bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
import torch

from .optim_wrapping import FrontEnd, check_named_parameters, wrap_optimizer
from ..ps.core import ParameterServer
from ..ps.errors import PSError

__all__ = ["PSOptimizer", "distributed_optimizer", "codec_option", "feedback_option"]


def codec_option(compression: Any) -> Any:
    """The :class:`ParameterServer`'s ``compression`` for a torch-side value.

    ``None``, names and codecs pass unchanged; a compressor (class or instance) gives its
    ``codec`` attribute, Horovod's ``Compression.none`` ``None`` and ``Compression.fp16``
    ``"fp16"``. A compressor without a codec becomes a name the parameter server refuses
    (``ValueError`` on every rank, at construction), never an error on this rank alone.
    """
    if compression is None or isinstance(compression, str) or \
            not hasattr(compression, "compress"):
        return compression
    codec = getattr(compression, "codec", None)
    if codec is not None:
        # refused on every rank by the server's check of the codec, not here alone
        if getattr(compression, "momentum", 0.0):
            return f"<{codec.name} with momentum: the parameter server compresses " \
                   f"gradients, not a local momentum>"
        if getattr(compression, "warmup", 0):
            return f"<{codec.name} with a warm-up of {compression.warmup} steps: the " \
                   f"parameter server compresses from the first step (a warm-up is " \
                   f"DistributedOptimizer's, backend='allreduce')>"
        return codec
    name = compression.__name__ if isinstance(compression, type) else \
        type(compression).__name__
    if name == "NoneCompressor":
        return None
    if name == "FP16Compressor":
        return "fp16"
    return f"<{name}: a compressor without a codec>"


def feedback_option(compression: Any, feedback: Any = None) -> Any:
    """The :class:`ParameterServer`'s ``feedback`` for a torch-side ``compression`` and the
    ``feedback`` option given beside it (``None``: not given).

    A lossy codec compressor's own flag (``Compression.from_codec("int8",
    feedback=False)``) is used when no ``feedback`` is given; given both, they must agree.
    Anything else returns ``feedback`` (``True`` when not given). A disagreement becomes a
    value the parameter server refuses (``ValueError`` on every rank, at construction),
    never an error on this rank alone.
    """
    lossy = getattr(getattr(compression, "codec", None), "lossy", False)
    own = getattr(compression, "feedback", None) if lossy and \
        hasattr(compression, "compress") else None
    if not isinstance(own, bool):
        return True if feedback is None else feedback
    if feedback is None or feedback is own:
        return own
    return f"<{compression!r} beside feedback={feedback!r}: give the compressor's " \
           f"feedback flag or an equal feedback= option, not both different>"


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _direct(t: torch.Tensor) -> bool:
    """Whether ``t.numpy()`` is a view we can send from and receive into."""
    return t.device.type == "cpu" and t.is_contiguous()


class _PSTraining:
    """The parameter-server plumbing shared by both front ends (a mixin).

    ``self._named`` (name -> parameter) and ``self.ps`` are set by :meth:`_ps_setup`.
    """

    _named: dict[str, torch.nn.Parameter]
    ps: ParameterServer

    def _ps_setup(self, named: dict[str, torch.nn.Parameter], local_update: bool,
                  ps_options: dict[str, Any]) -> None:
        values = {}
        for name, p in named.items():
            try:
                values[name] = _as_numpy(p)
            except TypeError as exc:
                raise PSError(f"parameter {name!r} ({p.dtype}) cannot be sent: {exc}") from None
        self._named = named
        self._local_update = local_update
        if "compression" in ps_options:
            compression = ps_options["compression"]
            ps_options = dict(ps_options, compression=codec_option(compression),
                              feedback=feedback_option(compression,
                                                       ps_options.get("feedback")))
        self.ps = ParameterServer(values, **ps_options)
        self._views = {n: p.data.numpy() if _direct(p) else None for n, p in named.items()}
        if not self.ps.is_worker:
            return
        if local_update:   # the servers hold gradients: give every worker the same weights
            with torch.no_grad():
                for name, p in sorted(named.items()):
                    buf = self._views[name] if self._views[name] is not None else _as_numpy(p)
                    if buf.size:
                        self.ps.worker_comm.Bcast(buf.reshape(-1).view(np.uint8), root=0)
                    if self._views[name] is None:
                        p.copy_(torch.from_numpy(buf).to(p.device))
        else:
            self.pull()

    @property
    def is_server(self) -> bool:
        """This rank is a (separate) server: call :meth:`serve`."""
        return self.ps.is_server

    @property
    def is_worker(self) -> bool:
        """This rank trains (every rank in the co-located layout)."""
        return self.ps.is_worker

    def serve(self) -> None:
        """Servers: serve until every worker has closed."""
        self.ps.serve()

    def pull(self) -> None:
        """Load the servers' current parameters into the model (server-side optimizer)."""
        if self._local_update:
            raise PSError("pull(): with server_optimizer='sum' the servers hold gradients, not "
                          "weights; every worker keeps the weights itself")
        out = {n: v for n, v in self._views.items() if v is not None}
        self._copy_back(self.ps.pull(out=out), out)

    def _copy_back(self, values: dict[str, np.ndarray], received: dict[str, Any],
                   grads: bool | None = None) -> None:
        """Copy ``values`` into the tensors (``.grad`` with ``server_optimizer='sum'``, else the
        parameters; ``grads`` says which when given) that were not received in place."""
        grads = self._local_update if grads is None else grads
        with torch.no_grad():
            for name, p in self._named.items():
                if name not in received:
                    target = p.grad if grads else p
                    target.copy_(torch.from_numpy(values[name]).to(target.device))

    def _grads(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(gradients to push, arrays to pull into): numpy views of the ``.grad``\\ s where
        possible. Parameters without a gradient push zeros (and get a zero ``.grad`` when
        the pulled value is a gradient)."""
        grads, out = {}, {}
        for name, p in self._named.items():
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
                if self._local_update:
                    p.grad = g
            grads[name] = g.numpy() if _direct(g) else _as_numpy(g)
            if self._local_update and _direct(g):
                out[name] = grads[name]        # averaged in place (see ps_step)
        if not self._local_update:
            out = {n: v for n, v in self._views.items() if v is not None}
        return grads, out

    def ps_step(self) -> None:
        """One push_pull: the averaged gradients into ``.grad`` (``server_optimizer='sum'``) or
        the servers' new weights into the parameters."""
        grads, out = self._grads()
        with torch.no_grad():
            values = self.ps.push_pull(grads, out=out)
        self._copy_back(values, out)

    def save(self, path: str) -> None:
        """Checkpoint the servers (every worker, same step); see :meth:`ParameterServer.save`,
        which writes every rank's compression state too (``restore=path`` on a new optimizer
        of the same layout, codec and feedback continues bit for bit). With
        ``server_optimizer='sum'`` the weights and the torch optimizer's state live on the
        workers: save those with ``torch.save`` as usual."""
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


class PSOptimizer(_PSTraining):
    """A torch-optimizer-shaped front end of a :class:`ParameterServer` whose servers run
    the optimizer.

    Args:
        named_parameters: ``model.named_parameters()`` (name -> ``torch.nn.Parameter``).
        **kwargs: everything :class:`ParameterServer` takes (``comm``, ``num_servers``,
            ``consistency``, ``staleness``, ``optimizer``, ``compression`` (see
            :func:`codec_option`), hyperparameters ...).
    Raises:
        PSError: a parameter's dtype has no numpy equivalent (e.g. bfloat16).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 **kwargs: Any) -> None:
        self.params = dict(named_parameters)
        self._ps_setup(self.params, local_update=False, ps_options=kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        for p in self.params.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self) -> None:
        """Push the gradients (zeros where ``.grad`` is None), pull the new weights."""
        self.ps_step()


class _PSDistributedOptimizer(_PSTraining):
    """Methods of the dynamic subclass of the user's optimizer class (with _PSTraining's and
    FrontEnd's)."""

    _ps_base: type

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Re-evaluate ``closure`` (if given), push the gradients and pull (unless inside
        :meth:`skip_synchronize`); then, with ``server_optimizer='sum'``, run the wrapped
        optimizer's update on the averaged gradients.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        if self._local_update:
            self._ps_base.step(self)
        if self._local_sgd is not None:
            self._local_sgd.after_step()
        return loss

    def synchronize(self) -> None:
        """Horovod's name for the communication part of ``step()``: push and pull now
        (with local SGD: only on the steps that average gradients over every worker;
        node-level steps average them within the node, local steps keep them).
        Follow it with ``with opt.skip_synchronize(): opt.step()``."""
        if self._reduces_world():
            self.ps_step()
        else:
            self._local_sgd.local_gradients(self._local_sgd.peek().grads)

    def _push_parameters(self) -> None:
        """Local SGD's average over every worker: push the parameters through the servers
        (``server_optimizer='sum'`` averages what the workers push) and pull the average
        into them; every worker pulls the same bits."""
        out = {n: v for n, v in self._views.items() if v is not None}
        values = {n: out[n] if n in out else _as_numpy(p) for n, p in self._named.items()}
        with torch.no_grad():
            result = self.ps.push_pull(values, out=out)
        self._copy_back(result, out, grads=False)


def distributed_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                          server_optimizer: str = "sum", sync_every: int = 1,
                          node_sync_every: int | None = None, warmup_steps: int = 0,
                          average_state: bool = True,
                          **ps_options: Any) -> torch.optim.Optimizer:
    """``DistributedOptimizer(optimizer, named_parameters, backend="ps", **ps_options)``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over CPU parameters; its state is shared.
        named_parameters: ``model.named_parameters()`` (default: ``param.<group>.<index>``
            names from ``param_groups``); must name every parameter, uniquely.
        server_optimizer: the :class:`ParameterServer`'s ``optimizer``: ``"sum"`` (default:
            servers average the gradients, the wrapped optimizer updates on every worker)
            or ``"sgd"``/``"momentum"``/``"adam"`` (servers update the weights; the wrapped
            optimizer's rule is not used).
        **ps_options: the other :class:`ParameterServer` arguments (``comm``,
            ``num_servers`` (1, k or ``"colocated"``), ``consistency``, hyperparameters,
            ``split_bytes``, ``compression`` (a codec name, a codec or a torch
            compressor, see :func:`codec_option`; a codec compressor's ``feedback``
            flag is the server's ``feedback``, see :func:`feedback_option`),
            ``restore`` ...). With ``"sum"``, ``average``
            defaults to True (gradients averaged over the workers, as with
            ``op=Average``).
        sync_every, node_sync_every, warmup_steps, average_state: local / hierarchical
            SGD as in :func:`mpicoll.torch.DistributedOptimizer` (server_optimizer
            ``"sum"`` only, uncompressed): steps that average the gradients over every
            worker push and pull them through the servers, world averages of the
            parameters push the parameters and pull their average, node-level averages
            and the optimizer state's averages use an all-reduce among the workers.
    Returns:
        An instance of a subclass of ``type(optimizer)`` with ``step()``, ``synchronize()``,
        ``skip_synchronize()``, ``is_server``/``serve()``, ``close()``, ``save()``,
        ``stats()``, ``free()`` and ``ps`` (the :class:`ParameterServer`).
    Raises:
        ValueError: bad or missing parameter names, bad options (on every rank for
            options checked collectively).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    pairs = check_named_parameters(named_parameters, optimizer.param_groups, "param")
    by_id = {id(p) for p in params}
    named = {n: p for n, p in pairs if id(p) in by_id}
    options = dict(ps_options, optimizer=server_optimizer)
    local = server_optimizer == "sum"
    if local:
        options.setdefault("average", True)
    dist = wrap_optimizer(optimizer, _PSTraining, FrontEnd, _PSDistributedOptimizer,
                          _ps_base=optimizer.__class__)
    dist._ps_setup(named, local_update=local, ps_options=options)
    refusal = None
    if not local:
        refusal = (f"sync_every/node_sync_every need server_optimizer='sum': with "
                   f"server_optimizer={server_optimizer!r} the servers own the weights and "
                   f"workers hold no model of their own to step locally")
    elif ps_options.get("compression") not in (None, "none"):
        refusal = ("sync_every/node_sync_every with backend='ps' push parameters as well as "
                   "gradients; a codec's error feedback would mix the two: use no compression")
    dist._setup_local_sgd(
        (sync_every, node_sync_every, warmup_steps, average_state), list(named.values()), refusal,
        # a separate server serves; the workers raise and close it
        lambda: dist.ps.worker_comm if dist.ps.is_worker else None,
        # every worker gets here: release the servers
        on_error=lambda: (dist.ps.close(), dist.ps.free()),
        average_world_params=dist._push_parameters)
    return dist
