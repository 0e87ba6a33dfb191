"""Hybrid parallelism: the process grid (core ``mpicoll.process_grid`` and
``hvd.process_grid``), ``process_set=`` on the model-level functions and ``join``, and
examples/hybrid_parallel.py against the single-process model, at every grid of the world
size."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicoll
import mpicoll.torch as hvd

pytestmark = pytest.mark.mpi

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hybrid_parallel.py"


def _grids(n: int) -> list[tuple[int, int]]:
    return [(n // tp, tp) for tp in range(1, n + 1) if n % tp == 0]


def _check_core_grid(dp: int, tp: int) -> None:
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    grid = mpicoll.process_grid(world, dp, tp)
    try:
        assert (grid.dp, grid.tp, grid.dp_rank, grid.tp_rank) == (dp, tp, me // tp, me % tp)
        row = [grid.dp_rank * tp + t for t in range(tp)]
        col = [d * tp + grid.tp_rank for d in range(dp)]
        assert grid.tp_comm.allgather(me) == row and grid.dp_comm.allgather(me) == col
        assert (grid.tp_comm.Get_rank(), grid.dp_comm.Get_rank()) == (grid.tp_rank,
                                                                      grid.dp_rank)
        x = np.arange(5, dtype=np.int64) * (me + 1)
        assert np.array_equal(mpicoll.allreduce(x, comm=grid.tp_comm),
                              np.arange(5) * sum(r + 1 for r in row))
    finally:
        grid.free()


def _check_torch_grid(dp: int, tp: int) -> None:
    me, n = hvd.rank(), hvd.size()
    grid = hvd.process_grid(dp, tp)
    try:
        rows = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
        cols = [list(range(t, n, tp)) for t in range(tp)]
        assert [ps.ranks for ps in grid.tensor_parallel_sets] == rows
        assert [ps.ranks for ps in grid.data_parallel_sets] == cols
        # registered in the same order on every rank: rows, then columns
        ids = [ps.process_set_id for ps in grid.tensor_parallel_sets + grid.data_parallel_sets]
        assert hvd.allgather_object(ids) == [ids] * n
        assert len({i for i in ids if i}) == len([i for i in ids if i])   # all distinct
        assert grid.tensor_parallel.rank() == grid.tp_rank == me % tp
        assert grid.data_parallel.rank() == grid.dp_rank == me // tp
        full = [ps for ps in ids if ps == 0]                  # a group of every rank
        assert len(full) == (dp == 1) + (tp == 1)
        for axis, ps, group in (("tp", grid.tensor_parallel, rows[me // tp]),
                                ("dp", grid.data_parallel, cols[me % tp])):
            got = hvd.allreduce(torch.tensor([me + 1, 7 * me]), op=hvd.Sum,
                                name=f"grid.{dp}x{tp}.{axis}", process_set=ps)
            assert got.tolist() == [sum(r + 1 for r in group), 7 * sum(group)]
    finally:
        grid.remove()


def _expect_everywhere(call, error: type, match: str) -> None:  # noqa: ANN001
    with pytest.raises(error, match=match):
        call()


def test_process_grid_layouts_reuse_and_errors():
    n, me = hvd.size(), hvd.rank()
    for dp, tp in _grids(n):
        _check_core_grid(dp, tp)
        _check_torch_grid(dp, tp)
    if n == 4:                                 # a set registered before is reused, kept
        mine = hvd.add_process_set([2, 3])
        grid = hvd.process_grid(2, 2)
        assert grid.tensor_parallel_sets[1] is mine and mine not in grid.registered
        grid.remove()
        assert mine.process_set_id is not None and hvd.remove_process_set(mine)
    world = MPI.COMM_WORLD
    for make in (lambda dp, tp: mpicoll.process_grid(world, dp, tp), hvd.process_grid):
        _expect_everywhere(lambda: make(n + 1, 1), ValueError,
                           rf"dp x tp = {n + 1} x 1 = {n + 1} does not equal the number of "
                           rf"ranks \({n}\)")
        _expect_everywhere(lambda: make(2, n), ValueError, "does not equal the number")
        _expect_everywhere(lambda: make(0, n), ValueError, "dp must be at least 1, not 0")
        _expect_everywhere(lambda: make(n, 1.0), ValueError, "tp must be an int")
        if n > 1:                              # rank 0 asks for another (valid) shape
            shape = (1, n) if me == 0 else (n, 1)
            _expect_everywhere(lambda: make(*shape), ValueError,
                               "ranks disagree on the grid shape: rank 0 has dp x tp = 1 x")
    hvd.process_grid(n, 1).remove()                          # still usable after errors


def _subsets(n: int) -> list[list[int]]:
    """Sets of different sizes, overlapping and disjoint (no duplicates, not all ranks)."""
    out: list[list[int]] = []
    for ranks in ([0, n - 1], list(range(1, n)), list(range(0, n, 2)), list(range(1, n, 2))):
        ranks = sorted(set(ranks))
        if ranks and len(ranks) < n and ranks not in out:
            out.append(ranks)
    return out


def _linear(seed: int) -> torch.nn.Linear:
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(6.0).view(2, 3) + 10 * seed)
        layer.bias.fill_(-seed)
    return layer


def _check_set_functions(ps: hvd.ProcessSet, rep: int) -> None:
    me = hvd.rank()
    root = ps.ranks[-1]                          # a global rank; the set's last
    obj = {"rank": me, "pad": "x" * (3 * me + rep)}
    assert hvd.allgather_object(obj, process_set=ps) == [
        {"rank": r, "pad": "x" * (3 * r + rep)} for r in ps.ranks]
    assert hvd.broadcast_object(obj, root_rank=root, process_set=ps) == {
        "rank": root, "pad": "x" * (3 * root + rep)}
    layer = _linear(me)
    hvd.broadcast_parameters(layer.state_dict(), root_rank=root, process_set=ps)
    assert torch.equal(layer.weight, _linear(root).weight)
    assert torch.equal(layer.bias, _linear(root).bias)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1 * (me + 1), momentum=0.5)
    if me == root:                               # only the root has momentum buffers
        layer(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=root, process_set=ps)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (root + 1))
    assert torch.equal(optimizer.state[layer.bias]["momentum_buffer"], torch.ones(2))
    outsider = next((r for r in range(hvd.size()) if r not in ps.ranks), None)
    if outsider is not None:                     # a root outside the set: every member
        with pytest.raises(ValueError, match=f"root_rank={outsider} is not in the process"):
            hvd.broadcast_object(obj, root_rank=outsider, process_set=ps)
    # join within the set: the first member joins at once, the others all-reduce first
    # (the joined rank adds zeros), so the last to join is another member (global rank)
    if me == ps.ranks[0]:
        last = hvd.join(process_set=ps)
    else:
        total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"before.join.{rep}",
                              process_set=ps)
        assert total.tolist() == [ps.size() - 1.0] * 2
        last = hvd.join(process_set=ps)
    assert last in ps.ranks and (ps.size() == 1 or last != ps.ranks[0])
    assert hvd.allgather_object(last, process_set=ps) == [last] * ps.size()


def _check_outsider(ps: hvd.ProcessSet) -> None:
    layer = _linear(0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    calls = [lambda: hvd.allgather_object(1, process_set=ps),
             lambda: hvd.broadcast_object(1, root_rank=ps.ranks[0], process_set=ps),
             lambda: hvd.broadcast_parameters(layer.state_dict(), ps.ranks[0], process_set=ps),
             lambda: hvd.broadcast_optimizer_state(optimizer, ps.ranks[0], process_set=ps),
             lambda: hvd.join(process_set=ps)]
    for call in calls:
        with pytest.raises(ValueError, match="this rank is not in ProcessSet"):
            call()


def test_model_functions_and_join_in_process_sets():
    n, me = hvd.size(), hvd.rank()
    sets = [hvd.add_process_set(ranks) for ranks in _subsets(n)]
    try:
        for rep in range(2):                     # every call twice
            for ps in [hvd.global_process_set, *sets]:
                if me in ps.ranks:
                    _check_set_functions(ps, rep)
                else:
                    _check_outsider(ps)
        hvd.barrier()
    finally:
        for ps in sets:
            hvd.remove_process_set(ps)


def _example():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("hybrid_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hybrid_example_matches_single_process_model():
    example = _example()
    args = example.make_parser().parse_args(["--check", "--steps", "3"])
    batch, hidden = args.batch, args.hidden
    for dp, tp in _grids(hvd.size()):
        # the batch splits over dp, the hidden layer over tp (n = 5, 7: not the defaults)
        args.batch, args.hidden = math.lcm(batch, dp), math.lcm(hidden, tp)
        worst = example.train(dp, tp, args)
        assert worst <= 1e-5, f"grid {dp}x{tp}: largest difference {worst:.2e}"
