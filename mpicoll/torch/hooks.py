"""DDP communication hooks with mpicoll's codecs and error feedback, for the "mpicoll"
``torch.distributed`` backend::

    import mpicoll.torch.hooks as hooks
    ddp = DistributedDataParallel(model)                      # dist.init_process_group("mpicoll")
    ddp.register_comm_hook(hooks.CompressionState(), hooks.int8_hook)

Each hook averages DDP's gradient bucket with :func:`mpicoll.compression.allreduce`
(dense codecs: a ring that decodes, adds and re-encodes; sparse codecs: an all-gather of
(index, value) pairs; every rank gets the same bits) on the process group's communicator,
on the group's communication thread, and returns the future DDP waits for. What the codec
dropped is kept per bucket in the :class:`CompressionState` and added to that bucket's
next gradient (error feedback).

Hooks: :func:`int8_hook`, :func:`onebit_hook`, :func:`bf16_hook`, :func:`fp16_hook` and
:func:`compression_hook` (the codec named by ``CompressionState(codec=...)``, for example
``"topk:0.01"``, ``"randomk:0.01"``, ``"int8:512:stochastic"``). torch's own hooks
(``default_hooks.fp16_compress_hook``, the fp16/bf16 wrappers, ``powerSGD_hook``,
``post_localSGD_hook``) run on the backend as they are: see docs/torch_distributed.md.
"""
import logging
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from .. import compression
from ..compression import Codec, get_codec
from .compression.compressors import CODEC_DTYPES
from .distributed.groups import backend_of
from .engine.dtypes import numpy_view

__all__ = ["CompressionState", "compression_hook", "int8_hook", "onebit_hook", "bf16_hook",
           "fp16_hook", "codec_hook"]

log = logging.getLogger("mpicoll.torch.hooks")


class CompressionState:
    """What a compression hook keeps between steps: the codec, the residuals, the step.

    Args:
        process_group: the group to average over (an "mpicoll" group); ``None``: the
            default group.
        codec: the codec of :func:`compression_hook` (a name such as ``"int8"``,
            ``"topk:0.01"``, or a :class:`mpicoll.compression.Codec`); the named hooks
            (:func:`int8_hook` ...) set it on first use and refuse a state that holds
            another one.
        error_feedback: keep what the codec dropped and add it to the bucket's next
            gradient (default ``True``; without it a biased codec such as onebit or top-k
            does not converge).
        start_iter: the number of first iterations (backward passes) averaged
            uncompressed, with torch's all-reduce, as PowerSGD's ``start_powerSGD_iter``
            (default 0).

    Attributes:
        feedback: the :class:`mpicoll.compression.ErrorFeedback` holding one residual per
            bucket index (a flat array of the bucket's size, laid out as its buffer).
        iteration: backward passes seen so far (counted at each last bucket).

    Residuals follow DDP's bucket rebuilds: DDP re-packs its buckets after the first
    iteration (and whenever a ``static_graph``'s layout is settled), so the parameters of
    bucket ``i`` can change. The state remembers which parameter sits where in each
    bucket; when a bucket's parameters differ from last time, its residual is assembled
    from each parameter's part of the residuals it had before (zeros for a parameter seen
    for the first time), so no correction is lost or applied to the wrong parameter.
    Rebuilds happen alike on every rank (DDP rebuilds from rank 0's order).

    ``state_dict()``/``load_state_dict()`` keep the iteration count and the residuals
    (per rank: each rank's residuals are its own) with their buckets' layouts (each
    parameter's element count, in order). A state loaded into a new DDP, whose first
    iteration runs on its initial buckets, holds each residual back until a bucket of
    the saved layout appears (DDP's rebuild gives the saved buckets again), then adds it
    to what that bucket's residual is by then: no correction is lost or misplaced.
    """

    def __init__(self, process_group: Any = None, codec: Codec | str | None = None,
                 error_feedback: bool = True, start_iter: int = 0) -> None:
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, not "
                            f"{type(error_feedback).__name__}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        self.process_group = process_group
        self.codec = None if codec is None else get_codec(codec, "codec")
        self.error_feedback = error_feedback
        self.start_iter = start_iter
        self.feedback = compression.ErrorFeedback()
        self.iteration = 0
        self._layouts: dict[int, tuple] = {}     # bucket index -> (parameter ids, numels)
        self._checked: set[int] = set()           # bucket indices agreed on (first call)
        self._generation: int | None = None       # the group's world they were agreed on
        self._orphans: dict[int, Any] = {}        # residual parts between two buckets
        #: loaded residuals waiting for a bucket of their layout: index -> (numels, residual)
        self._pending: dict[int, tuple] = {}

    def state_dict(self) -> dict:
        """The iteration count, the codec's name, the residuals (CPU tensors, keyed by
        bucket index: ``torch.load`` takes them with its default ``weights_only=True``)
        and their buckets' layouts (the parameters' element counts)."""
        return {"iteration": self.iteration,
                "codec": None if self.codec is None else self.codec.name,
                "residuals": {k: torch.from_numpy(self.feedback.residual(k).copy())
                              for k in self.feedback.keys()},
                "layouts": {k: list(numels) for k, (_, numels) in self._layouts.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. Residuals whose bucket layout is this
        state's current one are restored at once; the others (a new DDP, whose first
        iteration runs on its initial buckets) when a bucket of their layout appears.
        A state without a codec takes the saved one.

        Raises:
            ValueError: the saved residuals are another codec's than this state's.
        """
        saved = state.get("codec")
        if saved is not None and self.codec is not None and saved != self.codec.name:
            raise ValueError(f"the saved state holds residuals of codec {saved!r}; this "
                             f"CompressionState's codec is {self.codec.name!r}")
        if saved is not None and self.codec is None:
            self.codec = get_codec(saved, "the saved state's codec")
        self.iteration = int(state["iteration"])
        self.feedback.reset()
        self._pending = {}
        layouts = state.get("layouts")
        for key, residual in state["residuals"].items():
            residual = residual.numpy() if isinstance(residual, torch.Tensor) else residual
            numels = None if layouts is None or key not in layouts else tuple(layouts[key])
            if numels is None or (key in self._layouts and self._layouts[key][1] == numels):
                self.feedback.store(key, residual.copy())
            else:
                self._pending[key] = (numels, residual.copy())

    # --- residuals across bucket rebuilds -----------------------------------------------
    def _follow_layout(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor
                       ) -> None:
        """Re-assemble bucket ``index``'s residual when its parameters changed."""
        layout = (tuple(id(p) for p in params), tuple(p.numel() for p in params))
        if self._layouts.get(index) == layout:
            return
        self._checked.discard(index)
        pieces = {**self._parameter_residuals(), **self._orphans}
        old = self._layouts.get(index)
        if old is not None:   # what leaves this bucket waits for the bucket it joins
            for pid in set(old[0]) - set(layout[0]):
                if pid in pieces:
                    self._orphans[pid] = pieces[pid]
        self._layouts[index] = layout
        if sum(layout[1]) != buffer.numel():   # not laid out parameter by parameter
            self.feedback.reset(index)
            return
        if pieces:
            residual = numpy_view(torch.zeros(buffer.numel(), dtype=buffer.dtype))
            for pid, part in zip(layout[0], np.split(residual, np.cumsum(layout[1])[:-1])):
                piece = pieces.get(pid)
                if piece is not None and piece.size == part.size:
                    part[:] = piece
                self._orphans.pop(pid, None)
            self.feedback.store(index, residual)
        if self._pending.get(index, ((),))[0] == layout[1]:   # a loaded residual's bucket
            loaded = self._pending.pop(index)[1]
            now = self.feedback.residual(index)
            self.feedback.store(index, loaded if now is None else now + loaded)

    def _parameter_residuals(self) -> dict[int, Any]:
        """Each parameter's part of the residual of the bucket it sits in now."""
        pieces: dict[int, Any] = {}
        for index, (ids, numels) in self._layouts.items():
            residual = self.feedback.residual(index)
            if residual is None or residual.size != sum(numels):
                continue
            for pid, piece in zip(ids, np.split(residual, np.cumsum(numels)[:-1])):
                pieces[pid] = piece.copy()
        return pieces

    def __repr__(self) -> str:
        codec = "unset" if self.codec is None else self.codec.name
        return (f"<CompressionState codec={codec} error_feedback={self.error_feedback} "
                f"iteration={self.iteration} residuals={len(self.feedback)}>")


def _mpicoll_group(process_group: Any) -> Any:
    """The mpicoll process group behind ``process_group`` (``None``: the default group)."""
    group = dist.group.WORLD if process_group is None else process_group
    if group is None:
        raise RuntimeError("the mpicoll DDP hooks need dist.init_process_group('mpicoll') "
                           "first")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this rank is not a member of the CompressionState's "
                         "process_group: DDP and its hook run on the group's ranks only")
    try:
        return backend_of(group, "the mpicoll DDP hooks")
    except ValueError:
        raise TypeError(f"the mpicoll DDP hooks average over an 'mpicoll' process group, "
                        f"not {dist.get_backend(group)!r} (use torch's own hooks "
                        f"there)") from None


def _refuse_dtype(bucket: Any, codec: Codec) -> None:
    raise TypeError(f"DDP bucket {bucket.index()} holds {bucket.buffer().dtype} gradients; "
                    f"compression={codec.name!r} encodes float32 or float64 (use torch's "
                    f"default hooks for other dtypes)")


def _follow_world(state: CompressionState, group: Any) -> None:
    """The first call on the group's world (the first ever, or after an elastic shrink or
    growth): every rank checks its first calls again and takes rank 0's iteration count
    (one broadcast), so that all leave ``start_iter``'s warm-up together: a growth's new
    process counts from 0 where the running ranks are past it."""
    state._checked.clear()
    state._generation = group.generation
    count = np.array([state.iteration], dtype=np.int64)
    group.submit("DDP hook iteration", lambda: group.comm.Bcast(count, root=0)).wait()
    state.iteration = int(count[0])


def _compressed(state: CompressionState, bucket: Any, codec: Codec) -> Future:
    if state.codec is None:
        state.codec = codec
    elif state.codec.name != codec.name:
        raise ValueError(f"this CompressionState holds residuals of codec "
                         f"{state.codec.name!r}; a {codec.name!r} hook needs its own state")
    buffer = bucket.buffer()
    encodable = buffer.dtype in CODEC_DTYPES
    if not encodable and state.iteration >= state.start_iter:
        _refuse_dtype(bucket, codec)
    group = _mpicoll_group(state.process_group)
    if state._generation != group.generation:
        _follow_world(state, group)
    last = bucket.is_last()
    if state.iteration < state.start_iter:
        if last:
            state.iteration += 1
        # torch's default averaging of the bucket (all-reduce, then divide)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return default_hooks.allreduce_hook(state.process_group, bucket)
    if not encodable:            # (rank 0's count, taken just now, is past the warm-up)
        _refuse_dtype(bucket, codec)
    index = bucket.index()
    if state.error_feedback and codec.lossy:
        state._follow_layout(index, bucket.parameters(), buffer)
        feedback: Any = state.feedback
    else:
        feedback = False
    check = index not in state._checked
    state._checked.add(index)
    if last:
        state.iteration += 1

    def run() -> torch.Tensor:
        x = numpy_view(buffer)
        compression.allreduce(x, x, op="average", comm=group.comm, compression=codec,
                              feedback=feedback, key=index, check=check)
        return buffer

    # run where the group runs its operations (after what it has queued, so every rank runs
    # it in the same order); the future completes with the buffer if it fails inside a
    # backward pass: the error is raised from backward() (mpicoll.torch.distributed.backward)
    return group.submit(f"DDP {codec.name} bucket {index}", run, buffer).get_future()


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average ``bucket`` compressed with ``state.codec``, with error feedback.

    Returns:
        A future of the bucket's averaged buffer (written in place), the same bits on every
        rank.
    Raises:
        ValueError: ``state`` has no codec. TypeError: the bucket's dtype is not float32 or
            float64, or the group is not an "mpicoll" group.
    """
    if state.codec is None:
        raise ValueError("compression_hook needs CompressionState(codec=...), for example "
                         "codec='topk:0.01'")
    return _compressed(state, bucket, state.codec)


def codec_hook(codec: Codec | str) -> Callable[["CompressionState", Any], Future]:
    """A DDP hook that averages buckets with ``codec`` (a name or a codec), with the
    state's error feedback: ``ddp.register_comm_hook(CompressionState(),
    codec_hook("topk:0.01"))``."""
    resolved = get_codec(codec, "codec")

    def hook(state: CompressionState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        return _compressed(state, bucket, resolved)

    hook.__name__ = hook.__qualname__ = f"{resolved.name.replace(':', '_')}_hook"
    hook.__doc__ = f"Average a DDP bucket compressed with {resolved.name!r} (error feedback)."
    return hook


#: int8: one float32 scale per 256 elements, 3.9x fewer bytes than float32.
int8_hook = codec_hook("int8")
#: onebit: signs and one scale per 256 elements (28x fewer bytes); needs error feedback.
onebit_hook = codec_hook("onebit")
#: bf16: the upper half of each float32 (2x fewer bytes).
bf16_hook = codec_hook("bf16")
#: fp16: float16 values (2x fewer bytes; overflow past 65504).
fp16_hook = codec_hook("fp16")
