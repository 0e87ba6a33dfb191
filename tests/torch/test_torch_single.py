"""mpicoll.torch in one process (no mpirun): API before init, a short session, the example."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_queries_before_init_raise_value_error():
    import mpicoll.torch as hvd

    if hvd.is_initialized():
        pytest.skip("already initialized in this process")
    for query in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
                  hvd.cross_size):
        with pytest.raises(ValueError, match="not been initialized"):
            query()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(torch.ones(2))


def test_single_process_session():
    import mpicoll.torch as hvd

    hvd.init()
    try:
        assert (hvd.size(), hvd.rank(), hvd.local_size()) == (1, 0, 1)
        x = torch.arange(4.0)
        assert torch.equal(hvd.allreduce(x), x)
        assert torch.equal(hvd.allgather(x.view(2, 2)), x.view(2, 2))
        assert torch.equal(hvd.broadcast(x, 0), x)
        assert hvd.join() == 0
        model = torch.nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(torch.ones(3, 2)).sum().backward()
        opt.step()
        assert torch.equal(model.weight.grad, torch.full((1, 2), 3.0))
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()


def test_example_trains_checkpoints_and_resumes(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "--checkpoint-dir",
           str(tmp_path), "--min-accuracy", "0"]
    first = subprocess.run(cmd + ["--epochs", "1"], capture_output=True, text=True,
                           timeout=240, cwd=ROOT)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "checkpoint.pt").exists()
    second = subprocess.run(cmd + ["--epochs", "2", "--resume"], capture_output=True,
                            text=True, timeout=240, cwd=ROOT)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "epochs 1..2" in second.stdout and "epoch   2/2" in second.stdout
    assert "epoch   1/2" not in second.stdout
    assert "final test accuracy" in second.stdout


def test_wrapped_optimizer_keeps_class_state_and_schedulers():
    import mpicoll.torch as hvd

    hvd.init()
    try:
        model = torch.nn.Linear(2, 1)
        base = torch.optim.Adam(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(3, 2)).sum().backward()
            opt.step()
            sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
        assert len(opt.state_dict()["state"]) == 2
        with pytest.raises(ValueError, match="unique"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=[("x", model.weight), ("x", model.bias)])
    finally:
        hvd.shutdown()


def test_init_refuses_mpi_below_thread_multiple():
    code = ("import mpicoll.torch as hvd\n"
            "try:\n    hvd.init()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = dict(__import__("os").environ, MPI4PY_RC_THREAD_LEVEL="serialized")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert "refused:" in out.stdout and "THREAD_MULTIPLE" in out.stdout, out.stdout + out.stderr


def test_horovod_keywords_sparse_as_dense_num_groups_join_device():
    import mpicoll.torch as hvd

    hvd.init()
    try:
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=True, num_groups=2)
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([1, 2])).sum().backward()
            opt.step()
        assert torch.equal(emb.weight.grad[1], torch.ones(3))
        assert torch.equal(emb.weight.grad[0], torch.zeros(3))
        assert hvd.join(device=0) == 0
        with pytest.raises(ValueError, match="num_groups"):
            hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), num_groups=-1)
    finally:
        hvd.shutdown()


WORLD_CHANGE = """
import torch
import mpicoll.torch as hvd
from mpicoll import context
from mpicoll.runtime import comms

hvd.init()
old = hvd.state.engine()
model = torch.nn.Linear(2, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), sync_every=2)
model(torch.ones(3, 2)).sum().backward()
opt.step()
context.set_world(None)            # a new world generation, as an elastic reset makes
hvd.init()                         # not a no-op: the engine of the old world is abandoned
assert hvd.state.engine() is not old and not old.running()
opt.zero_grad()
model(torch.ones(3, 2)).sum().backward()
opt.step()
assert opt.local_sgd.stats()["rebuilds"] == 1, opt.local_sgd.stats()
assert hvd.allreduce(torch.ones(2)).tolist() == [1.0, 1.0]
hvd.shutdown()
owners = sorted(r.owner for r in comms.alive() if r.owner.startswith("engine"))
print("ALIVE", owners)
assert not owners
"""


def test_a_new_world_generation_gets_a_new_engine_and_averager():
    """hvd and local SGD learn of a new world from the runtime's generation (issue 32):
    ``init()`` abandons the engine of the old world instead of keeping it, the averager
    moves to the new engine's side communicator, and the engines' communicators are all
    released at shutdown."""
    done = subprocess.run([sys.executable, "-c", WORLD_CHANGE], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ALIVE []" in done.stdout
