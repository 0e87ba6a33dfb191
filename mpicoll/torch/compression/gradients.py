"""DistributedOptimizer's gradient reduction with a codec compressor (``Compression.int8``,
``.bf16``, ``.onebit``, ``.topk(r)``, ``.randomk(r)``).

Those payloads cannot be summed as tensors, so they do not go through the engine's fused
all-reduce. At ``step()`` (or ``synchronize()``) the optimizer's flat gradient buffers
(one per dtype, gradients as views; see :mod:`mpicoll.torch.optimizer`) are cut into
*runs* of consecutive parameters of at most ``MPICOLL_FUSION_THRESHOLD`` bytes
(:func:`~mpicoll.torch.engine.fusion.plan_runs`; ``0``: one run per parameter), and each run is
reduced in place by one :func:`mpicoll.compression.allreduce`.

Error feedback belongs to the optimizer: :attr:`CompressedGradients.feedback` is an
:class:`mpicoll.compression.ErrorFeedback` keyed by parameter name, whose residuals
survive from step to step. A run of several parameters is compressed as one vector, so
its residual is one array; each parameter's residual in the store is its slice (a view)
of that array. Residuals put into the store by hand (or stored for another run layout)
are copied into the run's array before the next reduction.

Momentum (``CodecCompressor.momentum = beta > 0``, e.g.
``Compression.onebit.with_momentum(0.9)``): each rank keeps a local momentum
``m = beta m + g`` per element of the flat buffers and the runs compress ``m`` (error
feedback then keeps what was dropped of ``m``); after the reduction to ``M`` the gradient
handed to the optimizer is ``M - beta M_prev``, ``M_prev`` being the previous step's
reduced momentum (the same bits on every rank). Uncompressed this equals the reduced
gradient; with ``SGD(momentum=beta)`` the optimizer's buffer becomes ``M``. Compressing
gradients and applying momentum after made onebit + error feedback diverge on
``examples/train.py``: the optimizer's momentum integrates the error-feedback residual
(parameters end ``lr e / (1 - beta)`` away from the error-free trajectory instead of
``lr e``), see docs/compression.md.

Warm-up (``CodecCompressor.warmup = w > 0``, e.g.
``Compression.onebit.with_momentum(0.9).with_warmup(46)``): the first ``w`` reductions
(optimizer steps, however many backward passes each accumulates) send each flat buffer
through the engine's all-reduce as ``Compression.none`` does (the same request name, op
and scaling, so the same bits); with momentum they also advance the local momentum
``m = beta m + g`` and the reduced momentum ``M = beta M + (reduced gradient)``, so the
first compressed step continues the momentum an ``SGD(momentum=beta)`` holds (the same
bits as its buffer) instead of restarting it. Error feedback starts at the first
compressed step; the step count is in :meth:`CompressedGradients.state_dict`.

Order and agreement: every reduction starts with one tiny all-reduce through the engine
(``allreduce.__compressed__``, whose layout names the codec, the op and the parameters), so
ranks with different models or codecs get ``MismatchError`` on every rank, and a rank
that called ``hvd.join()`` (it would never take part in the compressed all-reduce) makes
the others raise ``CollectiveError`` instead of hanging. Its layout also says whether the
step is a warm-up step, so ranks whose step counts disagree (a checkpoint restored on
some ranks only) raise ``MismatchError`` instead of sending different messages. The
compressed all-reduces run on the calling thread, on a communicator of the engine's ranks
made for them on first use (never the engine's own, which the engine thread uses).
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import numpy as np
import torch

from ... import compression as codecs
from ...buffers import IN_PLACE
from ...compression.arguments import agreed
from ...elastic import grow
from ...runtime import world as runtime_world
from ...context import get_context
from .agreement import check_presence
from .compressors import CodecCompressor
from ..engine.dtypes import numpy_view
from ..engine.fusion import plan_runs
from ..mpi_ops import allreduce_meta
from ..ops import Average, ReduceOp, Sum
from ..process_sets import scoped
from ..state import engine

__all__ = ["CompressedGradients", "PRESENCE_NAME"]

#: Name of the engine all-reduce that starts every compressed reduction.
PRESENCE_NAME = "allreduce.__compressed__"

class _Slot(NamedTuple):
    """One parameter in a run: its name and its element range within the run."""

    name: str
    lo: int
    hi: int


class _Run(NamedTuple):
    """Consecutive parameters of one flat buffer reduced by one compressed all-reduce."""

    key: str                 # the run's residual key: "<buffer name>[lo:hi]"
    buffer: torch.Tensor     # the run's slice of the flat gradient buffer
    slots: tuple             # _Slot per parameter
    flat: str                # the flat buffer's name
    lo: int                  # the run's element range in the flat buffer
    hi: int


class CompressedGradients:
    """Reduce DistributedOptimizer's flat gradient buffers with a codec compressor.

    Args:
        compressor: the codec compressor.
        flats: the optimizer's flat gradient buffers (``buffer``, ``params``, ``views``,
            ``name``, ``layout``), params in buffer order.
        names: parameter -> name (the residual keys).
        op: ``Average`` or ``Sum``. predivide: Average's ``gradient_predivide_factor``.
        process_set: the optimizer's process set (``None``: global).
    Raises:
        ValueError: an op other than Average and Sum.
        TypeError: a parameter the codec cannot encode (not float32/float64), or one
            outside the flat buffers (not a CPU tensor).
    """

    def __init__(self, compressor: CodecCompressor, flats: list, params: list,
                 names: dict, op: ReduceOp, predivide: float, process_set: Any) -> None:
        if int(op) not in (int(Average), int(Sum)):
            raise ValueError(f"compression={compressor.name!r} reduces gradients with "
                             f"op=Average or op=Sum, not {op!r}")
        in_flats = {id(p) for flat in flats for p in flat.params}
        for p in params:
            compressor.check_dtype(p.dtype, f"parameter {names[p]!r}")
            if id(p) not in in_flats:
                raise TypeError(f"parameter {names[p]!r} is not a dense CPU tensor; "
                                f"compression={compressor.name!r} needs dense CPU tensors")
        self.compressor = compressor
        #: Reductions done so far (warm-up ones included); checkpointed.
        self.steps = 0
        #: Residuals of lossy compression, one per parameter name (kept across steps).
        self.feedback = codecs.ErrorFeedback()
        #: ``mpicoll.compression.AllreduceStats`` of each run of the latest reduction.
        self.stats: list[codecs.AllreduceStats] = []
        self._flats = flats
        self._names = names
        self._process_set = process_set
        average = int(op) == int(Average)
        self._op = int(op)
        self._opname = "average" if average and predivide == 1.0 else "sum"
        self._pre = 1.0 / predivide if average else 1.0
        self._post = predivide if average and predivide != 1.0 else 1.0
        self._runs: dict[int, list[_Run]] = {}           # fusion threshold -> runs
        self._fused: dict[str, np.ndarray] = {}         # run key -> its residual
        self._stores: dict[str, codecs.ErrorFeedback] = {}
        self._views: dict[str, tuple[str, np.ndarray]] = {}  # name -> (run key, view)
        described = repr([(names[p], tuple(p.shape), str(p.dtype)) for flat in flats
                          for p in flat.params]).encode()
        self._beta = float(getattr(compressor, "momentum", 0.0))
        #: Local momentum and previous reduced momentum per flat buffer (momentum > 0).
        self._momentum: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        #: The world generation the shared state is rank 0's of (-1 in a process a growth
        #: started, until its first reduction: see :meth:`_follow_world`).
        self._generation = -1 if grow.joining() else runtime_world.generation()
        self._layout = (f"{compressor.name} {self._opname} feedback={compressor.feedback}, "
                        f"momentum={self._beta!r}, warmup={compressor.warmup}, "
                        f"crc32 {zlib.crc32(described):08x}")

    # ---------------------------------------------------------------------- reduction
    def reduce(self) -> None:
        """All-reduce every flat buffer in place (Average or Sum of the ranks' gradients
        plus their residuals, as the codec delivers it; the same bits on every rank).

        Raises:
            mpicoll.MismatchError: ranks disagree on the codec, op or parameters, or on
                whether this step is a warm-up step.
            CollectiveError: a rank has joined (``hvd.join()``), or the engine stopped.
            TypeError, ValueError, mpicoll.RemoteError: a residual that does not fit its
                parameter (on the rank that has it; the others raise ``RemoteError``).
        """
        with scoped(self._process_set):
            if runtime_world.generation() != self._generation:
                self._follow_world(engine().side_comm())
            warming = self.steps < self.compressor.warmup
            eng = check_presence(PRESENCE_NAME,
                                 f"{self._layout}, {'warm-up' if warming else 'compressed'}",
                                 f"DistributedOptimizer(compression={self.compressor.name!r})")
        if warming:
            self._reduce_uncompressed(eng)
        else:
            self._reduce_compressed(eng)
        self.steps += 1

    def _follow_world(self, comm: Any) -> None:
        """The first reduction after ``hvd.elastic`` changed the world, or in a process a
        growth started (collective over ``comm``, the engine's ranks): rank 0's step count,
        codec state and reduced momentum on every rank, which must hold the same bits (a
        new process started them at zero: its warm-up step count and ``M_prev`` differed).
        Residuals and the local momentum stay each rank's own."""
        shared = comm.bcast({"steps": self.steps,
                             "codec": self.compressor.codec.state_dict(),
                             "reduced": {flat: arrays[1]
                                         for flat, arrays in self._momentum.items()}},
                            root=0)
        self.steps = shared["steps"]
        self.compressor.codec.load_state_dict(shared["codec"])
        for flat, reduced in shared["reduced"].items():
            self._momentum_arrays(flat)[1][...] = reduced
        self._generation = runtime_world.generation()

    def _reduce_uncompressed(self, eng: Any) -> None:
        """A warm-up step: each flat buffer through ``eng``'s all-reduce as
        ``Compression.none`` submits it; with momentum, the local and reduced momentum
        advanced as a lossless compression would (see the module's docstring)."""
        self.stats = []
        pre, post = self._pre, self._post
        if self._beta:
            for flat in self._flats:
                local, _ = self._momentum_arrays(flat.name)
                array = numpy_view(flat.buffer)
                np.multiply(local, self._beta, out=local)      # m = beta m + pre g
                np.add(local, array if pre == 1.0 else array * pre, out=local)
        futures = []
        for flat in self._flats:
            meta = allreduce_meta(flat.buffer, flat.name, ReduceOp(self._op), pre, post,
                                  flat.layout)
            futures.append(eng.submit(meta, flat.buffer, flat.buffer, waiting=True))
        for future in futures:                # every future, even after an error
            eng.wait(future)
        errors = [future.error for future in futures if future.error is not None]
        if errors:
            raise errors[0]
        if self._beta:                                        # M = beta M + reduced g
            for flat in self._flats:
                _, previous = self._momentum_arrays(flat.name)
                reduced = numpy_view(flat.buffer)
                if post != 1.0:                               # in the units of M
                    reduced = reduced * (eng.size / post)
                np.multiply(previous, self._beta, out=previous)
                np.add(previous, reduced, out=previous)

    def _reduce_compressed(self, eng: Any) -> None:
        """A compressed step: every run through :func:`mpicoll.compression.allreduce`."""
        comm = eng.side_comm()
        codec = self.compressor.codec
        runs = self._plan(eng.settings.fusion_threshold)

        def validate() -> tuple[list, dict]:
            arrays = [numpy_view(run.buffer) for run in runs]
            return ([(a, *self._feedback_for(run, a)) for run, a in zip(runs, arrays)],
                    {"count": sum(a.size for a in arrays), "algorithm": codec.name})

        # one agreement for the whole step (the runs' own checks are then skipped)
        prepared = agreed(get_context(comm), True, "DistributedOptimizer compression",
                          validate)
        self.stats = []
        for run, (array, feedback, key) in zip(runs, prepared, strict=True):
            if self._pre != 1.0:
                np.multiply(array, self._pre, out=array)
            if self._beta:     # the run's views of m and M_prev (zeros on first use)
                local, previous = self._momentum_arrays(run.flat)
                local, previous = local[run.lo:run.hi], previous[run.lo:run.hi]
                np.multiply(local, self._beta, out=local)      # m = beta m + g
                np.add(local, array, out=local)
                np.copyto(array, local)
            codecs.allreduce(IN_PLACE, array, op=self._opname, comm=comm, compression=codec,
                             feedback=feedback, key=key, check=False)
            self.stats.append(codecs.last_stats())
            if self._beta:                                     # g = M - beta M_prev
                reduced = array.copy()
                np.multiply(previous, self._beta, out=previous)
                np.subtract(array, previous, out=array)
                np.copyto(previous, reduced)
            if self._post != 1.0:
                np.multiply(array, self._post / comm.Get_size(), out=array)

    # ----------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """This rank's compression state, as tensors and plain values (``torch.save``
        writes it, ``torch.load(weights_only=True)`` reads it back).

        Returns:
            ``{"codec", "momentum", "residuals", "local_momentum", "reduced_momentum",
            "codec_state", "steps"}``: the codec's name and momentum (checked on load);
            copies of the residuals per parameter name; with momentum, each parameter's
            slice of the local momentum ``m`` and of the previous reduced momentum
            ``M_prev``; the codec's :meth:`~mpicoll.compression.Codec.state_dict`; the
            number of reductions done (which decides where a warm-up ends).
        """
        residuals = {name: torch.from_numpy(self.feedback.residual(name).copy())
                     for name in self.feedback.keys()}
        local: dict[str, torch.Tensor] = {}
        reduced: dict[str, torch.Tensor] = {}
        for name, (flat, lo, hi) in self._positions().items():
            for part, array in zip((local, reduced), self._momentum.get(flat, ())):
                part[name] = torch.from_numpy(array[lo:hi].copy())
        return {"codec": self.compressor.name, "momentum": self._beta,
                "residuals": residuals, "local_momentum": local, "reduced_momentum": reduced,
                "codec_state": self.compressor.codec.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Replace this rank's compression state with ``state`` (from :meth:`state_dict`);
        parameters it does not mention start from zero, and a state without ``"steps"``
        (saved before warm-ups existed) counts as step 0. Checked first: on error nothing
        changes.

        Raises:
            ValueError: another codec or momentum, an unknown parameter name, a tensor
                whose size or dtype does not fit its parameter, a step count that is not
                an int >= 0.
            TypeError: not a dict of the expected form.
        """
        if not isinstance(state, dict):
            raise TypeError(f"a compression state must be a dict, not {type(state).__name__}")
        missing = {"codec", "momentum", "residuals", "local_momentum", "reduced_momentum",
                   "codec_state"} - set(state)
        if missing:
            raise ValueError(f"a compression state needs the keys {sorted(missing)}")
        saved = (state["codec"], float(state["momentum"]))
        if saved != (self.compressor.name, self._beta):
            raise ValueError(f"the compression state was saved with compression="
                             f"{saved[0]!r}, momentum {saved[1]:g}; this optimizer has "
                             f"{self.compressor.name!r}, momentum {self._beta:g}")
        steps = state.get("steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the compression state's steps must be an int >= 0, not "
                             f"{steps!r}")
        positions = self._positions()
        arrays = {part: {name: self._array(part, name, value, positions)
                         for name, value in state[part].items()}
                  for part in ("residuals", "local_momentum", "reduced_momentum")}
        if not self._beta and (arrays["local_momentum"] or arrays["reduced_momentum"]):
            raise ValueError("the compression state holds momentum, but this optimizer's "
                             "compressor has none")
        self.compressor.codec.load_state_dict(state["codec_state"])  # checked there
        self.steps = steps
        self.feedback.reset()
        for name, array in arrays["residuals"].items():
            self.feedback.store(name, array)
        self._momentum = {}
        for name, (flat, lo, hi) in positions.items():
            for target, part in zip(self._momentum_arrays(flat) if self._beta else (),
                                    ("local_momentum", "reduced_momentum")):
                if name in arrays[part]:
                    target[lo:hi] = arrays[part][name]

    def _array(self, part: str, name: Any, value: Any, positions: dict) -> np.ndarray:
        """``value`` (a tensor of ``state[part][name]``) as a fresh flat numpy array, checked
        against parameter ``name``."""
        if name not in positions:
            raise ValueError(f"the compression state's {part} name a parameter this "
                             f"optimizer does not have: {name!r}")
        flat, lo, hi = positions[name]
        dtype = numpy_view(next(f for f in self._flats if f.name == flat).buffer).dtype
        if not isinstance(value, torch.Tensor) or value.numel() != hi - lo \
                or numpy_view(value.detach().contiguous()).dtype != dtype:
            shown = (f"{value.numel()} {value.dtype}" if isinstance(value, torch.Tensor)
                     else type(value).__name__)
            raise ValueError(f"the compression state's {part}[{name!r}] is {shown}; the "
                             f"parameter has {hi - lo} {dtype} elements")
        return numpy_view(value.detach().contiguous()).copy()

    def _positions(self) -> dict[str, tuple[str, int, int]]:
        """Parameter name -> (its flat buffer's name, its element range there)."""
        return {run.slots[0].name: (run.flat, run.lo, run.hi) for run in self._plan(0)}

    def _momentum_arrays(self, flat_name: str) -> tuple[np.ndarray, np.ndarray]:
        """The local and previous reduced momentum of a flat buffer (zeros on first use)."""
        state = self._momentum.get(flat_name)
        if state is None:
            flat = next(f for f in self._flats if f.name == flat_name)
            size, dtype = flat.buffer.numel(), numpy_view(flat.buffer).dtype
            state = self._momentum[flat_name] = (np.zeros(size, dtype), np.zeros(size, dtype))
        return state

    def _plan(self, threshold: int) -> list[_Run]:
        """The runs for fusion ``threshold`` (computed once per threshold)."""
        runs = self._runs.get(threshold)
        if runs is not None:
            return runs
        runs = []
        for flat in self._flats:
            sizes = [p.numel() for p in flat.params]
            starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            item = flat.buffer.element_size()
            for r in plan_runs([s * item for s in sizes], threshold):
                lo, hi = starts[r.start], starts[r.stop]
                slots = tuple(_Slot(self._names[flat.params[i]], starts[i] - lo,
                                    starts[i + 1] - lo) for i in r)
                runs.append(_Run(f"{flat.name}[{lo}:{hi}]", flat.buffer[lo:hi], slots,
                                 flat.name, lo, hi))
        self._runs[threshold] = runs
        return runs

    def _feedback_for(self, run: _Run, array: np.ndarray) -> tuple[Any, Any]:
        """``(feedback, key)`` for :func:`mpicoll.compression.allreduce` on ``run``.

        One parameter: the optimizer's store under its name. Several: a store holding the
        run's residual array, each parameter's residual in :attr:`feedback` being a view
        of it (residuals stored otherwise are copied in first).

        Raises:
            ValueError: a stored residual of the wrong size or dtype.
        """
        if not self.compressor.feedback:
            return False, None
        if len(run.slots) == 1:
            self.feedback.check(run.slots[0].name, array)
            return self.feedback, run.slots[0].name
        fused = self._fused.get(run.key)
        if fused is None:
            fused = self._fused[run.key] = np.zeros(array.size, dtype=array.dtype)
            store = self._stores[run.key] = codecs.ErrorFeedback()
            store.store(run.key, fused)
        for slot in run.slots:
            current = self.feedback.residual(slot.name)
            known = self._views.get(slot.name)
            if current is not None and known is not None and known[0] == run.key \
                    and current is known[1]:
                continue
            part = fused[slot.lo:slot.hi]
            if current is None:
                part.fill(0)
            else:
                self.feedback.check(slot.name, part)
                np.copyto(part, current)
            self.feedback.store(slot.name, part)
            self._views[slot.name] = (run.key, self.feedback.residual(slot.name))
        return self._stores[run.key], run.key
