"""DistributedOptimizer: equivalence with one process on the whole batch, missing
gradients, backward_passes_per_step, skip_synchronize, compression, state broadcast."""
from __future__ import annotations

import warnings

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

B = 4           # samples per rank


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def full_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n * B, 6, generator=g), torch.randint(0, 3, (n * B,), generator=g)


def my_shard(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = hvd.rank()
    return x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("passes", [1, 2])
def test_equivalence_with_one_process_on_the_whole_batch(passes, mode):
    n = hvd.size()
    model = make_model(seed=hvd.rank())          # different on purpose: broadcast fixes it
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes)
    ref = make_model(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    assert torch.equal(flat(model), flat(ref))
    for step in range(4):
        x, y = full_batch(step, n)
        xs, ys = my_shard(x, y)
        opt.zero_grad()
        half = B // passes
        for k in range(passes):                  # accumulate locally, loss scaled by 1/passes
            (loss_fn(model, xs[k * half:(k + 1) * half], ys[k * half:(k + 1) * half])
             / passes).backward()
        opt.step()
        # the reduced gradients (and so the parameters) are bit-identical on every rank
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).unsqueeze(0)
        assert torch.equal(hvd.allgather(grads), grads.expand(n, -1))
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        assert torch.allclose(flat(model), flat(ref), atol=1e-6, rtol=1e-5), step
    assert isinstance(opt, torch.optim.SGD)
    assert "state" in opt.state_dict()


def test_missing_gradients_are_reduced_as_zeros(mode):
    n = hvd.size()
    torch.manual_seed(1)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    params = {"a." + k: v for k, v in a.named_parameters()}
    params.update({"b." + k: v for k, v in b.named_parameters()})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(a.parameters()) + list(b.parameters()),
                                                   lr=0.0),
                                   named_parameters=params.items())
    for rep in range(2):
        opt.zero_grad()
        out = a(torch.ones(1, 2))
        uses_b = hvd.rank() % 2 == 0
        if uses_b:
            out = out + b(torch.ones(1, 2))
        out.sum().backward()
        opt.step()
        users = sum(1 for r in range(n) if r % 2 == 0)
        assert torch.allclose(a.weight.grad, torch.ones(1, 2))
        assert torch.allclose(b.weight.grad, torch.full((1, 2), users / n))
        assert torch.allclose(b.bias.grad, torch.full((1,), users / n))


def test_skip_synchronize_with_gradient_clipping_and_fp16(mode):
    n = hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        x, y = full_batch(step, n)
        opt.zero_grad()
        loss_fn(model, *my_shard(x, y)).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        assert torch.allclose(flat(model), flat(ref), atol=2e-3), step


def test_gradients_set_to_none_or_replaced_by_the_user(mode):
    """model.zero_grad() sets .grad to None before backward; in bulk mode (reduced at
    step()) the user may also drop or assign a gradient after backward: a dropped one is
    reduced as zeros. The optimizer's zero_grad() makes them flat-buffer views again."""
    n = hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    ref = make_model()
    first, last = list(model.parameters())[0], list(model.parameters())[-1]
    for rep in range(2):
        x, y = full_batch(rep, n)
        model.zero_grad(set_to_none=True)
        loss_fn(model, *my_shard(x, y)).backward()
        if mode == "bulk":
            first.grad = None                                   # as if unused this step
            last.grad = torch.full_like(last, float(hvd.rank() + 1))
        opt.step()
        ref.zero_grad()
        loss_fn(ref, x, y).backward()
        if mode == "bulk":
            assert torch.equal(first.grad, torch.zeros_like(first))
            assert torch.allclose(last.grad, torch.full_like(last, (n + 1) / 2))
        else:
            assert torch.allclose(first.grad, list(ref.parameters())[0].grad, atol=1e-6)
    opt.zero_grad()
    assert all(p.grad is opt._views[p] for p in model.parameters())


def test_unused_parameter_after_model_zero_grad_is_reduced_as_zeros(mode):
    """After ``model.zero_grad()`` (gradients None) a parameter that only some ranks use
    has no gradient on the others: it is reduced as zeros there (the average counts
    them) and gets a zero-filled gradient."""
    n = hvd.size()
    torch.manual_seed(2)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    named = [("a." + k, v) for k, v in a.named_parameters()]
    named += [("b." + k, v) for k, v in b.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([v for _, v in named], lr=0.0),
                                   named_parameters=named)
    users = [r for r in range(n) if r % 2 == 0]
    for rep in range(2):
        a.zero_grad()
        b.zero_grad()
        out = a(torch.ones(1, 2))
        if hvd.rank() in users:
            out = out + (hvd.rank() + 1) * b(torch.ones(1, 2))
        out.sum().backward()
        opt.step()
        mean = sum(r + 1 for r in users) / n
        assert torch.allclose(a.weight.grad, torch.ones(1, 2))
        assert torch.allclose(b.weight.grad, torch.full((1, 2), mean)), rep
        assert torch.allclose(b.bias.grad, torch.full((1,), mean)), rep


def test_step_after_synchronize_without_skip_synchronize_warns(mode):
    """``synchronize()`` then ``step()`` outside ``skip_synchronize()`` reduces the
    gradients twice: Horovod's warning (an average of equal gradients is unchanged)."""
    n = hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref = make_model()
    x, y = full_batch(0, n)
    loss_fn(model, *my_shard(x, y)).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="without optimizer.skip_synchronize.* reduces "
                                         "gradients twice"):
        opt.step()
    loss_fn(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    opt.zero_grad()
    loss_fn(model, *my_shard(x, y)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # a plain step: no warning
        opt.step()


def test_layout_mismatch_raises_on_every_rank(mode):
    """Models whose parameter shapes differ across ranks (even with equal totals) fail
    with MismatchError everywhere; the adapter stays usable."""
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    shape = (2, 3) if hvd.rank() == 0 else (3, 2)
    w = torch.nn.Parameter(torch.ones(shape))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1),
                                   named_parameters=[("w", w)])
    w.sum().backward()
    with pytest.raises(hvd.MismatchError, match="layout|shape"):
        opt.step()
    assert torch.equal(hvd.allreduce(torch.ones(2), name="after.layout"), torch.ones(2))


def test_too_many_backward_passes_and_zero_grad_in_flight(mode):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = my_shard(*full_batch(0, hvd.size()))
    loss_fn(model, x, y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        loss_fn(model, x, y).backward()
    opt.step()                     # still consistent on every rank afterwards
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    opt.step()


def test_parameter_name_errors():
    model = make_model()
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 backward_passes_per_step=0)


def test_broadcast_parameters_and_optimizer_state():
    root = hvd.size() - 1
    model = make_model(seed=hvd.rank())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if hvd.rank() == root:                       # only the root has optimizer state
        for step in range(2):
            opt.zero_grad()
            loss_fn(model, *full_batch(step, 1)).backward()
            opt.step()
        opt.param_groups[0]["lr"] = 0.123
    hvd.broadcast_parameters(model.named_parameters(), root_rank=root)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    expect = hvd.broadcast_object((flat(model), opt.state_dict()), root_rank=root)
    assert torch.equal(flat(model), expect[0])
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == 0.123
    for key, value in expect[1]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(state["state"][key][name], tensor), (key, name)
