"""Codec compressors outside DistributedOptimizer, and its compression checkpoints.

``hvd.allreduce`` / ``hvd.grouped_allreduce`` with ``Compression.int8`` and friends: results,
residuals (a caller-held ``ErrorFeedback``) and gradients equal, bit for bit, the
one-process replay of the compressed ring (tests/compression/mpi/compression_cases.py) on
the gathered inputs, with Average/Sum and prescale/postscale (a process set: in
test_torch_compression.py); bad input
raises on every rank. ``compression_state_dict()``: training restored from a checkpoint
continues bit for bit like an uninterrupted run.
"""
from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd
from mpicoll import compression

pytestmark = pytest.mark.mpi

_CASES_FILE = Path(__file__).resolve().parents[2] / "compression" / "mpi" / "compression_cases.py"
_spec = importlib.util.spec_from_file_location("compression_cases", _CASES_FILE)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def replay(spec: str, xs: list[np.ndarray], residuals: list, op, pre: float, post: float,
           n: int, step: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """What every rank gets from ranks' inputs ``xs`` (and old residuals): the ring
    replayed in one process, with the call's scaling written out."""
    ys = [x * pre if pre != 1.0 else x for x in xs]
    out, res = cases.reference(spec, ys, residuals, None, randomk_step=step)
    average = int(op) == int(hvd.Average)
    if average and post == 1.0:
        np.divide(out, n, out=out)
    elif post != 1.0:
        np.multiply(out, post / n if average else post, out=out)
    return out, res


def data(rank: int, shape: tuple, rep: int, dtype) -> torch.Tensor:
    count = int(np.prod(shape))
    return torch.from_numpy(cases.make_input(rank, count, rep, dtype).reshape(shape))


CALLS = [  # (compressor spec, op, prescale, postscale, dtype)
    ("int8:4", hvd.Average, 1.0, 1.0, np.float32),
    ("onebit:8", hvd.Sum, 0.5, 3.0, np.float32),
    ("bf16", hvd.Average, 1.0, 2.0, np.float64),
    ("topk:0.3", hvd.Average, 2.0, 1.0, np.float32),
    ("randomk:0.5", hvd.Sum, 1.0, 1.0, np.float32),
]


@pytest.mark.parametrize("spec,op,pre,post,dtype", CALLS, ids=[c[0] for c in CALLS])
def test_allreduce_with_a_codec_equals_the_replay(spec, op, pre, post, dtype):
    n, rank = hvd.size(), hvd.rank()
    comp = hvd.Compression.from_codec(spec)         # fresh: randomk's step starts at 0
    fb = compression.ErrorFeedback()
    step = 0
    for shape in [(1,), (n + 1,), (13,), (3, 101)]:
        residuals = [None] * n
        for rep in range(2):                        # the second call uses the residuals
            x = data(rank, shape, rep, dtype)
            before = x.clone()
            out = hvd.allreduce(x, name=f"codec.{spec}.{shape}", compression=comp, op=op,
                                prescale_factor=pre, postscale_factor=post, feedback=fb)
            want, residuals = replay(spec, [a.reshape(-1) for a in MPI.COMM_WORLD.allgather(
                x.numpy())], residuals, op, pre, post, n, step)
            step += 1
            where = f"{spec} shape={shape} rep={rep}"
            assert torch.equal(x, before), where
            assert out.shape == x.shape and out.dtype == x.dtype, where
            assert out.numpy().tobytes() == want.reshape(shape).tobytes(), where
            key = f"codec.{spec}.{shape}"
            assert fb.residual(key).tobytes() == residuals[rank].tobytes(), where
    # without a feedback object: no residual anywhere, the plain replay
    kept = len(compression.tensor_feedback())
    x = data(rank, (13,), 5, dtype)
    out = hvd.allreduce(x, compression=comp, op=op, prescale_factor=pre, postscale_factor=post)
    want, _ = replay(spec, MPI.COMM_WORLD.allgather(x.numpy()), [None] * n, op, pre, post, n,
                     step)
    assert out.numpy().tobytes() == want.tobytes()
    assert len(compression.tensor_feedback()) == kept and len(fb) == 4


def test_grouped_allreduce_and_gradients_with_a_codec():
    """A group's members each equal the replay (residual keys (name, i)); the gradient of
    the all-reduce is the same compressed all-reduce of the incoming gradients, without
    error feedback, for allreduce and grouped_allreduce."""
    n, rank = hvd.size(), hvd.rank()
    gather = MPI.COMM_WORLD.allgather
    comp = hvd.Compression.from_codec("int8:4")
    fb = compression.ErrorFeedback()
    members = [data(rank, (7,), 0, np.float32), data(rank, (3, 3), 0, np.float64)]
    residuals = [[None] * n, [None] * n]
    for rep in range(2):
        outs = hvd.grouped_allreduce(members, name="codec.group", compression=comp,
                                     op=hvd.Sum, feedback=fb)
        for i, (x, out) in enumerate(zip(members, outs)):
            want, residuals[i] = replay("int8:4", [a.reshape(-1) for a in gather(x.numpy())],
                                        residuals[i], hvd.Sum, 1.0, 1.0, n)
            assert out.numpy().tobytes() == want.reshape(x.shape).tobytes(), (rep, i)
            assert fb.residual(("codec.group", i)).tobytes() == residuals[i][rank].tobytes()
    # gradients: rank-dependent incoming gradients w, Average with a prescale factor
    w = [data(rank, (5,), 7, np.float32), data(rank, (2, 3), 8, np.float64)]
    xs = [torch.zeros(5, requires_grad=True), torch.zeros(2, 3, dtype=torch.float64,
                                                           requires_grad=True)]
    y = hvd.allreduce(xs[0], compression=comp, prescale_factor=0.5)
    (y * w[0]).sum().backward()
    ys = hvd.grouped_allreduce(xs, compression=comp, op=hvd.Sum)
    sum((yi * wi).sum() for yi, wi in zip(ys, w)).backward()
    first, _ = replay("int8:4", gather(w[0].numpy()), [None] * n, hvd.Average, 0.5, 1.0, n)
    for i, (x, wi) in enumerate(zip(xs, w)):
        want, _ = replay("int8:4", [a.reshape(-1) for a in gather(wi.numpy())], [None] * n,
                         hvd.Sum, 1.0, 1.0, n)
        if i == 0:                               # both calls' gradients accumulate
            want = first + want
        assert x.grad.numpy().tobytes() == want.reshape(x.shape).tobytes(), i


def test_bad_input_raises_on_every_rank():
    n, rank = hvd.size(), hvd.rank()
    int8 = hvd.Compression.int8
    last = rank == n - 1
    with pytest.raises(TypeError, match="tensor has dtype torch.int64; compression='int8' "
                                        "needs float32 or float64"):
        hvd.allreduce(torch.ones(3, dtype=torch.int64), compression=int8)
    with pytest.raises(TypeError, match="dtype torch.float16"):
        hvd.allreduce(torch.ones(3, dtype=torch.float16), compression=int8)
    with pytest.raises(ValueError, match="op=Average or op=Sum, not Max"):
        hvd.allreduce(torch.ones(3), compression=int8, op=hvd.Max)
    with pytest.raises(ValueError, match="only DistributedOptimizer keeps"):
        hvd.allreduce(torch.ones(3), compression=int8.with_momentum(0.9))
    with pytest.raises(ValueError, match="warm-up of 2 steps need state that only "
                                         "DistributedOptimizer keeps"):
        hvd.grouped_allreduce([torch.ones(3)], compression=int8.with_warmup(2))
    with pytest.raises(TypeError, match="feedback must be None or an"):
        hvd.allreduce(torch.ones(3), compression=int8, feedback={})
    with pytest.raises(TypeError, match="feedback= needs a codec compressor"):
        hvd.allreduce(torch.ones(3), compression=hvd.Compression.fp16,
                      feedback=compression.ErrorFeedback())
    with pytest.raises(TypeError, match="cannot be summed in compressed form"):
        hvd.reducescatter(torch.ones(3), compression=int8)
    if n > 1:
        # one rank's bad tensor or stale residual: its error there, RemoteError elsewhere
        fb = compression.ErrorFeedback()
        if last:
            fb.store("r", np.zeros(5, dtype=np.float32))
        for tensor, feedback, error, match in (
                (torch.ones(4, dtype=torch.int32 if last else torch.float32), None,
                 TypeError, "dtype torch.int32"),
                (torch.ones(4), fb, ValueError, "has 5 float32 elements but the tensor has 4")):
            expected = (error, match) if last else (hvd.RemoteError, f"rank {n - 1}")
            with pytest.raises(expected[0], match=expected[1]):
                hvd.allreduce(tensor, name="r", compression=int8, feedback=feedback)
        # ranks disagree on the codec, the shape, or compressed vs not: MismatchError
        for kwargs in ({"compression": hvd.Compression.onebit if last else int8},
                       {"compression": int8, "tensor": torch.ones(5 if last else 4)},
                       {"compression": hvd.Compression.none if last else int8}):
            tensor = kwargs.pop("tensor", torch.ones(4))
            with pytest.raises(hvd.MismatchError):
                hvd.allreduce(tensor, name="mismatch", **kwargs)
        # a joined rank: the others raise instead of waiting
        if last:
            hvd.join()
        else:
            with pytest.raises(hvd.CollectiveError, match=r"1 rank\(s\) called hvd.join\(\)"):
                hvd.allreduce(torch.ones(3), name="joined", compression=int8)
            hvd.join()
    out = hvd.allreduce(torch.ones(4), compression=hvd.Compression.bf16, op=hvd.Sum)
    assert torch.equal(out, torch.full((4,), float(n)))             # usable afterwards


# ------------------------------------------------------------------------ checkpoints
SHAPES = [("a.weight", (7, 5), torch.float32), ("a.bias", (7,), torch.float32),
          ("b.weight", (300,), torch.float32), ("c.weight", (3, 3), torch.float64)]

COMPRESSORS = {  # fresh objects: a restored run must not rely on the old codec's state
    "int8": lambda: hvd.Compression.int8,
    "onebit-momentum": lambda: hvd.Compression.onebit.with_momentum(0.9),
    # saved inside the warm-up (after 2 of 3 uncompressed steps), restored across the switch
    "onebit-momentum-warmup": lambda: hvd.Compression.onebit.with_momentum(0.9).with_warmup(3),
    "randomk": lambda: hvd.Compression.randomk(0.3),
    "int8-stochastic": lambda: hvd.Compression.from_codec("int8:stochastic"),
}


def _train(model: dict, opt, first: int, steps: int) -> None:
    """Steps ``first .. first + steps - 1``; gradients depend on the rank, the step and
    the parameters (so a wrong restore changes later gradients too)."""
    rank = hvd.rank()
    for step in range(first, first + steps):
        opt.zero_grad()
        loss = 0.0
        for i, (name, p) in enumerate(model.items()):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
            c = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * (1 + rank)
            loss = loss + (p * c).sum() + 0.05 * (p * p).sum()
        loss.backward()
        opt.step()


def _new(label: str, saved: dict | None = None) -> tuple[dict, torch.optim.Optimizer]:
    model = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
             for name, shape, dtype in SHAPES}
    if saved is not None:
        with torch.no_grad():
            for name, p in model.items():
                p.copy_(saved["model"][name])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.values()), lr=0.1,
                                                   momentum=0.9),
                                   named_parameters=list(model.items()),
                                   compression=COMPRESSORS[label]())
    return model, opt


@pytest.mark.parametrize("label", list(COMPRESSORS))
def test_restored_training_continues_bit_for_bit(label):
    model, opt = _new(label)
    _train(model, opt, 0, 2)
    buffer = io.BytesIO()
    torch.save({"model": {k: p.detach().clone() for k, p in model.items()},
                "optimizer": opt.state_dict(),
                "compression": opt.compression_state_dict()}, buffer)
    _train(model, opt, 2, 2)                                 # the uninterrupted run
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    restored, opt2 = _new(label, saved)
    opt2.load_state_dict(saved["optimizer"])
    opt2.load_compression_state_dict(saved["compression"])
    _train(restored, opt2, 2, 2)
    for name, p in model.items():
        assert p.detach().numpy().tobytes() == restored[name].detach().numpy().tobytes(), \
            f"{label}: {name}"
    # the test can tell: without the compression state the run goes elsewhere
    other, opt3 = _new(label, saved)
    opt3.load_state_dict(saved["optimizer"])
    _train(other, opt3, 2, 2)
    assert any(not torch.equal(p, other[name]) for name, p in model.items()), label
