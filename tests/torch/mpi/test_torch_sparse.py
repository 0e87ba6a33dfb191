"""Sparse gradients (issue 10): ``hvd.sparse_allreduce_async`` against a dense reference
(every rank's dense tensor all-gathered and stacked, then summed or averaged), and
``DistributedOptimizer`` with ``nn.Embedding(sparse=True)`` against one process on the
global batch, against ``sparse_as_dense=True``, in a process set, with SparseAdam; errors
on the calling rank."""
from __future__ import annotations

import pytest
import torch

import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

ROWS, COLS = 9, 3


def _sparse_of(rank: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank-dependent, uncoalesced (a duplicate index), shape (ROWS, COLS), one sparse
    dimension: row 4 on every rank (overlap), rows r and r+1 on rank r (overlap with the
    neighbours, disjoint from farther ranks); the last of several ranks has no nonzero."""
    if hvd.size() > 1 and rank == hvd.size() - 1:
        return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long),
                                       torch.empty((0, COLS), dtype=dtype), (ROWS, COLS),
                                       check_invariants=True)
    rows = torch.tensor([[rank % ROWS, 4, (rank + 1) % ROWS, 4]])
    gen = torch.Generator().manual_seed(10 + rank)
    values = torch.randint(-50, 50, (4, COLS), generator=gen).to(dtype)
    if dtype.is_floating_point:
        values = values + torch.rand(4, COLS, generator=gen, dtype=dtype)
    return torch.sparse_coo_tensor(rows, values, (ROWS, COLS), check_invariants=True)


def _dense_reference(dense: torch.Tensor, op, name: str, process_set=None) -> torch.Tensor:
    """Sum or mean over ranks of every rank's dense tensor (one all-gather, then torch)."""
    stacked = hvd.allgather(dense.unsqueeze(0), name=name, process_set=process_set)
    if op == hvd.Sum:
        return stacked.sum(0)
    if dense.dtype.is_floating_point:
        return stacked.mean(0)
    return torch.div(stacked.sum(0), stacked.shape[0], rounding_mode="trunc")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64])
@pytest.mark.parametrize("op", ["Average", "Sum"])
def test_sparse_allreduce_equals_dense_reference(op, dtype):
    op = getattr(hvd, op)
    mine = _sparse_of(hvd.rank(), dtype)
    handle = hvd.sparse_allreduce_async(mine, name=f"sparse.{op}.{dtype}", op=op)
    result = handle()                                   # Horovod's way: call the handle
    expected = _dense_reference(mine.to_dense(), op, f"ref.{op}.{dtype}")
    assert result.is_sparse and result.is_coalesced() and result.dtype == dtype
    assert result.shape == (ROWS, COLS)
    if dtype.is_floating_point:
        assert torch.allclose(result.to_dense(), expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(result.to_dense(), expected)
    bits = hvd.allgather_object((result.indices().tolist(), result.values().tolist()))
    assert all(b == bits[0] for b in bits)               # the same result on every rank


def test_sparse_allreduce_two_sparse_dims_synchronize_and_poll():
    """A fully sparse 2-D tensor (sparse_dim=2), waited for with hvd.synchronize."""
    me = hvd.rank()
    dense = torch.zeros(5, 4)
    dense[me % 5, (me + 1) % 4] = me + 1.5
    dense[2, 2] = 1.0 + me                              # on every rank
    mine = dense.to_sparse()
    assert mine.sparse_dim() == 2
    handle = hvd.sparse_allreduce_async(mine, "sparse.2d", hvd.Sum)
    while not hvd.poll(handle):
        pass
    result = hvd.synchronize(handle)
    assert result.sparse_dim() == 2
    assert torch.allclose(result.to_dense(), _dense_reference(dense, hvd.Sum, "ref.2d"))
    with pytest.raises(ValueError, match="already synchronized"):
        handle()


def test_no_rank_has_a_nonzero():
    empty = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long),
                                    torch.empty((0, 2)), (6, 2), check_invariants=True)
    result = hvd.synchronize(hvd.sparse_allreduce_async(empty, "sparse.empty", hvd.Average))
    assert result.is_sparse and result.shape == (6, 2) and result._nnz() == 0


def test_sparse_allreduce_in_a_process_set():
    n = hvd.size()
    if n < 3:
        pytest.skip("a process set of 2 out of at least 3 ranks")
    me = hvd.rank()
    ps = hvd.add_process_set([0, n - 1])
    try:
        mine = _sparse_of(me)
        if me in ps.ranks:
            result = hvd.sparse_allreduce_async(mine, "sparse.ps", hvd.Average,
                                                process_set=ps)()
            expected = _dense_reference(mine.to_dense(), hvd.Average, "ref.ps", ps)
            assert torch.allclose(result.to_dense(), expected, atol=1e-12)
            # rank n-1 has no nonzero: the average of rank 0's values over 2 ranks
            assert torch.allclose(result.to_dense(), _sparse_of(0).to_dense() / 2,
                                  atol=1e-12)
        else:
            with pytest.raises(ValueError, match="this rank is not in"):
                hvd.sparse_allreduce_async(mine, "sparse.ps", hvd.Average, process_set=ps)
    finally:
        hvd.remove_process_set(ps)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_errors_on_the_calling_rank_before_anything_is_sent():
    """Each rank makes a different wrong call; then a valid one still matches everywhere
    (nothing was submitted by the wrong ones)."""
    me = hvd.rank()
    good = _sparse_of(me)
    wrong = [
        (TypeError, "sparse COO", lambda: hvd.sparse_allreduce_async(good.to_dense(), "w")),
        (ValueError, "Average or op=Sum", lambda: hvd.sparse_allreduce_async(good, "w",
                                                                              hvd.Max)),
        (ValueError, "Average or op=Sum", lambda: hvd.sparse_allreduce_async(good, "w",
                                                                              hvd.Adasum)),
        (TypeError, "sparse COO", lambda: hvd.sparse_allreduce_async(
            torch.eye(3).to_sparse_csr(), "w")),
        (TypeError, "bool", lambda: hvd.sparse_allreduce_async(
            torch.eye(3, dtype=torch.bool).to_sparse(), "w", hvd.Sum)),
        (TypeError, "torch.Tensor", lambda: hvd.sparse_allreduce_async([1, 2], "w")),
    ]
    for i in range(len(wrong)):
        error, message, call = wrong[(i + me) % len(wrong)]
        with pytest.raises(error, match=message):
            call()
    result = hvd.sparse_allreduce_async(good, "sparse.after.errors", hvd.Sum)()
    assert torch.allclose(result.to_dense(), _dense_reference(good.to_dense(), hvd.Sum,
                                                                 "ref.errors"))


def test_ranks_with_different_sizes_raise_mismatch_on_every_rank():
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    me = hvd.rank()
    mine = torch.sparse_coo_tensor([[0, 1]], torch.ones(2, 2), (4 + (me == 0), 2),
                                   check_invariants=True)
    handle = hvd.sparse_allreduce_async(mine, "sparse.sizes", hvd.Sum)
    with pytest.raises(hvd.MismatchError, match="disagree on the size"):
        handle()
    hvd.barrier()


# ------------------------------------------------------------------ DistributedOptimizer
VOCAB, DIM, N_GLOBAL = 12, 4, 12


class EmbeddingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True).double()
        self.lin = torch.nn.Linear(DIM, 2).double()

    def loss(self, idx: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        """``scale`` times the summed squared error; an empty batch never touches the
        embedding (its gradient stays None on that rank)."""
        if idx.numel() == 0:
            return (self.lin.weight * 0).sum()
        return ((self.lin(self.emb(idx)) - y) ** 2).sum() * scale


def _batch(step: int, counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of ``step`` cut into ``counts`` rows per member (indices repeat,
    some rows of the table are never used)."""
    gen = torch.Generator().manual_seed(200 + step)
    idx = torch.randint(0, VOCAB - 3, (sum(counts),), generator=gen)
    y = torch.randn(sum(counts), 2, generator=gen, dtype=torch.float64)
    return list(zip(idx.split(counts), y.split(counts)))


def _counts(step: int, n: int) -> list[int]:
    """Uneven shards; from step 1 on, the last of several members gets none."""
    counts = [(r + step) % 3 + 1 for r in range(n)]
    if n > 1 and step > 0:
        counts[-1] = 0
    return counts


def _train(ranks: list[int], steps: int, passes: int = 1, process_set=None,
           model_zero_grad: bool = False, **options) -> EmbeddingModel:
    """Train on this rank's shards with DistributedOptimizer(SGD); loss scaled so that
    the average over members is the global batch's summed error / N_GLOBAL. With
    ``model_zero_grad`` each step starts with ``model.zero_grad()`` (gradients None)
    instead of the optimizer's."""
    n, me = len(ranks), ranks.index(hvd.rank())
    model = EmbeddingModel()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, process_set=process_set,
                                   **options)
    for step in range(steps):
        (model if model_zero_grad else opt).zero_grad()
        idx, y = _batch(step, _counts(step, n))[me]
        for part_idx, part_y in zip(idx.tensor_split(passes), y.tensor_split(passes)):
            model.loss(part_idx, part_y, n / N_GLOBAL).backward()
        opt.step()
    return model


def _reference(n: int, steps: int) -> EmbeddingModel:
    model = EmbeddingModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        parts = _batch(step, _counts(step, n))
        idx = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        model.loss(idx, y, 1.0 / N_GLOBAL).backward()
        opt.step()
    return model


def _assert_same(model: torch.nn.Module, ref: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=atol), (name, (p - q).abs().max())


@pytest.mark.parametrize("passes", [1, 2])
def test_optimizer_sparse_embedding_equals_one_process(passes, mode):
    ranks = list(range(hvd.size()))
    model = _train(ranks, steps=3, passes=passes)
    assert model.emb.weight.grad.is_sparse                 # reduced sparse, not densified
    assert not model.lin.weight.grad.is_sparse
    dense_bytes = 8 * sum(p.numel() for p in model.lin.parameters())
    assert model.lin.weight.grad.untyped_storage().nbytes() == dense_bytes  # no table in it
    _assert_same(model, _reference(len(ranks), steps=3))
    if passes == 1 and mode == "bulk":
        dense = _train(ranks, steps=3, sparse_as_dense=True)
        assert dense.emb.weight.grad.is_sparse                 # reduced dense, handed back
        _assert_same(model, dense)


def test_optimizer_sparse_in_a_process_set():
    n = hvd.size()
    if n < 3:
        pytest.skip("a process set of 2 out of at least 3 ranks")
    ranks = [0, n - 1]
    ps = hvd.add_process_set(ranks)
    try:
        if hvd.rank() in ranks:
            model = _train(ranks, steps=2, process_set=ps)
            _assert_same(model, _reference(len(ranks), steps=2))
    finally:
        hvd.remove_process_set(ps)


def test_sparse_adam_for_the_embedding_adam_for_the_rest():
    """Users pair SparseAdam (sparse gradients only) with a dense optimizer."""
    n, me = hvd.size(), hvd.rank()

    def optimizers(model: EmbeddingModel, wrap: bool) -> list:
        sparse = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
        dense = torch.optim.Adam(model.lin.parameters(), lr=0.01)
        if not wrap:
            return [sparse, dense]
        return [hvd.DistributedOptimizer(sparse, named_parameters=model.emb.named_parameters(
                    prefix="emb")),
                hvd.DistributedOptimizer(dense, named_parameters=model.lin.named_parameters(
                    prefix="lin"))]

    model, ref = EmbeddingModel(), EmbeddingModel()
    opts, ref_opts = optimizers(model, True), optimizers(ref, False)
    for step in range(3):
        parts = _batch(step, _counts(step, n))
        for opt in opts + ref_opts:
            opt.zero_grad()
        model.loss(parts[me][0], parts[me][1], n / N_GLOBAL).backward()
        ref.loss(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                 1.0 / N_GLOBAL).backward()
        for opt in opts + ref_opts:
            opt.step()
    _assert_same(model, ref)


def test_optimizer_op_sum_sums_sparse_gradients():
    """op=Sum: the embedding's reduced gradient is the sum of every rank's dense one."""
    me = hvd.rank()
    model, twin = EmbeddingModel(), EmbeddingModel()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    idx, y = torch.tensor([me % VOCAB, 1, 1]), torch.ones(3, 2, dtype=torch.float64) * me
    model.loss(idx, y, 1.0).backward()
    twin.loss(idx, y, 1.0).backward()
    opt.synchronize()
    assert model.emb.weight.grad.is_sparse
    expected = _dense_reference(twin.emb.weight.grad.to_dense(), hvd.Sum, "ref.opt")
    assert torch.allclose(model.emb.weight.grad.to_dense(), expected, atol=1e-12)
    with opt.skip_synchronize():
        opt.step()


def test_sparse_as_dense_after_model_zero_grad(mode):
    """``model.zero_grad()`` leaves the gradients None, so backward stores the embedding's
    gradient sparse (and none on a rank whose shard is empty): ``sparse_as_dense=True``
    reduces it dense all the same (zeros for none) and hands it back sparse."""
    ranks = list(range(hvd.size()))
    model = _train(ranks, steps=3, sparse_as_dense=True, model_zero_grad=True)
    assert model.emb.weight.grad.is_sparse
    _assert_same(model, _reference(len(ranks), steps=3))


def test_a_codec_compressor_refuses_a_sparse_gradient():
    """A codec compressor reduces dense flat buffers: a sparse gradient (stored after
    ``model.zero_grad()``) is refused with TypeError on every rank, before anything is
    sent, naming ``sparse_as_dense=True``."""
    model = EmbeddingModel()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.int8)
    model.zero_grad()
    model.loss(torch.tensor([1, 2]), torch.ones(2, 2, dtype=torch.float64), 1.0).backward()
    assert model.emb.weight.grad.is_sparse
    with pytest.raises(TypeError, match=r"sparse gradient is reduced only with "
                                        r"DistributedOptimizer\(..., sparse_as_dense=True\)"):
        opt.step()
    assert torch.equal(hvd.allreduce(torch.ones(2), name="after.codec.sparse"), torch.ones(2))


def test_zero_grad_keeps_or_drops_a_sparse_gradient():
    """``zero_grad(set_to_none=False)`` zeros a sparse parameter's reduced gradient in
    place (torch's semantics); the default ``set_to_none=True`` drops it."""
    model = EmbeddingModel()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model.loss(torch.tensor([hvd.rank() % VOCAB, 1]),
               torch.ones(2, 2, dtype=torch.float64), 1.0).backward()
    opt.step()
    grad = model.emb.weight.grad
    assert grad.is_sparse and bool(grad.to_dense().any())
    opt.zero_grad(set_to_none=False)
    assert model.emb.weight.grad is grad and not bool(grad.to_dense().any())
    opt.zero_grad()
    assert model.emb.weight.grad is None
