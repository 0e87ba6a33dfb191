"""Hybrid data x tensor parallelism with process sets: a Megatron-style tensor-parallel MLP
trained data-parallel, checked against the same model in one process.

    mpirun -n 4 python examples/hybrid_parallel.py --dp 2 --tp 2 --check
    mpirun -n 8 python examples/hybrid_parallel.py --grids 4x2,2x4 --check

``hvd.process_grid(dp, tp)`` lays the ranks out as ``dp`` rows of ``tp`` consecutive ranks:
a row is a tensor-parallel group, a column a data-parallel group. The model is a replicated
input layer, then the tensor-parallel MLP of Megatron-LM (Shoeybi et al., 2019)::

    x -> Linear(D, H) -> f -> ColumnParallelLinear(H, F) -> tanh -> RowParallelLinear(F, H) -> g

Each rank of a row holds ``F / tp`` rows of the first weight (and of its bias) and the
matching ``F / tp`` columns of the second; ``g`` sums the row's partial outputs (all-reduce
in forward, identity in backward) before the second bias is added, and ``f`` is its mirror
(identity in forward, all-reduce of the input gradients in backward), so the replicated
input layer gets the whole gradient. Every all-reduce of ``f`` and ``g`` runs in the row's
process set. The global batch (``--batch`` rows) is split over the rows; gradients are
averaged over the column by ``hvd.DistributedOptimizer(..., process_set=column)``. Initial
weights are drawn per row (seed + row) and then broadcast within each column from its first
rank (``broadcast_parameters``/``broadcast_optimizer_state`` with ``process_set=``), so every
row starts from row 0's draw, which is what the reference starts from.

``--check``: every rank also trains the plain model (``torch.nn.Linear`` layers, the whole
global batch, the same optimizer) and compares, at every step, the loss (averaged over the
column), every gradient (after the column's average) and every weight after the step with
its own slice of the reference. The largest difference over all ranks is reduced to rank 0,
which prints it; the script exits with status 1 if it exceeds ``--tolerance`` (relative to
the larger of 1 and the reference value). ``--grids 4x2,2x4`` runs several grids in one
launch, one after the other.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mpicoll.torch as hvd  # noqa: E402


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity in forward, all-reduce (sum over the row) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, row: hvd.ProcessSet) -> torch.Tensor:
        ctx.row = row
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return hvd.allreduce(grad, op=hvd.Sum, name="tp.f.backward", process_set=ctx.row), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum over the row) in forward, identity in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, row: hvd.ProcessSet) -> torch.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="tp.g.forward", process_set=row)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class ReferenceMLP(nn.Module):
    """The model in one process: Linear(D, H), Linear(H, F), tanh, Linear(F, H)."""

    def __init__(self, d: int, h: int, f: int, seed: int) -> None:
        super().__init__()
        self.inp, self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, f), nn.Linear(f, h)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.inp(x))))


class TensorParallelMLP(nn.Module):
    """One rank's part of :class:`ReferenceMLP` in a row of ``tp`` ranks (position
    ``tp_rank``): the input layer and the last bias replicated, ``fc1`` split by output
    rows (column-parallel), ``fc2`` by input columns (row-parallel)."""

    def __init__(self, full: ReferenceMLP, row: hvd.ProcessSet, tp: int, tp_rank: int) -> None:
        super().__init__()
        self.row = row
        f = full.fc1.out_features
        if f % tp:
            raise ValueError(f"the hidden width {f} is not a multiple of tp={tp}")
        self.shard = slice(tp_rank * f // tp, (tp_rank + 1) * f // tp)
        self.inp = nn.Linear(full.inp.in_features, full.inp.out_features)
        self.fc1_weight = nn.Parameter(torch.empty(f // tp, full.fc1.in_features))
        self.fc1_bias = nn.Parameter(torch.empty(f // tp))
        self.fc2_weight = nn.Parameter(torch.empty(full.fc2.out_features, f // tp))
        self.fc2_bias = nn.Parameter(torch.empty(full.fc2.out_features))
        with torch.no_grad():
            for mine, whole in zip(self.ordered(), reference_slices(full, self.shard)):
                mine.copy_(whole)

    def ordered(self) -> list[nn.Parameter]:
        """The parameters in :func:`reference_slices`'s order."""
        return [self.inp.weight, self.inp.bias, self.fc1_weight, self.fc1_bias,
                self.fc2_weight, self.fc2_bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(self.inp(x), self.row)
        hidden = torch.tanh(F.linear(x, self.fc1_weight, self.fc1_bias))   # column-parallel
        partial = F.linear(hidden, self.fc2_weight)                         # row-parallel
        return ReduceFromTensorParallel.apply(partial, self.row) + self.fc2_bias


def reference_slices(full: ReferenceMLP, shard: slice) -> list[torch.Tensor]:
    """The parts of ``full``'s tensors that a rank holding ``shard`` of the hidden layer
    holds, in :class:`TensorParallelMLP`'s parameter order (also for their gradients)."""
    return [full.inp.weight, full.inp.bias, full.fc1.weight[shard], full.fc1.bias[shard],
            full.fc2.weight[:, shard], full.fc2.bias]


def global_batch(step: int, seed: int, rows: int, d: int, h: int) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """Step ``step``'s inputs and targets, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(rows, d, generator=generator)
    return x, torch.sin(x.sum(1, keepdim=True)).expand(rows, h) + 0.1 * torch.randn(
        rows, h, generator=generator)


def _difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest ``|got - expected| / max(1, |expected|)`` over the tensor pairs."""
    return max(float(((g - e).abs() / e.abs().clamp(min=1.0)).max())
               for g, e in zip((t.detach() for t in got), (t.detach() for t in expected)))


def train(dp: int, tp: int, args: argparse.Namespace) -> float:
    """Train a ``dp x tp`` grid for ``args.steps`` steps (collective over every rank).

    Returns:
        With ``args.check``, the largest difference to the single-process reference over all
        ranks, steps, losses, gradients and weights (the same on every rank); else 0.
    """
    grid = hvd.process_grid(dp, tp)
    try:
        return _train(grid, args)
    finally:
        grid.remove()


def _train(grid: hvd.ProcessSetGrid, args: argparse.Namespace) -> float:
    row, column = grid.tensor_parallel, grid.data_parallel
    if args.batch % grid.dp:
        raise ValueError(f"--batch {args.batch} is not a multiple of dp={grid.dp}")
    model = TensorParallelMLP(ReferenceMLP(args.inputs, args.width, args.hidden,
                                           args.seed + grid.dp_rank), row, grid.tp, grid.tp_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    # every row drew its own weights: the column's first rank (row 0) decides for all
    hvd.broadcast_parameters(model.state_dict(), root_rank=column.ranks[0], process_set=column)
    hvd.broadcast_optimizer_state(optimizer, root_rank=column.ranks[0], process_set=column)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         process_set=column)
    reference = reference_optimizer = None
    if args.check:
        reference = ReferenceMLP(args.inputs, args.width, args.hidden, args.seed)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr,
                                              momentum=args.momentum)
    local = args.batch // grid.dp
    mine = slice(grid.dp_rank * local, (grid.dp_rank + 1) * local)
    losses: list[float] = []
    differences: list[float] = []
    for step in range(args.steps):
        x, target = global_batch(step, args.seed, args.batch, args.inputs, args.width)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[mine]), target[mine])
        loss.backward()
        optimizer.synchronize()                   # gradients averaged over the column
        mean_loss = hvd.allreduce(loss.detach(), name="loss", process_set=column)
        losses.append(mean_loss.item())           # the column holds the whole global batch
        difference = 0.0
        if reference is not None:
            reference_optimizer.zero_grad()
            reference_loss = F.mse_loss(reference(x), target)
            reference_loss.backward()
            reference_optimizer.step()
            difference = _difference([mean_loss] + [p.grad for p in model.ordered()],
                                     [reference_loss.detach()] + _grads(reference, model.shard))
        with optimizer.skip_synchronize():
            optimizer.step()
        if reference is not None:
            difference = max(difference, _difference(
                model.ordered(), reference_slices(reference, model.shard)))
        differences.append(difference)
    # every rank's largest difference per step, in one all-reduce at the end
    worst = hvd.allreduce(torch.tensor(differences, dtype=torch.float64), op=hvd.Max,
                          name="differences")
    if hvd.rank() == 0:
        for step, (loss_value, step_worst) in enumerate(zip(losses, worst.tolist())):
            check = f"  max difference {step_worst:.1e}" if args.check else ""
            print(f"grid {grid.dp}x{grid.tp} step {step + 1}/{args.steps}: loss "
                  f"{loss_value:.6f}{check}", flush=True)
    return float(worst.max()) if args.steps else 0.0


def _grads(reference: ReferenceMLP, shard: slice) -> list[torch.Tensor]:
    """The reference's gradients, sliced as :func:`reference_slices`."""
    r = reference
    return [r.inp.weight.grad, r.inp.bias.grad, r.fc1.weight.grad[shard],
            r.fc1.bias.grad[shard], r.fc2.weight.grad[:, shard], r.fc2.bias.grad]


def parse_grids(args: argparse.Namespace, size: int) -> list[tuple[int, int]]:
    """The grids to run: ``--grids DPxTP,...``, else ``--dp``/``--tp`` (default: tp 2 when
    the number of ranks is even, else 1; dp the rest)."""
    if args.grids:
        grids = [spec.lower().split("x") for spec in args.grids.split(",")]
        if not all(len(g) == 2 and all(v.isdigit() for v in g) for g in grids):
            raise SystemExit(f"hybrid_parallel.py: --grids {args.grids!r}: give DPxTP,... "
                             f"(such as 4x2,2x4)")
        return [(int(dp), int(tp)) for dp, tp in grids]
    tp = args.tp or (2 if size % 2 == 0 else 1)
    return [(args.dp or size // tp, tp)]


def make_parser() -> argparse.ArgumentParser:
    """The command line (tests build their options from it too)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=0, help="data-parallel degree (rows)")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel degree (columns)")
    parser.add_argument("--grids", default="", help="several grids, run in turn: 4x2,2x4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=24, help="global batch (split over dp)")
    parser.add_argument("--inputs", type=int, default=5, help="input features D")
    parser.add_argument("--width", type=int, default=6, help="model width H")
    parser.add_argument("--hidden", type=int, default=24, help="MLP hidden width F (split "
                                                               "over tp)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--check", action="store_true",
                        help="compare with the single-process model at every step")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    return parser


def main() -> int:
    args = make_parser().parse_args()
    torch.set_num_threads(1)
    hvd.init()
    failed = False
    for dp, tp in parse_grids(args, hvd.size()):
        worst = train(dp, tp, args)
        if args.check and hvd.rank() == 0:
            verdict = "OK" if worst <= args.tolerance else "MISMATCH"
            print(f"grid {dp}x{tp}: largest difference to the single-process model over "
                  f"{args.steps} steps (loss, gradients, weights): {worst:.1e} "
                  f"(tolerance {args.tolerance:.0e}): {verdict}", flush=True)
        failed = failed or (args.check and worst > args.tolerance)
    hvd.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
