"""DDP communication hooks on the "mpicoll" backend: mpicoll's codec hooks
(:mod:`mpicoll.torch.hooks`) and torch's own (fp16/bf16 compression, PowerSGD, post-local
SGD with periodic model averaging).

- The codec hooks: every bucket's result and residual equal, bit for bit, a replay of
  :func:`mpicoll.compression.allreduce` on the same input and residual; summed over ranks,
  ``n * result + residuals`` equals the sum of the compensated inputs (error feedback
  keeps what the codec dropped); residuals follow their parameters when DDP re-packs its
  buckets (a unit test of :class:`~mpicoll.torch.hooks.CompressionState`).
- torch's hooks: fp16/bf16 training close to the exact model (and far from a model
  trained without communication); PowerSGD at full rank equals plain all-reduce to 1e-9;
  post-local SGD (subgroups of two ranks, model averaging every two steps) equals a
  one-process simulation of every rank to 1e-10.

The training tests run at n = 2 and 3 only (CI time); the state's unit tests everywhere.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

import mpicoll.torch.hooks as hooks
from mpicoll.torch.distributed import backend_of
from mpicoll import compression
from test_dist_ddp import (STEPS, assert_same_model, batch, ddp_of, loss_of, model, sgd,
                           shard, train)

pytestmark = pytest.mark.mpi

#: The hooks' training tests run at 2 and 3 ranks (CI time); the unit tests everywhere.
at_2_and_3 = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (2, 3),
                                reason="hook training tests run at n = 2, 3")


def wide_model() -> torch.nn.Module:
    """Layers of 300 and 130 weights: several int8 chunks of 256 per bucket."""
    torch.manual_seed(99)
    return torch.nn.Sequential(torch.nn.Linear(5, 60), torch.nn.Tanh(),
                               torch.nn.Linear(60, 2)).double()


def recorder(hook, calls: list):
    """``hook``, recording in ``calls``, per bucket call, the input, the residual it was
    compensated with, the result and the new residual. (A plain function without
    annotations: DDP checks a hook's name and annotations.)"""

    def recording(state, bucket):
        index = bucket.index()
        state._follow_layout(index, bucket.parameters(), bucket.buffer())  # as the hook will
        before = state.feedback.residual(index)
        call = {"index": index, "x": bucket.buffer().clone(),
                "e": None if before is None else before.copy()}
        calls.append(call)

        def done(fut):
            call["y"] = fut.value().clone()
            call["e_new"] = state.feedback.residual(index).copy()
            return fut.value()

        return hook(state, bucket).then(done)

    return recording


@at_2_and_3
@pytest.mark.parametrize("hook,codec", [(hooks.int8_hook, "int8"), (hooks.onebit_hook, "onebit"),
                                        (hooks.codec_hook("topk:0.1"), "topk:0.1")],
                         ids=["int8", "onebit", "topk"])
def test_codec_hook_equals_codec_reference(hook, codec):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = ddp_of(wide_model(), bucket_cap_mb=0.001)   # two or more buckets
    state = hooks.CompressionState()
    calls: list[dict] = []
    ddp.register_comm_hook(state, recorder(hook, calls))
    train(ddp, shard(rank), n)
    assert state.codec.name == codec and state.iteration == STEPS
    assert len({c["index"] for c in calls}) >= 2
    assert len(calls) > STEPS

    comm = backend_of(dist.group.WORLD).comm
    for call in calls:
        fb = compression.ErrorFeedback()
        if call["e"] is not None:
            fb.store("k", call["e"].copy())
        x = call["x"].numpy()
        expected = compression.allreduce(x, op="average", comm=comm, compression=codec,
                                         feedback=fb, key="k")
        assert np.array_equal(call["y"].numpy(), expected)
        assert np.array_equal(call["e_new"], fb.residual("k"))
        # error feedback: n * result + sum of new residuals == sum of compensated inputs
        compensated = x + (0 if call["e"] is None else call["e"])
        totals = torch.from_numpy(np.stack([compensated, call["e_new"]]))
        dist.all_reduce(totals)
        torch.testing.assert_close(n * call["y"] + totals[1], totals[0], rtol=0, atol=1e-12)
        if n > 1:   # the result is an average, not this rank's own gradient
            assert not torch.allclose(call["y"], call["x"])


@at_2_and_3
def test_codec_hook_same_model_on_every_rank_and_close_to_exact():
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n)
    ddp = ddp_of(model(), bucket_cap_mb=0.0001)
    ddp.register_comm_hook(hooks.CompressionState(codec="int8:16"), hooks.compression_hook)
    train(ddp, shard(rank), n)
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat)
    for other in gathered:
        assert torch.equal(other, flat)
    assert_same_model(ddp.module, reference, atol=2e-2)


@at_2_and_3
def test_codec_hook_start_iter_runs_uncompressed_first():
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n, steps=2)
    ddp = ddp_of(model())
    state = hooks.CompressionState(start_iter=2)
    ddp.register_comm_hook(state, hooks.onebit_hook)
    train(ddp, shard(rank), n, steps=2)
    assert state.iteration == 2 and len(state.feedback) == 0
    assert_same_model(ddp.module, reference)


class FakeBucket:
    def __init__(self, params, index):
        self.params, self.i = params, index
        self.buf = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)

    def parameters(self):
        return self.params

    def buffer(self):
        return self.buf


def test_residuals_follow_parameters_across_bucket_rebuilds():
    """Bucket 0 = (a, q) and bucket 1 = (b) become bucket 0 = (b, a) and bucket 1 = (q):
    each parameter keeps its own residual (q's waits while bucket 0 is rebuilt first)."""
    a, b, q = (torch.zeros(k, dtype=torch.float64) for k in (2, 3, 4))
    state = hooks.CompressionState(codec="int8")
    old0, old1 = FakeBucket([a, q], 0), FakeBucket([b], 1)
    state._follow_layout(0, old0.parameters(), old0.buffer())
    state._follow_layout(1, old1.parameters(), old1.buffer())
    state.feedback.store(0, np.array([1., 2., 7., 7., 7., 7.]))
    state.feedback.store(1, np.array([3., 3., 3.]))
    new0, new1 = FakeBucket([b, a], 0), FakeBucket([q], 1)
    state._follow_layout(0, new0.parameters(), new0.buffer())
    assert state.feedback.residual(0).tolist() == [3., 3., 3., 1., 2.]
    state.feedback.store(0, np.array([4., 4., 4., 5., 5.]))   # bucket 0's next call
    state._follow_layout(1, new1.parameters(), new1.buffer())
    assert state.feedback.residual(1).tolist() == [7., 7., 7., 7.]
    state._follow_layout(0, new0.parameters(), new0.buffer())   # unchanged: kept as is
    assert state.feedback.residual(0).tolist() == [4., 4., 4., 5., 5.]


def test_loaded_residuals_wait_for_their_buckets_in_a_new_ddp():
    """A state saved after DDP's rebuild and loaded into a new DDP, whose first iteration
    runs on its initial buckets: each saved residual waits for a bucket of its layout and
    is then added to what that bucket holds by then (it failed the first backward with a
    residual of the wrong size)."""
    a, b, q = (torch.zeros(k, dtype=torch.float64) for k in (2, 3, 4))
    saved = hooks.CompressionState(codec="int8")
    for i, params in enumerate(([a, q], [b])):
        bucket = FakeBucket(params, i)
        saved._follow_layout(i, bucket.parameters(), bucket.buffer())
    saved.feedback.store(0, np.array([1., 2., 7., 7., 7., 7.]))
    saved.feedback.store(1, np.array([3., 3., 3.]))
    a2, b2, q2 = (torch.zeros(k, dtype=torch.float64) for k in (2, 3, 4))   # a new model
    state = hooks.CompressionState(codec="int8")
    state.load_state_dict(saved.state_dict())
    first = FakeBucket([q2, b2, a2], 0)          # the new DDP's initial bucket
    state._follow_layout(0, first.parameters(), first.buffer())
    assert state.feedback.residual(0) is None     # held back, not misapplied
    state.feedback.store(0, np.arange(9.0))       # its own residual: q2 0-3, b2 4-6, a2 7-8
    for i, params in enumerate(([a2, q2], [b2])):   # the rebuild gives the saved buckets
        bucket = FakeBucket(params, i)
        state._follow_layout(i, bucket.parameters(), bucket.buffer())
    assert state.feedback.residual(0).tolist() == [8., 10., 7., 8., 9., 10.]
    assert state.feedback.residual(1).tolist() == [7., 8., 9.]
    assert not state._pending
    same = hooks.CompressionState(codec="int8")   # loaded where its layout already is
    for i, params in enumerate(([a, q], [b])):
        bucket = FakeBucket(params, i)
        same._follow_layout(i, bucket.parameters(), bucket.buffer())
    same.load_state_dict(saved.state_dict())
    assert same.feedback.residual(1).tolist() == [3., 3., 3.] and not same._pending


class _Bucket(FakeBucket):
    """A bucket the hooks run on (DDP's ``GradBucket`` methods they call)."""

    def index(self):
        return self.i

    def is_last(self):
        return True


def test_codec_hook_without_error_feedback_keeps_no_residual():
    """``CompressionState(error_feedback=False)``: the bucket is averaged with the codec
    alone (bit for bit the codec's all-reduce without feedback) and nothing is kept."""
    rank = dist.get_rank()
    p = torch.zeros(300, dtype=torch.float64)
    bucket = _Bucket([p], 0)
    torch.manual_seed(7 + rank)
    bucket.buf.copy_(torch.randn(300, dtype=torch.float64) * (rank + 1))
    x = bucket.buf.numpy().copy()
    state = hooks.CompressionState(error_feedback=False)
    out = hooks.int8_hook(state, bucket).wait()
    assert out is bucket.buf and state.iteration == 1
    assert len(state.feedback) == 0 and state._layouts == {}
    expected = compression.allreduce(x, op="average", comm=backend_of(dist.group.WORLD).comm,
                                     compression="int8", feedback=False)
    assert np.array_equal(out.numpy(), expected)


def test_codec_hook_refuses_other_codec_and_no_codec():
    state = hooks.CompressionState()
    with pytest.raises(ValueError, match="needs CompressionState"):
        hooks.compression_hook(state, FakeBucket([torch.zeros(2)], 0))
    state.codec = compression.get_codec("int8")
    with pytest.raises(ValueError, match="needs its own state"):
        hooks.onebit_hook(state, FakeBucket([torch.zeros(2)], 0))
    with pytest.raises(ValueError, match="start_iter"):
        hooks.CompressionState(start_iter=-1)


# --- torch's own hooks -------------------------------------------------------------------
def _local_only(n: int) -> torch.nn.Module:
    """What rank 0 would train without communication (for the far-from check)."""
    net = model()
    train(net, shard(0), n)
    return net


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def renamed(hook):
    """``hook`` under another name: DDP refuses ``bf16_compress_hook`` and
    ``bf16_compress_wrapper_hook`` by name unless torch was built with CUDA and NCCL, though
    they run on any backend (torch/nn/parallel/distributed.py, ``_check_comm_hook``)."""
    def hook_on_cpu(state, bucket):
        return hook(state, bucket)
    return hook_on_cpu


@at_2_and_3
@pytest.mark.parametrize("name", ["fp16_compress_hook", "bf16_compress_hook", "bf16_wrapper"])
def test_torch_compress_hooks(name):
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n)
    ddp = ddp_of(model(), bucket_cap_mb=0.0001)
    if name.endswith("_compress_hook"):
        ddp.register_comm_hook(None, renamed(getattr(default_hooks, name)))
    else:   # a wrapper around torch's plain all-reduce hook
        wrapper = getattr(default_hooks, name.replace("wrapper", "compress_wrapper"))
        ddp.register_comm_hook(None, renamed(wrapper(
            lambda _state, bucket: default_hooks.allreduce_hook(None, bucket))))
    train(ddp, shard(rank), n)
    assert_same_model(ddp.module, reference, atol=5e-3)
    if n > 1:
        assert _max_diff(_local_only(n), reference) > 0.05


@at_2_and_3
def test_powersgd_full_rank_equals_allreduce():
    """Rank 6 >= every weight's smaller dimension, compression forced on every matrix
    (``min_compression_rate=0``), error feedback and warm start on: P Q^T is the averaged
    gradient itself, so the model equals the exact one (steps 0-1 plain all-reduce)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = model()
    train(reference, None, n)
    ddp = ddp_of(model(), bucket_cap_mb=25)
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=6, start_powerSGD_iter=2,
                                   min_compression_rate=0,
                                   batch_tensors_with_same_shape=True)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    train(ddp, shard(rank), n)
    assert state.iter == STEPS and state.total_numel_after_compression > 0
    assert_same_model(ddp.module, reference, atol=1e-9)


@at_2_and_3
def test_powersgd_low_rank_trains_alike_on_every_rank():
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = ddp_of(model())
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                   min_compression_rate=0)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    train(ddp, shard(rank), n)
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered)


START, PERIOD = 2, 2


def pairs(n: int) -> list[list[int]]:
    return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


@at_2_and_3
def test_post_local_sgd_with_periodic_model_averaging():
    """Steps < START: global all-reduce; then gradients averaged within pairs of ranks
    ({0,1}, {2,3}, {2} alone at n=3), each rank with its own momentum, and every PERIOD
    steps from START on the parameters averaged over all ranks. Reference: every rank's
    model simulated in one process."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local_sgd
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    rank, n = dist.get_rank(), dist.get_world_size()
    steps = 6
    nets = [model() for _ in range(n)]
    opts = [sgd(net) for net in nets]
    groups = pairs(n)
    for step in range(steps):
        x, y = batch(step, n)
        grads = []
        for r, (net, opt) in enumerate(zip(nets, opts)):
            opt.zero_grad()
            loss_of(net, x[shard(r)], y[shard(r)]).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for r, net in enumerate(nets):
            peers = (range(n) if step < START
                     else next(g for g in groups if r in g))
            for i, p in enumerate(net.parameters()):
                p.grad.copy_(sum(grads[s][i] for s in peers) / len(peers))
        for opt in opts:
            opt.step()
        if step >= START and (step - START) % PERIOD == 0:
            with torch.no_grad():
                for ps in zip(*(net.parameters() for net in nets)):
                    mean = sum(ps) / n
                    for p in ps:
                        p.copy_(mean)

    subgroup, _ = dist.new_subgroups_by_enumeration(groups)
    ddp = ddp_of(model(), bucket_cap_mb=0.0001)
    state = local_sgd.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                        start_localSGD_iter=START)
    ddp.register_comm_hook(state, local_sgd.post_localSGD_hook)
    averager = PeriodicModelAverager(period=PERIOD, warmup_steps=START)
    opt = sgd(ddp)
    for step in range(steps):
        x, y = batch(step, n)
        opt.zero_grad()
        loss_of(ddp, x[shard(rank)], y[shard(rank)]).backward()
        opt.step()
        averager.average_parameters(ddp.parameters())
    assert_same_model(ddp.module, nets[rank])
    if len(groups) > 1 and (steps - 1 - START) % PERIOD != 0:
        assert _max_diff(nets[0], nets[n - 1]) > 1e-6   # the ranks' models do differ
