"""DDP over "mpicoll" under ULFM (issue 34), run by test_ddp_elastic.py.

``ddp``: DDP built once, trained inside ``hvd.elastic.run`` with a ``TorchState`` and no
``hvd.init()``; the last rank is killed at step ``KILL_AT`` of ``STEPS``, at the size the
job started with. Each survivor
prints its rank and size after the run, a digest of its parameters, what
``dist.all_reduce`` of a one sums to, and (rank 0) how far the parameters are from a
float64 single-process reference that restarts at the survivors' size from the commit the
survivors went back to (the gradient of each rank's batch averaged over that many ranks).

Then (``ddp``) the last survivor is killed too, and the others use
``dist.shrink_group`` after a caught ``ProcessFailedError``: the new default group's
all-reduce and a DDP step on it.

``grow ddp|module`` (any MPI with ``MPI_Comm_spawn``; no failure; the state holds the DDP
module or the module it wraps): a job of 2 whose discovery (a
callable polled by rank 0) reports 3 slots once rank 0 reaches step ``KILL_AT`` grows to
3: the new process runs this program from its start (its DDP module built there, before
the elastic function), every rank trains to ``STEPS`` at size 3. Each rank prints
``DONE`` (with its parameters' digest and what ``dist.all_reduce`` of a one sums to), the
new one ``JOINED``; rank 0 prints ``GROWREF``: how far its parameters are from a float64
single-process reference of 2 ranks' mean gradient up to the commit that grew and 3
ranks' after it, and from one that kept averaging over 2 (far off, or the check could
not fail).

``raise``: rank 1 raises ``RuntimeError`` at step ``KILL_AT`` (a rank that raises is a
lost rank); ``raise-all``: every rank raises there (the job ends, status non-zero);
``raise-twice``: rank 1 raises at step ``KILL_AT`` and again (another process) at step
``2 * KILL_AT`` (for ``MPICOLL_ELASTIC_RESET_LIMIT``).
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mpicoll
import mpicoll.torch as hvd

STEPS, KILL_AT, LR = 60, 20, 0.05


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(8, 6, generator=g, dtype=torch.float64),
            torch.randn(8, 2, generator=g, dtype=torch.float64))


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 2)).double()


def optimizer_of(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def reference(model_state: dict, opt_state: dict, first: int, size: int,
              divisor: int | None = None, stop: int = STEPS) -> torch.nn.Module:
    """Steps ``first..stop-1`` at ``size`` ranks, in one process: each step's gradient is
    the sum over ranks 0..size-1 of their batches' gradients over ``divisor`` (default
    ``size``: the mean). The model's ``optimizer`` attribute is its optimizer."""
    model = make_model()
    model.load_state_dict(model_state)
    opt = optimizer_of(model.parameters())
    opt.load_state_dict(opt_state)
    model.optimizer = opt
    for step in range(first, stop):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(size):
            model.zero_grad()
            x, y = batch(r, step)
            F.mse_loss(model(x), y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / (divisor or size)
        opt.step()
    return model


def print_reference_diffs(model: torch.nn.Module, at_reset: dict, start: int) -> None:
    """Print ``REFDIFF`` and how far ``model`` is from the reference restarted from the
    commit ``at_reset`` (``step``, ``size``, ``model``, ``opt``) and from one dividing by
    the old size ``start`` (as a reducer that kept it would): that one must be far off, or
    the check could not fail."""
    diffs = []
    for divisor in (at_reset["size"], start):
        ref = reference(at_reset["model"], at_reset["opt"], at_reset["step"],
                        at_reset["size"], divisor)
        diffs.append(max((a - b).abs().max().item()
                         for a, b in zip(model.parameters(), ref.parameters())))
    print(f"REFDIFF {diffs[0]:.3e} {diffs[1]:.3e}", flush=True)


def train_step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, state) -> None:
    """One DDP step on this rank's batch of ``state.step``, then a commit."""
    opt.zero_grad()
    x, y = batch(dist.get_rank(), state.step)
    F.mse_loss(ddp(x), y).backward()
    opt.step()
    state.step += 1
    state.commit()


def print_done(model: torch.nn.Module, reset_step: int) -> None:
    """``DONE <rank> <size> <digest> <sum of ones over the group> <reset_step>``."""
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"DONE {dist.get_rank()} {dist.get_world_size()} {digest(model)} "
          f"{int(total.item())} {reset_step}", flush=True)


def train_ddp(mode: str) -> None:
    dist.init_process_group("mpicoll")
    start = dist.get_world_size()
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = optimizer_of(ddp.parameters())
    state = hvd.elastic.TorchState(model=ddp, optimizer=opt, step=0)
    at_reset: dict = {}

    def on_reset() -> None:
        at_reset.update(step=state.step, size=dist.get_world_size(),
                        model={k: v.clone() for k, v in model.state_dict().items()},
                        opt=opt.state_dict())

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state) -> None:
        while state.step < STEPS:
            if state.step == KILL_AT and dist.get_world_size() == start:
                if mode == "ddp" and dist.get_rank() == start - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "raise-all" or (mode in ("raise", "raise-twice")
                                           and dist.get_rank() == 1):
                    raise RuntimeError(f"rank {dist.get_rank()} raises at step {state.step}")
            if (mode == "raise-twice" and state.step == 2 * KILL_AT
                    and dist.get_world_size() == start - 1 and dist.get_rank() == 1):
                raise RuntimeError(f"rank 1 raises at step {state.step}")
            train_step(ddp, opt, state)

    train(state)
    print_done(model, at_reset.get("step", -1))
    if dist.get_rank() == 0 and at_reset:
        print_reference_diffs(model, at_reset, start)
    if mode == "ddp":
        shrink_after_failure(model)
    dist.destroy_process_group()


def grow_ddp(hold: str) -> None:
    """``hold``: what the state holds, ``ddp`` (the DDP module) or ``module`` (the module
    it wraps; then ``hvd.init()`` too, after the process group: the running ranks must
    remake both in that order for the new process)."""
    joined = hvd.elastic.joined()
    dist.init_process_group("mpicoll")
    if hold == "module":
        hvd.init()
    model = make_model()
    initial = ({k: v.clone() for k, v in model.state_dict().items()},
               optimizer_of(make_model().parameters()).state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = optimizer_of(ddp.parameters())
    state = hvd.elastic.TorchState(model=ddp if hold == "ddp" else model, optimizer=opt,
                                   step=0)
    slots = {"n": 2}
    grew_at: list[int] = []
    reported = threading.Event()

    def discovery() -> int:
        if slots["n"] == 3:
            reported.set()
        return slots["n"]

    def on_reset() -> None:
        grew_at.append(state.step)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run(discovery=discovery, max_np=3, discovery_interval=0.05)
    def train(state) -> None:
        while state.step < STEPS:
            if state.step == KILL_AT and dist.get_rank() == 0 and slots["n"] == 2:
                slots["n"] = 3            # rank 0's poll reports it within 0.05 s, or
                reported.wait(60)         # later on a loaded machine: the steps left
                                          # must not run out before it has
            train_step(ddp, opt, state)

    train(state)
    if joined:
        print(f"JOINED {dist.get_rank()}", flush=True)
    print_done(model, grew_at[0] if grew_at else -1)
    if dist.get_rank() == 0 and grew_at:
        diffs = []
        for late_size in (3, 2):
            ref = reference(*initial, 0, 2, stop=grew_at[0])
            ref = reference(ref.state_dict(), ref.optimizer.state_dict(), grew_at[0], 3,
                            late_size)
            diffs.append(max((a - b).abs().max().item()
                             for a, b in zip(model.parameters(), ref.parameters())))
        print(f"GROWREF {diffs[0]:.3e} {diffs[1]:.3e}", flush=True)
    dist.destroy_process_group()


def shrink_after_failure(model: torch.nn.Module) -> None:
    """The last rank dies; the others catch ``ProcessFailedError`` from an all-reduce,
    ``dist.shrink_group`` its failed ranks and use the new default group: an all-reduce
    and a new DDP module on it."""
    size = dist.get_world_size()
    if dist.get_rank() == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        print(f"NOFAIL {dist.get_rank()}", flush=True)
        return
    except mpicoll.ProcessFailedError as exc:
        failed = exc.failed_ranks
    new = dist.shrink_group(failed)
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = batch(dist.get_rank(), 0)
    F.mse_loss(ddp(x), y).backward()
    grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    check = grads.clone()
    dist.all_reduce(check)
    same = torch.allclose(check / dist.get_world_size(), grads)
    print(f"SHRUNK {dist.get_rank()} {dist.get_world_size()} {failed} "
          f"{int(t[0].item())} {new is dist.group.WORLD} {same}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "grow":
        grow_ddp(sys.argv[2])
    else:
        train_ddp(sys.argv[1])
