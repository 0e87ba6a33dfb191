"""Elastic training with ``hvd.elastic`` (run by test_elastic_torch.py under ``mpirun
--with-ft ulfm``, not by pytest; also examples of the API's use).

Usage: ``python elastic_torch_worker.py EPOCHS KILL_STEP VICTIM MIN_NP [H[:M]]`` (``VICTIM``
-1: nobody dies; ``H``/``M``: local SGD, ``DistributedOptimizer(sync_every=H,
node_sync_every=M)``). A small classifier on synthetic, deterministic data (4 Gaussian classes in
16 dimensions) trains with ``DistributedOptimizer``, an :class:`ElasticSampler` and a
commit after every batch; rank ``VICTIM`` SIGKILLs itself before global step
``KILL_STEP``. Output lines: ``KILL <time>``; ``RESET <rank> <size> <time>`` from each
reset callback; ``FIRST <rank> <time>`` when the first step after a reset completes;
``DONE <rank> <size> <steps> <accuracy %> <sha256 of the parameters> <phases>``;
``TOOFEW <rank> <size> <min_np> <time>`` when fewer than ``MIN_NP`` survive; with local
SGD also ``LOCALSGD <rank> <schedule steps> <identical level> <averager rebuilds>``.
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from typing import Any

import torch

BATCH = 16
FEATURES, CLASSES = 16, 4
SPREAD = 0.7
LR, MOMENTUM = 0.05, 0.9


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of 4 Gaussian classes (the centres are fixed; ``seed`` draws the
    samples)."""
    centres = torch.randn(CLASSES, FEATURES,
                          generator=torch.Generator().manual_seed(0)) * SPREAD
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[y] + torch.randn(n, FEATURES, generator=g)
    return x, y


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, CLASSES))


def accuracy(model: torch.nn.Module) -> float:
    """Percent of the test set classified right."""
    x_test, y_test = make_data(1024, 2)
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item() * 100


def train_serially(n: int, epochs: int) -> float:
    """The same training as an uninterrupted ``n``-rank run, in one process: each step
    averages the gradients of the ``n`` ranks' batches (an independent reference, with
    no MPI). Returns the final accuracy."""
    import random  # noqa: PLC0415

    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # as the ranks (and fast on a loaded machine)
    try:
        return _train_serially(n, epochs, random)
    finally:
        torch.set_num_threads(threads)


def _train_serially(n: int, epochs: int, random: Any) -> float:
    x_train, y_train = make_data(1536, 1)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for epoch in range(epochs):
        order = list(range(len(x_train)))
        random.Random(5 + epoch).shuffle(order)          # ElasticSampler's order
        per_rank = -(-len(order) // n)
        order += order[:per_rank * n - len(order)]
        shards = [order[r::n] for r in range(n)]
        for batch in range(0, per_rank, BATCH):
            optimizer.zero_grad()
            for shard in shards:
                rows = torch.tensor(shard[batch:batch + BATCH])
                loss = torch.nn.functional.cross_entropy(model(x_train[rows]),
                                                         y_train[rows]) / n
                loss.backward()
            optimizer.step()
    return accuracy(model)


def train_step(state: Any, x_train: torch.Tensor, y_train: torch.Tensor,
               indices: list[int], batch: int) -> None:
    """One optimizer step on the ``BATCH`` samples of ``indices`` from ``batch`` on,
    counted in ``state.step`` and recorded in ``state.sampler``."""
    rows = torch.tensor(indices[batch:batch + BATCH])
    state.optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(state.model(x_train[rows]), y_train[rows])
    loss.backward()
    state.optimizer.step()
    state.step += 1
    state.sampler.record_batch(batch // BATCH, BATCH)


def params_digest(model: torch.nn.Module) -> str:
    """The first 16 hex digits of the sha256 of the model's parameters and buffers."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    import mpicoll.torch as hvd  # noqa: PLC0415  (the module is also imported without MPI)

    epochs, kill_step, victim, min_np = map(int, sys.argv[1:5])
    extra = sys.argv[5] if len(sys.argv) > 5 else ""
    diloco_h = int(extra.split(":")[1]) if extra.startswith("diloco:") else 0
    local = [int(v) for v in extra.split(":")] if extra and not diloco_h else []
    local_sgd = dict(zip(("sync_every", "node_sync_every"), local))
    torch.set_num_threads(1)
    hvd.init()
    me = hvd.rank()                              # the original rank (for the kill)
    x_train, y_train = make_data(1536, 1)
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if diloco_h:       # DiLoCo: the inner optimizer local, an outer step every H steps
        optimizer: Any = hvd.DiLoCo(model, inner, torch.optim.SGD(
            model.parameters(), lr=0.7, momentum=0.5, nesterov=True), sync_every=diloco_h)
    else:
        optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                             **local_sgd)
    sampler = hvd.elastic.ElasticSampler(range(len(x_train)), shuffle=True, seed=5)
    more = {"inner": inner} if diloco_h else {}
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0,
                                   **more)
    after_reset = {"pending": False}

    def on_reset() -> None:
        print(f"RESET {hvd.rank()} {hvd.size()} {time.time():.6f}", flush=True)
        after_reset["pending"] = True

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run(min_np=min_np)
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, epochs):
            indices = list(state.sampler)
            for batch in range(0, len(indices), BATCH):
                if me == victim and state.step == kill_step:
                    print(f"KILL {time.time():.6f}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                train_step(state, x_train, y_train, indices, batch)
                state.commit()
                if after_reset["pending"]:
                    after_reset["pending"] = False
                    print(f"FIRST {hvd.rank()} {time.time():.6f}", flush=True)
            state.sampler.set_epoch(state.epoch + 1)

    try:
        train(state)
    except hvd.elastic.TooFewRanksError as exc:
        print(f"TOOFEW {me} {exc.size} {exc.min_np} {time.time():.6f}", flush=True)
        import mpicoll.elastic  # noqa: PLC0415
        mpicoll.elastic.world().Barrier()   # every survivor prints before any exits
        sys.exit(3)
    if diloco_h:
        st = optimizer.stats()
        digest = hashlib.sha256(b"".join(t.numpy().tobytes()
                                         for t in optimizer.global_parameters()))
        print(f"DILOCO {hvd.rank()} {st['steps']} {sum(st['outer_steps'])} "
              f"{digest.hexdigest()[:16]}", flush=True)
    elif optimizer.local_sgd is not None:
        st = optimizer.local_sgd.stats()
        print(f"LOCALSGD {hvd.rank()} {st['steps']} {st['identical']} {st['rebuilds']}",
              flush=True)
    percent = accuracy(model)
    rec = hvd.elastic.last_recovery()
    phases = "-" if rec is None else rec.summary()
    print(f"DONE {hvd.rank()} {hvd.size()} {state.step} {percent:.2f} "
          f"{params_digest(model)} {phases}", flush=True)


if __name__ == "__main__":
    main()
