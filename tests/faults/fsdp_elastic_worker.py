"""FSDP2 over "mpicoll" under ULFM (issue 34), run by test_ddp_elastic.py.

``fsdp``: an FSDP2 model (each Linear and the root ``fully_shard``-ed over a
one-dimensional mesh of the world, float64, SGD with momentum: optimizer state sharded
too), built once, trained inside ``hvd.elastic.run`` with a ``TorchState`` and no
``hvd.init()``; the last rank is killed at step ``KILL_AT`` of ``STEPS``. The survivors
shard the committed full copy again over 3 ranks and go on. Each survivor prints its rank,
size, mesh, a digest of the full parameters and (rank 0) how far they are from a float64
single-process reference restarted at 3 ranks from the step-``KILL_AT`` commit, and from
one dividing by 4 (which must be far off).

``fsdp-backward``: the same, the last rank killed inside its backward pass at step
``KILL_AT`` (the survivors fail in FSDP's backward collectives: FSDP's iteration state is
reset before the reshard).

``mesh2d``: a 2 x 2 DeviceMesh held by the ``TorchState``; after the last rank's death the
3 survivors cannot fill it: ``ValueError`` on every survivor, the job ends non-zero.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import mpicoll.torch as hvd
from ddp_elastic_worker import (KILL_AT, STEPS, batch, digest, make_model, optimizer_of,
                                print_reference_diffs)
from mpicoll.torch.elastic import sharded


def full_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of an FSDP2 model's full parameters (collective)."""
    plain = make_model()
    with torch.no_grad():
        for mine, shard in zip(plain.parameters(), model.parameters(), strict=True):
            mine.copy_(shard.full_tensor())
    return plain


def plain_optimizer_state(full_model_state: dict, full_optim_state: dict) -> dict:
    """A full (DCP) optimizer state dict as a plain model's optimizer state_dict()."""
    plain = make_model()
    plain.load_state_dict(full_model_state)
    opt = optimizer_of(plain.parameters())
    sharded.load_optimizer_state(plain, opt, full_optim_state)
    return opt.state_dict()


def train_fsdp(in_backward: bool = False) -> None:
    dist.init_process_group("mpicoll")
    start = dist.get_world_size()
    mesh = init_device_mesh("cpu", (start,))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer_of(model.parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    at_reset: dict = {}

    def on_reset() -> None:
        handlers = state._handlers
        at_reset.update(step=state.step, size=dist.get_world_size(),
                        model={k: v.clone() for k, v in handlers["model"].saved.items()},
                        opt=plain_optimizer_state(handlers["model"].saved,
                                                  handlers["optimizer"].saved))

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state) -> None:
        while state.step < STEPS:
            dies = (state.step == KILL_AT and dist.get_world_size() == start
                    and dist.get_rank() == start - 1)
            if dies and not in_backward:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            x, y = batch(dist.get_rank(), state.step)
            out = model(x)
            if dies:            # half-way through the backward pass: the others are in it
                out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
            F.mse_loss(out, y).backward()
            opt.step()
            state.step += 1
            state.commit()

    train(state)
    plain = full_model(model)
    print(f"DONE {dist.get_rank()} {dist.get_world_size()} {mesh.mesh.tolist()} "
          f"{digest(plain)} {at_reset.get('step', -1)}", flush=True)
    if dist.get_rank() == 0 and at_reset:
        print_reference_diffs(plain, at_reset, start)
    dist.destroy_process_group()


def mesh_2d() -> None:
    dist.init_process_group("mpicoll")
    mesh = init_device_mesh("cpu", (2, 2))
    state = hvd.elastic.TorchState(mesh=mesh, step=0)

    @hvd.elastic.run
    def train(state) -> None:
        while state.step < STEPS:
            if state.step == KILL_AT and dist.get_rank() == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(1)
            dist.all_reduce(t)
            state.step += 1
            state.commit()

    try:
        train(state)
    except ValueError as exc:
        print(f"MESHERROR {dist.get_rank()} {exc}", flush=True)
        raise


if __name__ == "__main__":
    {"fsdp": train_fsdp, "fsdp-backward": lambda: train_fsdp(in_backward=True),
     "mesh2d": mesh_2d}[sys.argv[1]]()
