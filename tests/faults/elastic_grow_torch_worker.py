"""``hvd.elastic`` training that grows when discovery reports more slots (run by
test_elastic_grow.py under ``mpirun --with-ft ulfm``, not by pytest).

Usage: ``python elastic_grow_torch_worker.py EPOCHS GROW_STEP SLOTS MAX_NP``.

The classifier, data and optimizer of elastic_torch_worker.py, with
``DistributedOptimizer``, an :class:`ElasticSampler` and a commit after every batch. The
discovery is a callable (polled by rank 0 every 0.2 s) that reports 2 slots until the
original rank 0 reaches global step ``GROW_STEP``, then ``SLOTS`` (it waits there until the
callable has answered so). Output lines:

- ``CAPACITY <time>``;
- ``COMMITTED <rank> <size> <step> <digest> <time>``: a commit raised HostsUpdatedInterrupt
  (``digest``: sha256 of the parameters, the optimizer's state, the sampler's state and
  the plain attributes);
- ``ENTER <rank> <size> <step> <digest> <joined> <sampler replicas> <allreduce ok>``: the
  elastic function (re)starts after the sync; ``allreduce ok``: an ``hvd.allreduce`` of a
  rank-dependent tensor equals its closed form for the world's size;
- ``RESET <rank> <size>`` from the reset callback; ``FIRST <rank> <size> <time>``: the first
  step completed after a growth;
- ``DONE <rank> <size> <steps> <accuracy %> <parameters digest> <joined> <growth phases>``.
"""
from __future__ import annotations

import hashlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from elastic_grow_worker import say  # noqa: E402
from elastic_torch_worker import (BATCH, LR, MOMENTUM, accuracy, make_data,  # noqa: E402
                                  make_model, params_digest, train_step)


def _update(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(value.detach().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(str(key).encode())
            _update(h, value[key])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _update(h, v)
    else:
        h.update(repr(value).encode())


def state_digest(state: Any) -> str:
    h = hashlib.sha256()
    _update(h, state.model.state_dict())
    _update(h, state.optimizer.state_dict()["state"])
    _update(h, state.sampler.state_dict())
    _update(h, [state.epoch, state.step])
    return h.hexdigest()[:16]


def main() -> None:
    import mpicoll.torch as hvd  # noqa: PLC0415

    epochs, grow_step, slots, max_np = map(int, sys.argv[1:5])
    torch.set_num_threads(1)
    joined = hvd.elastic.joined()
    hvd.init()
    original_root = hvd.rank() == 0 and not joined
    capacity = {"slots": 2, "answered": threading.Event()}

    def discover() -> int:
        answer = capacity["slots"]
        if answer != 2:
            capacity["answered"].set()
        return answer

    x_train, y_train = make_data(1536, 1)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(x_train)), shuffle=True, seed=5)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
    pending = {"first": joined}

    def on_reset() -> None:
        say(f"RESET {hvd.rank()} {hvd.size()}")
        pending["first"] = True

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run(discovery=discover, max_np=max_np, discovery_interval=0.2)
    def train(state: hvd.elastic.TorchState) -> None:
        size = hvd.size()
        probe = torch.arange(5, dtype=torch.float64) * (hvd.rank() + 1)
        total = hvd.allreduce(probe, op=hvd.Sum, name="grow.probe")
        ok = torch.equal(total, torch.arange(5, dtype=torch.float64) * (size * (size + 1) // 2))
        say(f"ENTER {hvd.rank()} {size} {state.step} {state_digest(state)} {int(joined)} "
            f"{state.sampler.num_replicas} {int(ok)}")
        for state.epoch in range(state.epoch, epochs):
            indices = list(state.sampler)
            for batch in range(0, len(indices), BATCH):
                if original_root and state.step == grow_step and capacity["slots"] == 2:
                    capacity["slots"] = slots
                    say(f"CAPACITY {time.time():.6f}")
                    capacity["answered"].wait(30)
                train_step(state, x_train, y_train, indices, batch)
                if pending["first"]:
                    pending["first"] = False
                    say(f"FIRST {hvd.rank()} {hvd.size()} {time.time():.6f}")
                try:
                    state.commit()
                except hvd.elastic.HostsUpdatedInterrupt:
                    say(f"COMMITTED {hvd.rank()} {hvd.size()} {state.step} "
                        f"{state_digest(state)} {time.time():.6f}")
                    raise
            state.sampler.set_epoch(state.epoch + 1)

    train(state)
    growth = hvd.elastic.last_growth()
    say(f"DONE {hvd.rank()} {hvd.size()} {state.step} {accuracy(model):.2f} "
        f"{params_digest(model)} {int(joined)} "
        f"{'-' if growth is None else growth.summary()}")


if __name__ == "__main__":
    main()
