"""Horovod 0.28's contract where mpicoll.torch differed (issue 26), and how the engine
fails at once, instead of hanging, when ranks' paths diverge.

Each test names the Horovod behaviour it pins; references are computed here from every
rank's known data.
"""
from __future__ import annotations

import pytest
import torch

import mpicoll.torch as hvd
from mpicoll.torch import mpi_ops

pytestmark = pytest.mark.mpi


# ----------------------------------------------------------------- DistributedOptimizer
def test_parameter_names_without_named_parameters():
    """Horovod scripts read ``optimizer._parameter_names`` (parameter -> name) to see the
    names generated when ``named_parameters`` is not given."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    assert opt._parameter_names == {model[0].weight: "allreduce.noname.0.0",
                                    model[0].bias: "allreduce.noname.0.1",
                                    model[1].weight: "allreduce.noname.1.0",
                                    model[1].bias: "allreduce.noname.1.1"}
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert sorted(named._parameter_names.values()) == ["0.bias", "0.weight", "1.bias",
                                                        "1.weight"]


def test_optimizer_of_a_process_set_trains_locally_outside_it():
    """``DistributedOptimizer(..., process_set=s)`` on a rank not in ``s``: Horovod's
    optimizer registers no hooks there and ``step()`` uses the local gradient."""
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs a rank outside the set")
    inside = hvd.add_process_set([0])
    try:
        layer = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            layer.weight.fill_(1.0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0),
                                       named_parameters=layer.named_parameters(),
                                       process_set=inside)
        for _ in range(2):                              # twice: nothing left in flight
            opt.zero_grad()
            layer(torch.full((1, 2), float(me + 1))).sum().backward()
            opt.step()
        # The outside ranks sent nothing: unnamed global operations still match.
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
        # A set of one: every rank's update is its own gradient, me + 1 per step.
        assert torch.equal(layer.weight, torch.full((1, 2), 1.0 - 2 * (me + 1)))
        assert total == n
    finally:
        hvd.remove_process_set(inside)


def test_sparse_as_dense_hands_the_optimizer_a_sparse_gradient():
    """``sparse_as_dense=True`` reduces an embedding's sparse gradient as a dense tensor
    and, as Horovod, gives it back sparse: ``SparseAdam`` (sparse gradients only) works."""
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(5)
    emb = torch.nn.Embedding(6, 2, sparse=True).double()
    start = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=True)
    for step in range(2):
        opt.zero_grad()
        rows = torch.tensor([me % 6, (step + 3) % 6])
        emb(rows).sum().backward()
        opt.step()
        grad = emb.weight.grad
        assert grad.is_sparse
        expected = torch.zeros(6, 2, dtype=torch.float64)
        for r in range(n):                               # the average of every rank's
            expected[r % 6] += 1.0 / n                   # one-hot rows
            expected[(step + 3) % 6] += 1.0 / n
        assert torch.allclose(grad.to_dense(), expected)
    assert not torch.equal(emb.weight, start)


# ------------------------------------------------------------------- exception classes
def test_alltoall_splits_of_the_wrong_type_raise_value_error():
    """Horovod raises ``ValueError`` for float splits; mpicoll's error is also a
    ``TypeError`` (what it raised before)."""
    splits = torch.ones(hvd.size(), dtype=torch.float32)
    with pytest.raises(ValueError, match="splits must hold integers") as info:
        hvd.alltoall(torch.ones(hvd.size()), splits)
    assert isinstance(info.value, TypeError)
    with pytest.raises(ValueError):
        hvd.alltoall_async(torch.ones(hvd.size()), [1.5] * hvd.size())
    # nothing was submitted: the next unnamed all-to-all matches on every rank
    assert torch.equal(hvd.alltoall(torch.ones(hvd.size())), torch.ones(hvd.size()))


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_reducescatter_with_an_unsupported_op_raises_runtime_error(op):
    """Horovod raises ``RuntimeError``; mpicoll's error is also a ``ValueError``."""
    tensor = torch.ones(hvd.size() * 2)
    for call in (lambda: hvd.reducescatter(tensor, op=getattr(hvd, op)),
                 lambda: hvd.reducescatter_async(tensor, op=getattr(hvd, op)),
                 lambda: hvd.grouped_reducescatter([tensor], op=getattr(hvd, op))):
        with pytest.raises(RuntimeError, match="op=Average or op=Sum") as info:
            call()
        assert isinstance(info.value, ValueError)


# ----------------------------------------------------------------------------- join
def test_allgather_while_a_rank_has_joined_fails_whatever_the_names():
    """Horovod: an all-gather fails while a rank has joined. Here the ranks that have not
    joined give it different names (as unnamed operations get when ranks took different
    paths before): it fails on each at once, and ``join`` still completes everywhere."""
    n, me = hvd.size(), hvd.rank()
    if n < 3:
        pytest.skip("needs two ranks that have not joined")
    for first in range(n):
        if me == first:
            last = hvd.join()
        else:
            with pytest.raises(RuntimeError, match="not supported with join"):
                hvd.allgather(torch.ones(2, 1), name=f"joined.{first}.{me}")
            last = hvd.join()
        assert last != first
        assert hvd.allgather_object(last) == [last] * n


# ------------------------------------------------------------------ diverged numbering
def test_diverged_unnamed_numbering_fails_once_then_matches_again():
    """One rank skips an unnamed number (as when it raised after naming an operation, or
    took another path): the next unnamed operation fails on every rank at once, naming
    the divergence, and the numbering is realigned so the one after it matches."""
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    if me == 0:
        mpi_ops.request_name("allreduce", None)          # rank 0 skips one number
    with pytest.raises(hvd.CollectiveError, match="numbering of unnamed allreduce"):
        hvd.allreduce(torch.ones(1), op=hvd.Sum)
    for _ in range(2):
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n


def test_operations_in_different_orders_still_match_by_name():
    """Asynchronous submission in different orders on different ranks is legitimate: named
    requests match by name, unnamed ones by number, whatever the order of waiting."""
    n, me = hvd.size(), hvd.rank()
    a = hvd.allreduce_async(torch.ones(2) * (me + 1), op=hvd.Sum)   # unnamed, same order
    if me % 2:
        h1 = hvd.allreduce_async(torch.ones(3), name="order.x", op=hvd.Sum)
        h2 = hvd.allgather_async(torch.ones(1, 1) * me, name="order.y")
    else:
        h2 = hvd.allgather_async(torch.ones(1, 1) * me, name="order.y")
        h1 = hvd.allreduce_async(torch.ones(3), name="order.x", op=hvd.Sum)
    first, second = (h1, h2) if me % 2 else (h2, h1)
    results = {first: hvd.synchronize(first), second: hvd.synchronize(second)}
    assert results[h1].tolist() == [n] * 3
    assert results[h2].flatten().tolist() == list(range(n))
    assert hvd.synchronize(a).tolist() == [n * (n + 1) / 2] * 2


def test_add_process_set_while_another_rank_waits_fails_instead_of_hanging():
    """A rank blocked in an operation the others never submit, while they register a
    process set: both sides fail at once (registration is negotiated by the engine, so
    its waiting ranks count as blocked), and the job goes on."""
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    with pytest.raises(hvd.CollectiveError, match="can never complete"):
        if me == 0:
            hvd.allreduce(torch.ones(1), name="only.rank.0")
        else:
            hvd.add_process_set([0])
    first = hvd.add_process_set([0])                     # every rank: works again
    try:
        if me == 0:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=first).item() == 1
    finally:
        hvd.remove_process_set(first)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.sets").item() == n


def test_removing_different_process_sets_raises_on_every_rank():
    """Horovod removes a set once every rank has marked the same one; here each rank
    removed its own and returned True, leaving the ranks' registries different (a later
    operation on either set failed, pointing elsewhere)."""
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs 2 ranks")
    a, b = hvd.add_process_set([0]), hvd.add_process_set([n - 1])
    with pytest.raises(ValueError, match="ranks disagree on the process set"):
        hvd.remove_process_set(a if me == 0 else b)
    assert hvd.remove_process_set(a) and hvd.remove_process_set(b)  # both still there
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.removal").item() == n


def test_in_place_operations_return_the_tensor_itself():
    """As Horovod's (its handle map holds the tensor): ``allreduce_``, ``broadcast_``,
    ``grouped_allreduce_`` and ``synchronize`` of their async forms return the very tensor
    passed, which keeps requiring grad (they returned a detached alias)."""
    n, rank = hvd.size(), hvd.rank()
    t = torch.full((3,), float(rank + 1))
    assert hvd.allreduce_(t, op=hvd.Sum) is t
    assert torch.equal(t, torch.full((3,), float(n * (n + 1) // 2)))
    assert hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Max)) is t
    assert hvd.broadcast_(t, 0) is t
    group = [torch.ones(2), torch.full((1,), float(rank))]
    out = hvd.grouped_allreduce_(group, op=hvd.Sum)
    assert len(out) == 2 and all(o is g for o, g in zip(out, group))
    assert torch.equal(group[1], torch.full((1,), float(n * (n - 1) // 2)))
    x = torch.ones(3, requires_grad=True) * 1.0
    with torch.no_grad():
        y = hvd.allreduce_(x, op=hvd.Sum)
    assert y is x and y.requires_grad


def test_a_second_synchronize_returns_none():
    """Horovod's ``synchronize`` returns at once, with ``None``, for a handle already
    synchronized (it raised); a handle never issued still raises."""
    handle = hvd.allreduce_async(torch.ones(1), op=hvd.Sum)
    assert torch.equal(hvd.synchronize(handle), torch.full((1,), float(hvd.size())))
    assert hvd.synchronize(handle) is None
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(10 ** 9)
