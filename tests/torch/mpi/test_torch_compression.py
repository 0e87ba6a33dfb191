"""DistributedOptimizer with codec compressors (Compression.bf16/int8/onebit/topk/randomk):
each step equals mpicoll.compression.allreduce of the same data with the same codec and
an error-feedback store of its own, with fusion on and off; residuals carry over; the
error-feedback identity holds; wrong uses raise on every rank, never hang."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicoll.torch as hvd
from mpicoll import compression
from mpicoll.torch.state import engine

pytestmark = pytest.mark.mpi

#: (name, shape, dtype): odd sizes, one past an int8/onebit chunk (256), two dtypes.
SHAPES = [("a.weight", (7, 5), torch.float32), ("a.bias", (7,), torch.float32),
          ("b.weight", (300,), torch.float32), ("c.weight", (3, 3), torch.float64),
          ("c.bias", (1,), torch.float32)]


def make_params() -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
            for name, shape, dtype in SHAPES]


def coef(rank: int, step: int, k: int, name: str, shape: tuple, dtype) -> torch.Tensor:
    """The gradient of parameter ``name`` on ``rank`` at ``step``, backward pass ``k``."""
    seed = 1000 * rank + 100 * step + 10 * k + sum(map(ord, name))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * (1 + rank)).to(dtype)


def backward(named: list, rank: int, step: int, passes: int) -> None:
    for k in range(passes):
        loss = sum((p * coef(rank, step, k, name, tuple(p.shape), p.dtype)).sum()
                   for name, p in named)
        loss.backward()


def buffer_order(named: list) -> list[list[str]]:
    """Parameter names per flat buffer, in buffer order (reversed, grouped by dtype)."""
    groups: dict = {}
    for name, p in reversed(named):
        groups.setdefault(p.dtype, []).append(name)
    return list(groups.values())


def set_fusion(threshold: int) -> None:
    eng = engine()
    eng.settings = dataclasses.replace(eng.settings, fusion_threshold=threshold)


CASES = [  # (label, compressor factory, codec spec of the reference, op, predivide, passes)
    ("none", lambda: hvd.Compression.from_codec("none"), "none", hvd.Average, 1.0, 1),
    ("bf16", lambda: hvd.Compression.bf16, "bf16", hvd.Average, 1.0, 1),
    ("int8", lambda: hvd.Compression.int8, "int8", hvd.Average, 1.0, 2),
    ("onebit", lambda: hvd.Compression.onebit, "onebit", hvd.Sum, 1.0, 1),
    ("topk", lambda: hvd.Compression.topk(0.1), "topk:0.1", hvd.Average, 2.0, 1),
    ("randomk", lambda: hvd.Compression.randomk(0.3), "randomk:0.3", hvd.Average, 1.0, 1),
]


def test_steps_equal_the_compressed_allreduce_with_the_same_feedback():
    n, rank = hvd.size(), hvd.rank()
    saved = engine().settings
    comm = MPI.COMM_WORLD
    try:
        for fused in (True, False):
            set_fusion(64 << 20 if fused else 0)
            for label, make, spec, op, predivide, passes in CASES:
                named = make_params()
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD([p for _, p in named], lr=0.0), named_parameters=named,
                    compression=make(), op=op, gradient_predivide_factor=predivide,
                    backward_passes_per_step=passes)
                params = dict(named)
                codec = compression.get_codec(spec)          # fresh: randomk's step at 0
                ref_fb = compression.ErrorFeedback()
                runs = buffer_order(named) if fused else [
                    [name] for group in buffer_order(named) for name in group]
                for step in range(2):
                    opt.zero_grad()
                    backward(named, rank, step, passes)
                    old = {name: _residual(opt, name) for name, _ in named}
                    opt.step()
                    for run in runs:
                        mine = [_grad_sum(rank, step, passes, name, params[name])
                                for name in run]
                        x = torch.cat([g.reshape(-1) for g in mine]).numpy().copy()
                        if op == hvd.Average and predivide != 1.0:
                            x *= 1.0 / predivide
                        key = "+".join(run)
                        expected = compression.allreduce(
                            x, op="average" if op == hvd.Average and predivide == 1.0
                            else "sum", comm=comm, compression=codec, feedback=ref_fb,
                            key=key)
                        if predivide != 1.0:
                            expected *= predivide / n
                        got = torch.cat([params[name].grad.reshape(-1) for name in run])
                        where = f"{label} fused={fused} step={step} run={run}"
                        assert np.array_equal(got.numpy(), expected), where
                        every = [torch.cat([_grad_sum(r, step, passes, name,
                                                      params[name]).reshape(-1)
                                            for name in run]) for r in range(n)]
                        exact = (sum(every) / (n if op == hvd.Average else 1)).numpy()
                        if label == "none":     # lossless: the plain average (or sum)
                            assert np.allclose(expected, exact, rtol=1e-5, atol=1e-6), where
                            assert opt.error_feedback.keys() == []
                            continue
                        if expected.size > 8:   # it compressed
                            assert not np.array_equal(expected, exact), where
                        res = np.concatenate([_residual(opt, name) for name in run])
                        assert np.array_equal(res, ref_fb.residual(key)), where
                        # identity: what every rank put in (gradient + old residual) is
                        # the result plus every rank's new residual
                        put = x + np.concatenate([old[name] for name in run])
                        total = np.stack([put, res]).astype(np.float64)
                        comm.Allreduce(MPI.IN_PLACE, total)
                        scale = n / predivide if op == hvd.Average else 1.0
                        assert np.allclose(total[0], expected * scale + total[1],
                                           rtol=1e-5, atol=1e-5 * np.abs(total[0]).max()), \
                            where
                    stats = opt.compression_stats
                    assert len(stats) == len(runs)
                    assert all(s.codec == codec.name for s in stats)
                    if n > 1:
                        assert sum(s.bytes_sent for s in stats) > 0
                if label != "none":
                    assert sorted(opt.error_feedback.keys()) == sorted(params)
    finally:
        engine().settings = saved


def _grad_sum(rank: int, step: int, passes: int, name: str, p: torch.Tensor) -> torch.Tensor:
    """This rank's accumulated gradient of ``p`` (the passes added in order, as autograd)."""
    total = coef(rank, step, 0, name, tuple(p.shape), p.dtype)
    for k in range(1, passes):
        total = total + coef(rank, step, k, name, tuple(p.shape), p.dtype)
    return total


def _residual(opt, name: str) -> np.ndarray:
    fb = opt.error_feedback
    res = None if fb is None else fb.residual(name)
    if res is None:
        return np.zeros(dict(SHAPES_BY_NAME)[name], dtype=DTYPES[name])
    return res.copy()


SHAPES_BY_NAME = [(name, int(np.prod(shape))) for name, shape, _ in SHAPES]
DTYPES = {name: np.float64 if dtype is torch.float64 else np.float32
          for name, _, dtype in SHAPES}


def test_wrong_uses_raise_on_every_rank():
    n, rank = hvd.size(), hvd.rank()
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="'h' has dtype torch.float16; compression='int8' "
                                        "needs float32 or float64"):
        hvd.DistributedOptimizer(torch.optim.SGD([half], lr=0.1),
                                 named_parameters=[("h", half)],
                                 compression=hvd.Compression.int8)
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
            hvd.Compression.topk(bad)
        with pytest.raises(ValueError, match=r"randomk ratio must be in \(0, 1\]"):
            hvd.Compression.randomk(bad)
    with pytest.raises(TypeError, match="ratio must be a number"):
        hvd.Compression.topk("0.1")
    with pytest.raises(ValueError, match="unknown compression='lz4'"):
        hvd.Compression.from_codec("lz4")
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="op=Average or op=Sum, not Max"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)],
                                 compression=hvd.Compression.int8, op=hvd.Max)
    with pytest.raises(TypeError, match="cannot be summed in compressed form"):
        hvd.reducescatter(torch.ones(3), compression=hvd.Compression.onebit)
    if n < 2:
        return
    # ranks disagree on the codec: MismatchError on every rank, the adapter still works
    named = [("p", p)]
    codec = hvd.Compression.int8 if rank == 0 else hvd.Compression.onebit
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=named,
                                   compression=codec)
    p.grad = torch.ones(4)
    with pytest.raises(hvd.MismatchError) as info:
        opt.step()      # said in the caller's terms (it named the engine's request first)
    assert str(info.value).startswith("DistributedOptimizer(compression="), info.value
    assert "ranks 0 have int8" in str(info.value) and "onebit" in str(info.value)
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    # a residual that does not fit, on one rank: ValueError there, RemoteError elsewhere
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=named,
                                   compression=hvd.Compression.int8)
    if rank == n - 1:
        opt.error_feedback.store("p", np.zeros(5, dtype=np.float32))
    p.grad = torch.ones(4)
    if rank == n - 1:
        with pytest.raises(ValueError, match="has 5 float32 elements but the tensor has 4"):
            opt.step()
    else:
        with pytest.raises(hvd.RemoteError, match=f"rank {n - 1}"):
            opt.step()
    opt.error_feedback.reset()
    opt.zero_grad()
    p.grad = torch.ones(4)
    opt.step()                                       # usable again
    # a rank that joined cannot stand in zeros: the others raise instead of hanging
    if rank == n - 1:
        hvd.join()
    else:
        with pytest.raises(hvd.CollectiveError, match=r"1 rank\(s\) called hvd.join\(\)"):
            opt.step()
        hvd.join()


def test_process_set_reduces_over_its_ranks_only():
    n, rank = hvd.size(), hvd.rank()
    if n < 3:
        pytest.skip("needs 3 ranks (a set smaller than the world)")
    members = list(range(n - 1))
    ps = hvd.add_process_set(members)
    sub = MPI.COMM_WORLD.Split(0 if rank in members else MPI.UNDEFINED, rank)
    try:
        if rank not in members:
            return
        p = torch.nn.Parameter(torch.zeros(301))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0),
                                       named_parameters=[("p", p)],
                                       compression=hvd.Compression.int8, process_set=ps)
        ref_fb = compression.ErrorFeedback()
        for step in range(2):
            g = coef(rank, step, 0, "p", (301,), torch.float32)
            p.grad = g.clone()
            opt.step()
            expected = compression.allreduce(g.numpy().copy(), op="average", comm=sub,
                                             compression="int8", feedback=ref_fb, key="p")
            assert np.array_equal(p.grad.numpy(), expected), step
            assert np.array_equal(opt.error_feedback.residual("p"), ref_fb.residual("p"))
        # a warm-up step over the set: the uncompressed average of its ranks (the same
        # bits as hvd.allreduce), then compressed with fresh error feedback
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0),
                                       named_parameters=[("p", p)],
                                       compression=hvd.Compression.int8.with_warmup(1),
                                       process_set=ps)
        for step in range(2):
            g = dyadic(rank, step, 0, "p", (301,), torch.float32)
            p.grad = g.clone()
            opt.step()
            if step == 0:
                expected = hvd.allreduce(g, name="set.uncompressed", process_set=ps).numpy()
                total = g.numpy().copy()
                sub.Allreduce(MPI.IN_PLACE, total)       # eighths: the sum is exact
                assert np.allclose(expected, total / len(members), rtol=1e-6, atol=0)
            else:
                expected = compression.allreduce(g.numpy().copy(), op="average", comm=sub,
                                                 compression="int8",
                                                 feedback=compression.ErrorFeedback(), key=0)
            assert np.array_equal(p.grad.numpy(), expected), f"warm-up set, step {step}"
        # the functional API too (hvd.allreduce with a codec, a caller-held feedback,
        # Sum with a postscale factor)
        fb = compression.ErrorFeedback()
        for step in range(2):
            g = coef(rank, step, 1, "p", (301,), torch.float32)
            out = hvd.allreduce(g, name="set.p", compression=hvd.Compression.onebit,
                                op=hvd.Sum, postscale_factor=0.5, process_set=ps, feedback=fb)
            expected = compression.allreduce(g.numpy().copy(), op="sum", comm=sub,
                                             compression="onebit", feedback=ref_fb, key="f")
            assert np.array_equal(out.numpy(), expected * 0.5), step
            assert np.array_equal(fb.residual("set.p"), ref_fb.residual("f"))
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
        hvd.remove_process_set(ps)


class Halving(hvd.Compressor):
    """A user-defined Horovod-style compressor: sends half the gradient, doubles it back."""

    @staticmethod
    def compress(tensor):
        return tensor / 2, "halved"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "halved"
        return tensor * 2


def test_horovod_style_compressors_still_work():
    n, rank = hvd.size(), hvd.rank()
    for comp, tol in ((Halving, 1e-6), (hvd.Compression.fp16, 2e-3)):
        named = make_params()[:3]
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.0),
                                       named_parameters=named, compression=comp)
        assert opt.error_feedback is None and opt.compression_stats == []
        opt.zero_grad()
        backward(named, rank, 0, 1)
        opt.step()
        for name, p in named:
            exact = sum(coef(r, 0, 0, name, tuple(p.shape), p.dtype) for r in range(n)) / n
            assert torch.allclose(p.grad, exact, rtol=tol, atol=tol), (comp, name)


def test_compressed_momentum_equals_the_allreduce_of_local_momenta():
    """Compression(momentum=0.9): each rank's flat run carries its local momentum
    m = 0.9 m + g into the compressed all-reduce (with the reference's own error feedback),
    and the gradient the optimizer gets is M - 0.9 M_prev; lossless, the plain average."""
    n, rank = hvd.size(), hvd.rank()
    comm = MPI.COMM_WORLD
    beta = 0.9
    for label, comp, spec, predivide in (
            ("onebit", hvd.Compression.onebit.with_momentum(beta), "onebit", 2.0),
            ("none", hvd.Compression.from_codec("none", momentum=beta), "none", 1.0)):
        named = make_params()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD([p for _, p in named], lr=0.0), named_parameters=named,
            compression=comp, gradient_predivide_factor=predivide)
        params = dict(named)
        codec = compression.get_codec(spec)
        ref_fb = compression.ErrorFeedback()
        runs = buffer_order(named)
        local = {"+".join(run): 0.0 for run in runs}
        prev = dict(local)
        for step in range(3):
            opt.zero_grad()
            backward(named, rank, step, 1)
            opt.step()
            for run in runs:
                key = "+".join(run)
                x = torch.cat([_grad_sum(rank, step, 1, name, params[name]).reshape(-1)
                               for name in run]).numpy().copy()
                if predivide != 1.0:
                    x *= 1.0 / predivide
                local[key] = local[key] * beta + x
                reduced = compression.allreduce(
                    local[key].copy(), op="average" if predivide == 1.0 else "sum",
                    comm=comm, compression=codec, feedback=ref_fb, key=key)
                expected = reduced - prev[key] * beta
                prev[key] = reduced
                if predivide != 1.0:
                    expected *= predivide / n
                got = torch.cat([params[name].grad.reshape(-1) for name in run]).numpy()
                where = f"{label} step={step} run={run}"
                assert np.array_equal(got, expected), where
                every = [torch.cat([_grad_sum(r, step, 1, name, params[name]).reshape(-1)
                                    for name in run]) for r in range(n)]
                exact = (sum(every) / n).numpy()
                if label == "none":
                    assert np.allclose(got, exact, rtol=1e-5, atol=1e-5), where
                else:
                    assert not np.allclose(got, exact, rtol=1e-3, atol=1e-3), where
                    res = np.concatenate([_residual(opt, name) for name in run])
                    assert np.array_equal(res, ref_fb.residual(key)), where


def dyadic(rank: int, step: int, k: int, name: str, shape: tuple, dtype) -> torch.Tensor:
    """Eighths times (1 + rank): sums of them are exact in any order, so the uncompressed
    reduction has the same bits whichever way the engine fuses and orders it."""
    g = torch.Generator().manual_seed(1000 * rank + 100 * step + 10 * k + sum(map(ord, name)))
    return (torch.randint(-64, 65, shape, generator=g).to(dtype) / 8) * (1 + rank)


WARMUPS = [  # (label, compressor, codec spec, op, predivide, backward passes, warm-up)
    ("onebit+momentum", lambda: hvd.Compression.onebit.with_momentum(0.9).with_warmup(2),
     "onebit", hvd.Average, 1.0, 2, 2),
    ("int8:8+momentum predivide", lambda: hvd.Compression.from_codec(
        "int8:8", momentum=0.9, warmup=1), "int8:8", hvd.Average, 2.0, 1, 1),
    ("topk sum", lambda: hvd.Compression.topk(0.2, warmup=1), "topk:0.2", hvd.Sum, 1.0, 1, 1),
]


@pytest.mark.parametrize("case", WARMUPS, ids=[c[0] for c in WARMUPS])
def test_warmup_is_uncompressed_then_continues_as_the_replay(case):
    """Compression(...).with_warmup(w): the first w steps (each of `passes` backward
    passes) leave the same bits as Compression.none (gradients and SGD-with-momentum
    parameters); the next step equals compression.allreduce of the local momentum
    accumulated through the warm-up (fresh error feedback), minus beta times the reduced
    momentum, which at the switch is the optimizer's own momentum buffer."""
    label, make, spec, op, predivide, passes, warmup = case
    n, rank = hvd.size(), hvd.rank()
    comm = MPI.COMM_WORLD
    comp = make()
    beta = comp.momentum
    named, opts = {}, {}
    for which, c in (("none", hvd.Compression.none), ("warm", comp)):
        named[which] = make_params()
        opts[which] = hvd.DistributedOptimizer(
            torch.optim.SGD([p for _, p in named[which]], lr=0.1, momentum=0.9),
            named_parameters=named[which], compression=c, op=op,
            gradient_predivide_factor=predivide, backward_passes_per_step=passes)
    params = dict(named["warm"])
    runs = buffer_order(named["warm"])
    local = {"+".join(run): 0.0 for run in runs}
    prev = dict(local)
    average, post = op == hvd.Average, predivide if op == hvd.Average else 1.0
    for step in range(warmup + 1):
        for which in ("none", "warm") if step < warmup else ("warm",):
            opts[which].zero_grad()
            for k in range(passes):
                sum((p * dyadic(rank, step, k, name, tuple(p.shape), p.dtype)).sum()
                    for name, p in named[which]).backward()
            opts[which].step()
        state = opts["warm"].compression_state_dict()
        assert state["steps"] == step + 1
        for run in runs:
            key = "+".join(run)
            x = sum(torch.cat([dyadic(rank, step, k, name, tuple(params[name].shape),
                                      params[name].dtype).reshape(-1) for name in run])
                    for k in range(passes)).numpy()
            if average:
                x = x * (1.0 / predivide)
            if beta:
                local[key] = local[key] * beta + x
            got = torch.cat([params[name].grad.reshape(-1) for name in run]).numpy()
            where = f"{label} step={step} run={run}"
            if step < warmup:
                others = dict(named["none"])
                for name in run:       # Compression.none's bits, gradients and parameters
                    for a, b in ((params[name].grad, others[name].grad),
                                 (params[name].detach(), others[name].detach())):
                        assert a.numpy().tobytes() == b.numpy().tobytes(), (where, name)
                assert opts["warm"].compression_stats == []
                if beta:
                    reduced = got * (n / post) if post != 1.0 else got
                    prev[key] = prev[key] * beta + reduced
                    for name in run:   # the reduced momentum the state keeps
                        assert np.array_equal(state["reduced_momentum"][name].numpy(),
                                              prev[key][_slot(run, name)]), (where, name)
                        if post == 1.0:    # ... is then the optimizer's momentum buffer
                            buf = opts["warm"].state[params[name]]["momentum_buffer"]
                            assert np.array_equal(buf.reshape(-1).numpy(),
                                                  prev[key][_slot(run, name)]), (where, name)
                continue
            reduced = compression.allreduce(
                (local[key] if beta else x).copy(),
                op="average" if average and predivide == 1.0 else "sum", comm=comm,
                compression=compression.get_codec(spec),
                feedback=compression.ErrorFeedback(), key=key)
            expected = reduced - prev[key] * beta if beta else reduced
            if post != 1.0:
                expected *= post / n
            assert np.array_equal(got, expected), where
            exact = sum(torch.cat([dyadic(r, step, k, name, tuple(params[name].shape),
                                          params[name].dtype).reshape(-1) for name in run])
                        for r in range(n) for k in range(passes)).numpy()
            assert not np.allclose(got, exact / (n if average else 1), rtol=1e-3,
                                   atol=1e-3), where                  # it compressed
            assert len(opts["warm"].compression_stats) == len(runs)


def _slot(run: list[str], name: str) -> slice:
    """``name``'s elements in the concatenation of ``run``'s parameters."""
    sizes = dict(SHAPES_BY_NAME)
    lo = sum(sizes[other] for other in run[:run.index(name)])
    return slice(lo, lo + sizes[name])


def test_warmup_disagreements_raise_on_every_rank():
    """Ranks with other warm-up lengths, or whose step counts put them on different sides
    of the switch (a checkpoint restored on one rank only): MismatchError on every rank."""
    n, rank = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    p = torch.nn.Parameter(torch.zeros(5))
    for warmup, steps in ((1 + (rank == n - 1), 0), (1, int(rank == n - 1))):
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1),
                                       named_parameters=[("p", p)],
                                       compression=hvd.Compression.int8.with_warmup(warmup))
        opt.load_compression_state_dict(dict(opt.compression_state_dict(), steps=steps))
        p.grad = torch.ones(5)
        with pytest.raises(hvd.MismatchError, match="warm"):
            opt.step()
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
