"""``DistributedOptimizer``: all-reduce gradients during backward, step when they are in.

The returned object is an instance of a subclass of the user's optimizer class that shares
the user's optimizer state (``param_groups``, ``state``, hooks), so ``isinstance``,
``state_dict`` and learning-rate schedulers keep working. Gradients are kept as views of
one flat buffer per device and dtype (CUDA parameters: a buffer on their device), and each
parameter gets a ``register_post_accumulate_grad_hook``.
Two ways to reduce, chosen by the engine (the same on every rank):

- *per tensor* (the engine overlaps communication with backward): after the
  ``backward_passes_per_step``-th accumulation the hook submits ``allreduce_async_`` of the
  gradient (named ``allreduce.<parameter name>``), so communication overlaps the rest of
  backward and the engine fuses and orders the requests; ``step()`` (or
  ``synchronize()``) submits zeros for parameters that got no gradient and waits;
- *bulk* (one rank, or no overlap anywhere: communicating during backward would only take
  the core from it): hooks only count accumulations, and ``step()`` submits each flat
  buffer as one request (named ``allreduce.__gradients__.<dtype>``, with a checksum of the
  parameters' names and shapes that ranks must agree on), reduced in place: one small
  negotiation and one all-reduce per dtype per step, no copies, and parameters without a
  gradient are zeros in the buffer.

Sparse gradients (``nn.Embedding(sparse=True)``), unless ``sparse_as_dense=True``, leave the
flat buffers when a parameter's first gradient is sparse and go through
:func:`~mpicoll.torch.sparse_allreduce_async` (:mod:`mpicoll.torch.sparse`). With
``sparse_as_dense=True`` they accumulate into their dense views and are reduced with the
other gradients; after the reduction such a parameter's ``.grad`` is the sparse form of the
reduced gradient (as Horovod hands it back), until ``zero_grad()`` restores the view.

A codec compressor (``Compression.int8``, ``.bf16``, ``.onebit``, ``.topk(r)``,
``.randomk(r)``) always works like bulk mode: hooks count, and ``step()`` reduces the flat
buffers with :func:`mpicoll.compression.allreduce` and per-parameter error feedback
(:mod:`mpicoll.torch.compression.gradients`; ``optimizer.error_feedback``). That state is per rank, so
it lives outside ``state_dict()``: ``compression_state_dict()`` and
``load_compression_state_dict()`` carry it through checkpoints.
"""
from __future__ import annotations

import warnings
import zlib
from typing import Any, NamedTuple

import torch

from . import mpi_ops
from .compression.gradients import CompressedGradients
from .compression.compressors import CodecCompressor, Compression
from .device.tensors import device_of
from .engine import handles
from .engine.dtypes import dtype_name
from .engine.negotiation import Meta
from .local_sgd import Averager
from .ops import Average, resolve_reduce_op
from .optim_wrapping import FrontEnd, check_named_parameters, wrap_optimizer
from .process_sets import check_usable, outside, scoped
from .sparse import SparseGradients
from .state import engine

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer class."""

    def _dist_setup(self, named_parameters: Any, compression: Any,
                    backward_passes_per_step: int, op: Any,
                    gradient_predivide_factor: float, groups: Any,
                    process_set: Any = None) -> None:
        if isinstance(backward_passes_per_step, bool) or \
                not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, not "
                             f"{backward_passes_per_step!r}")
        #: A rank outside ``process_set`` trains locally, as in Horovod: no hooks, no
        #: communication, ``step()`` uses this rank's own gradients.
        self._local_only = outside(process_set)
        if not self._local_only:
            check_usable(process_set)
        self._process_set = process_set
        self.op = resolve_reduce_op(None, op)
        if gradient_predivide_factor != 1.0 and int(self.op) != int(Average):
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        all_params = [p for group in self.param_groups for p in group["params"]]
        named = check_named_parameters(named_parameters, self.param_groups, "noname")
        by_id = {id(p): name for name, p in named}
        _check_groups(groups, all_params)
        #: Horovod's attribute: parameter -> its name (``allreduce.noname.<group>.<index>``
        #: without ``named_parameters``); scripts read it to see the generated names.
        self._parameter_names = {p: (name if named_parameters is not None
                                     else f"allreduce.{name}") for name, p in named}
        self._params = [p for p in all_params if p.requires_grad]
        names = {p: by_id[id(p)] for p in self._params}
        self._names = {p: f"allreduce.{name}" for p, name in names.items()}
        self._views: dict[torch.Tensor, torch.Tensor] = {}
        self._metas: dict[str, Meta] = {}  # bulk requests, validated once
        self._lay_out([] if self._local_only else self._params)
        self._handles: dict[torch.Tensor, tuple[int, Any]] = {}
        self._delay = {p: backward_passes_per_step for p in self._params}
        self._accumulated = 0          # parameters done accumulating (bulk mode)
        self._bulk = False
        self._synchronized = False
        self._codec_grads = None
        #: Parameters whose gradients arrive sparse (.sparse): reduced as sparse tensors,
        #: or with sparse_as_dense=True as dense ones and handed back sparse (Horovod's).
        self._sparse = None
        if self._local_only:
            self._hook_handles = []
            return
        if self._sparse_as_dense or not isinstance(compression, CodecCompressor):
            self._sparse = SparseGradients(self._params, self._views, names, process_set,
                                           densify=self._sparse_as_dense)
        if isinstance(compression, CodecCompressor):
            self._codec_grads = CompressedGradients(      # codecs encode host buffers
                compression, [f for f in self._flat if device_of(f.buffer) is None],
                self._params, names, self.op, self.gradient_predivide_factor, process_set)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                              for p in self._params]

    @property
    def error_feedback(self) -> Any:
        """The residuals of a codec compressor: an :class:`mpicoll.compression.ErrorFeedback`
        keyed by parameter name, kept across steps (``None`` for other compressors)."""
        return None if self._codec_grads is None else self._codec_grads.feedback

    def compression_state_dict(self) -> dict:
        """This rank's state of a codec compressor, for checkpoints (``{}`` for other
        compressors): the error-feedback residuals per parameter name, with
        ``momentum=`` the local momentum and the previous reduced momentum per parameter,
        and the codec's random state (random-k's step, stochastic int8's generator); as
        tensors and plain values, so ``torch.save`` / ``torch.load(weights_only=True)``
        work.

        Not part of :meth:`state_dict`: that is the wrapped optimizer's state, the same on
        every rank, which Horovod's convention saves on rank 0 and
        ``broadcast_optimizer_state`` copies from the root to every rank; residuals and
        local momenta differ per rank, and rank 0's copied to the others would be wrong.
        Save this on every rank (one file per rank); restored with
        :meth:`load_compression_state_dict` on the same rank of the same world size,
        training continues bit for bit as if uninterrupted.
        """
        return {} if self._codec_grads is None else self._codec_grads.state_dict()

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore what :meth:`compression_state_dict` returned (on this rank, local: no
        communication). Parameters the state does not mention start from zero.

        Raises:
            ValueError: a state of another codec or momentum, unknown parameter names,
                tensors that do not fit their parameters, or a non-empty state for an
                optimizer without a codec compressor.
            TypeError: ``state`` is not a dict.
        """
        if self._codec_grads is None:
            if state:
                raise ValueError("this DistributedOptimizer has no codec compressor, so it "
                                 "keeps no compression state to load")
            return
        self._codec_grads.load_state_dict(state)

    @property
    def compression_stats(self) -> list:
        """``mpicoll.compression.AllreduceStats`` of each compressed all-reduce of the
        latest step (bytes this rank sent...); empty for Horovod-style compressors."""
        return [] if self._codec_grads is None else list(self._codec_grads.stats)

    def _bulk_mode(self) -> bool:
        """Whether gradients go as whole flat buffers at ``step()`` (decided once per
        engine, identically on every rank: see :attr:`Engine.bulk_gradients`)."""
        with scoped(self._process_set):
            eng = engine()
        if self._mode_engine is not eng:
            self._mode_engine = eng
            self._bulk = self._codec_grads is not None or (
                eng.bulk_gradients and bool(self._flat)
                and self._compression in (Compression.none, Compression.fp16))
        return self._bulk

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self._delay[p] <= 0:
                raise AssertionError(
                    "gradients were computed more than backward_passes_per_step times "
                    "before optimizer.step(); increase backward_passes_per_step to "
                    "accumulate gradients locally")
            self._delay[p] -= 1
            if self._delay[p] == 0:
                if not self._reduces_world():
                    return                     # a local step: this rank's own gradient
                if self._bulk_mode() and p in self._views:
                    self._accumulated += 1
                else:
                    self._handles[p] = self._allreduce_grad_async(p)
        return hook

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        grad = p.grad
        if grad is not None and grad.is_sparse:
            if not self._sparse_as_dense:    # a codec compressor, or dense first gradient
                raise TypeError("this sparse gradient is reduced only with "
                                "DistributedOptimizer(..., sparse_as_dense=True) (a codec "
                                "compressor, or a parameter whose first gradient was dense)")
            grad = p.grad = grad.to_dense()
        return grad

    def _scaling(self) -> tuple[float, float]:
        if int(self.op) == int(Average):
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[int, Any]:
        if self._sparse is not None and self._sparse.routes(p):
            return self._sparse.submit(p, self.op), (None, None)
        if self._dense_grad(p) is None:
            p.grad = torch.zeros_like(p)
        compressed, ctx = self._compression.compress(p.grad)
        pre, post = self._scaling()
        handle = mpi_ops.allreduce_async_(compressed, name=self._names[p], op=self.op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self._process_set)
        return handle, (ctx, compressed)

    def _allreduce_flat_async(self, flat: "_FlatGradients") -> tuple[Any, Any]:
        """Submit one flat gradient buffer (bulk mode), after putting back into it any
        gradient that is not its view (``model.zero_grad()`` set it to ``None``, or the
        user assigned one): a missing gradient is reduced as zeros."""
        self._fill_flat(flat)
        compressed, ctx = self._compression.compress(flat.buffer)
        pre, post = self._scaling()
        with scoped(self._process_set):
            if compressed is not flat.buffer:
                handle = mpi_ops.submit_allreduce(compressed, compressed, flat.name, self.op,
                                                  pre, post, layout=flat.layout, waiting=True)
                return handle, (ctx, compressed)
            # The same buffer every step: validated once, then submitted straight to the
            # engine.
            meta = self._metas.get(flat.name)
            if meta is None or meta.op != int(self.op) or meta.prescale != pre \
                    or meta.postscale != post:
                meta = self._metas[flat.name] = mpi_ops.allreduce_meta(
                    flat.buffer, flat.name, self.op, pre, post, flat.layout)
            future = engine().submit(meta, flat.buffer, flat.buffer, waiting=True)
            return handles.register(future), (ctx, compressed)

    def _fill_flat(self, flat: "_FlatGradients") -> None:
        """Make every parameter's gradient its view of ``flat`` again (zeros for none)."""
        for p, view in zip(flat.params, flat.views):
            if p not in self._views:           # sparse: a zero slot until the rebuild
                view.zero_()
            elif p.grad is not view:
                grad = self._dense_grad(p)
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                p.grad = view

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce (submitting zeros for missing ones).

        On a rank outside the optimizer's process set there is nothing to reduce: the
        gradients stay this rank's own (Horovod's behaviour)."""
        if self._local_only:
            self._synchronized = True
            return
        if not self._reduces_world():
            self._synchronize_locally()
            return
        if self._codec_grads is not None:
            self._synchronize_compressed()
            self._sparse_again()
            return
        bulk = self._bulk_mode()
        pending: list[tuple[Any, tuple[int, Any]]] = []
        errors: list[BaseException] = []
        try:
            if bulk:
                for flat in self._flat:
                    pending.append((flat, self._allreduce_flat_async(flat)))
            for p in self._params:
                if p not in self._handles and not (bulk and p in self._views):
                    self._handles[p] = self._allreduce_grad_async(p)
        finally:
            pending += self._handles.items()
            self._handles.clear()
            self._reset_accumulation()
            for target, (handle, (ctx, _)) in pending:   # every handle, even after an error
                try:
                    output = mpi_ops.synchronize(handle)
                except Exception as exc:  # noqa: BLE001  (the first is raised below)
                    errors.append(exc)
                    continue
                if ctx is None and output is not None and output.is_sparse:
                    target.grad = output         # a sparse gradient, reduced
                    continue
                grad = target.buffer if isinstance(target, _FlatGradients) else target.grad
                if output is not grad:
                    grad.copy_(self._compression.decompress(output, ctx))
        if errors:
            raise errors[0]
        if self._sparse is not None and self._sparse.step_done():
            self._lay_out([p for p in self._params if p not in self._sparse.sparse])
        self._sparse_again()
        self._synchronized = True

    def _sparse_again(self) -> None:
        """With ``sparse_as_dense=True``: give the parameters whose gradients arrived sparse
        their reduced gradient as a sparse tensor again (as Horovod does, so that
        optimizers that take only sparse gradients, ``SparseAdam``, work); ``zero_grad()``
        makes the dense view their gradient again."""
        if self._sparse is None or not self._sparse.densify:
            return
        for p, sparse_dim in self._sparse.sparse.items():
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse(sparse_dim)

    def _lay_out(self, params: list) -> None:
        """Lay the flat buffers out for ``params`` (at set-up; again without the parameters
        found sparse, whose reduced gradients are copied into the new views)."""
        self._flat = _flat_gradients(params, self._names)
        self._views.clear()
        self._views.update((p, view) for flat in self._flat
                           for p, view in zip(flat.params, flat.views))
        self._metas.clear()
        self._mode_engine: Any = None  # the engine self._bulk was decided for

    def _synchronize_compressed(self) -> None:
        """Reduce the flat buffers with the codec compressor (see :mod:`.compression.gradients`)."""
        try:
            for flat in self._flat:
                self._fill_flat(flat)
            self._codec_grads.reduce()
        finally:
            self._reset_accumulation()
        self._synchronized = True

    def _reset_accumulation(self) -> None:
        """Start counting the next step's backward passes (after a synchronize)."""
        for p in self._params:
            self._delay[p] = self.backward_passes_per_step
        self._accumulated = 0

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside :meth:`skip_synchronize`), then the wrapped step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(); this reduces gradients twice",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        result = super(self.__class__, self).step(closure)
        if self._local_sgd is not None:
            self._local_sgd.after_step()
        return result

    # ------------------------------------------------------------------ local SGD
    def _synchronize_locally(self) -> None:
        """A local SGD step's ``synchronize()``: gradients stay this rank's own, or are
        averaged within the node."""
        self._reset_accumulation()
        self._local_sgd.local_gradients(self._local_sgd.peek().grads)
        self._synchronized = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refused while gradient all-reduces are in flight.

        Gradients stay views of the flat per-dtype buffers (zeroed, whatever
        ``set_to_none`` says), so fused all-reduces run in place without copies.
        """
        if self._handles or self._accumulated:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(); this is "
                                 "prohibited (the gradients are being reduced)")
        for flat in self._flat:
            flat.buffer.zero_()
        for p, view in self._views.items():
            if p.grad is not view:
                p.grad = view
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self._views and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()


class _FlatGradients(NamedTuple):
    """One dtype's gradients as views of one flat buffer."""

    buffer: torch.Tensor
    params: list             # in buffer order
    views: list              # params[i].grad is views[i]
    name: str                # the bulk request's name
    layout: str              # what ranks must agree on (count, checksum of names/shapes)


def _flat_gradients(params: list, names: dict) -> list[_FlatGradients]:
    """Give every parameter a ``.grad`` that is a view of one flat buffer per device and
    dtype (on that device: CUDA parameters get a CUDA buffer, which bulk mode submits as
    one device request).

    Parameters are laid out in reverse order (the order backward usually produces their
    gradients), existing gradients are copied in. Backward accumulates into existing
    ``.grad`` tensors in place, so the views survive. Buffers are named by dtype (and,
    for a second device of one dtype, its position), not by device, so ranks that keep
    the same model on different devices (or one on the host) submit the same names.
    """
    by_place: dict[tuple, list] = {}
    for p in reversed(params):
        if p.layout is torch.strided and p.device.type in ("cpu", "cuda"):
            by_place.setdefault((device_of(p), p.dtype), []).append(p)
    out = []
    seen: dict[torch.dtype, int] = {}
    for (_, dtype), group in by_place.items():
        # new_zeros: on the parameters' device (and of their tensor kind)
        sizes = [p.numel() for p in group]
        buf = group[0].detach().new_zeros(sum(sizes))
        views = [part.view(p.shape) for p, part in zip(group, torch.split(buf, sizes))]
        for p, view in zip(group, views):
            if p.grad is not None:
                view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            p.grad = view
        described = repr([(names[p], tuple(p.shape)) for p in group]).encode()
        index = seen[dtype] = seen.get(dtype, -1) + 1
        name = f"allreduce.__gradients__.{dtype_name(dtype)}" + (f".{index}" if index else "")
        out.append(_FlatGradients(buf, group, views, name,
                                  f"{len(group)} tensors, crc32 {zlib.crc32(described):08x}"))
    return out


def _check_groups(groups: Any, params: list) -> None:
    """Validate Horovod's ``groups`` (accepted; the engine fuses whatever is ready).

    Raises:
        ValueError: not None, an int >= 1 or lists of the optimizer's parameters.
    """
    if groups is None:
        return
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1:
            raise ValueError(f"groups must be >= 1, not {groups}")
        return
    if isinstance(groups, (list, tuple)):
        ids = {id(p) for p in params}
        if any(id(p) not in ids for group in groups for p in group):
            raise ValueError("groups names a tensor that is not an optimizer parameter")
        return
    raise ValueError(f"groups must be None, an int or a list of lists of parameters, not "
                     f"{type(groups).__name__}")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None, backend: str = "allreduce",
                         sync_every: int = 1, node_sync_every: int | None = None,
                         warmup_steps: int = 0, average_state: bool = True,
                         **ps_options: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its state is shared, not copied.
        named_parameters: ``model.named_parameters()``; names match gradients across ranks
            (default: positions in ``param_groups``). Must name every parameter, uniquely.
        compression: ``Compression.none``, ``Compression.fp16`` or any Horovod-style
            compressor (compress, all-reduce, decompress), or a codec compressor:
            ``Compression.bf16``, ``.int8``, ``.onebit``, ``.topk(ratio)``,
            ``.randomk(ratio)``, ``.from_codec(spec)`` (reduced with
            :func:`mpicoll.compression.allreduce` and error feedback per parameter,
            ``optimizer.error_feedback``; op Average or Sum; float32/float64 parameters).
        backward_passes_per_step: backward passes accumulated locally per ``step()``.
        op: ``Average`` (default), ``Sum``, ...
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size()/factor`` after.
        num_groups, groups: accepted for compatibility (validated); fusion is automatic.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors, then hand them to the optimizer as sparse tensors again (Horovod's
            behaviour: ``SparseAdam`` works); without it (the default) each is reduced by
            :func:`~mpicoll.torch.sparse_allreduce_async` and ``.grad`` stays sparse
            (:class:`~mpicoll.torch.sparse.SparseGradients`; not with a codec compressor).
        process_set: reduce gradients over this registered
            :class:`~mpicoll.torch.ProcessSet` only (default: every rank). On a rank
            outside the set the optimizer trains locally, as Horovod's: no hooks, nothing
            sent, ``step()`` uses this rank's own gradients.
        backend: ``"allreduce"`` (default: gradients all-reduced over ranks) or ``"ps"``:
            gradients averaged through a :class:`mpicoll.ps.ParameterServer` built from
            ``ps_options`` (see :func:`mpicoll.torch.ps_optimizer.distributed_optimizer`; e.g.
            ``num_servers="colocated"``, ``server_optimizer="adam"``, ``lr=...``).
        ps_options: the parameter server's options (only with ``backend="ps"``). With
            ``backend="ps"``, ``compression`` (``Compression.fp16`` or a codec compressor)
            compresses the server's pushes and pulls, with error feedback on both sides
            (docs/ps.md, *Compression*); a compressor without a codec is refused.
        sync_every: local SGD: ``H >= 1``; each rank steps on its own gradients and the
            parameters (with ``average_state`` the optimizer state too) are averaged over
            every rank after every ``H``-th step (1, the default: ordinary synchronous
            training). See :mod:`mpicoll.torch.local_sgd` and docs/torch.md, *Local SGD*.
        node_sync_every: hierarchical SGD: ``M < H``; the ranks of one node average every
            ``M`` steps (``None``: never apart from the ``H``-th steps).
        warmup_steps: ``K`` fully synchronous steps before local SGD starts (post-local
            SGD; torch's ``start_localSGD_iter``).
        average_state: average floating-point optimizer state (momentum buffers, Adam's
            moments) with the parameters (default) or keep it per rank.
    Returns:
        An instance of a subclass of ``type(optimizer)``.
    Raises:
        ValueError: duplicate or missing parameter names, bad arguments (an op other
            than Average or Sum with a codec compressor).
        TypeError: parameter-server options without ``backend="ps"``; a codec
            compressor with parameters that are not float32/float64 CPU tensors.

    With ``sync_every != 1`` or ``node_sync_every`` the constructor is collective: every
    rank must pass the same settings and parameter shapes (``ValueError`` on every rank
    otherwise; a rank's bad setting raises there and ``RemoteError`` elsewhere).
    """
    if backend == "ps":
        if (backward_passes_per_step != 1
                or op is not Average or gradient_predivide_factor != 1.0 or num_groups
                or groups is not None or sparse_as_dense or process_set is not None):
            raise ValueError("backend='ps' averages dense gradients through mpicoll.ps; "
                             "backward_passes_per_step, op, "
                             "gradient_predivide_factor, num_groups, groups, "
                             "sparse_as_dense and process_set are for backend='allreduce'")
        from .ps_optimizer import distributed_optimizer  # noqa: PLC0415  (optional layer)

        if compression is not Compression.none:  # the server compresses pushes and pulls
            ps_options["compression"] = compression
        return distributed_optimizer(optimizer, named_parameters, sync_every=sync_every,
                                     node_sync_every=node_sync_every,
                                     warmup_steps=warmup_steps, average_state=average_state,
                                     **ps_options)
    if backend != "allreduce":
        raise ValueError(f"backend must be 'allreduce' or 'ps', not {backend!r}")
    if ps_options:
        raise TypeError(f"unexpected keyword arguments {sorted(ps_options)} "
                        f"(parameter-server options need backend='ps')")
    dist = wrap_optimizer(optimizer, FrontEnd, _DistributedOptimizer)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, not {num_groups!r}")
    dist._sparse_as_dense = bool(sparse_as_dense)
    dist._dist_setup(named_parameters, compression, backward_passes_per_step, op,
                     gradient_predivide_factor, groups, process_set)
    dist._setup_local_sgd(
        (sync_every, node_sync_every, warmup_steps, average_state), dist._params,
        "sync_every/node_sync_every average over every rank; they are not supported with "
        "process_set" if dist._local_only or dist._process_set is not None else None,
        lambda: engine().side_comm(),
        # a new world (hvd.elastic) has a new engine: the averager moves to its side comm
        regroup=lambda: Averager(engine().side_comm()))
    return dist
