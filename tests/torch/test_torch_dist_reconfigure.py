"""The "mpicoll" groups beside other backends' through a world change
(:mod:`mpicoll.torch.distributed.reconfigure`), each in a process of its own (a new world
generation releases the old world's communicators: an MPI suite's groups would go with it):

- under ``mpirun -n 2``, a gloo default group (made after an mpicoll default group was
  destroyed), a group of a backend with no CPU device, and an mpicoll group: the mpicoll
  group is made from the world (not from the destroyed group's communicator), follows a
  new world generation, and a group shrunk from it names itself as torch's custom backends
  past the group with no CPU backend;
- in one process that never built the backend's extension, a joining process's DDP over a
  gloo group synchronises as usual, and a second ``start_joining`` changes nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from mpi_launcher import ROOT, mpirun_command

pytest.importorskip("torch")

WORLD_CHANGE = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from mpi4py import MPI
    import mpicoll.torch  # noqa: F401
    from mpicoll import context
    from mpicoll.runtime import comms, world as runtime_world
    from mpicoll.torch.distributed import backend_of, reconfigure

    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    store = sys.argv[1]
    dist.init_process_group("mpicoll", init_method=f"file://{store}.0", rank=rank,
                            world_size=n)
    dist.destroy_process_group()
    assert not reconfigure.PARENT, reconfigure.PARENT
    dist.init_process_group("gloo", init_method=f"file://{store}.1", rank=rank, world_size=n)
    dist.Backend.register_backend("cudaonly", lambda *args: None, devices=["cuda"])
    cuda_only = dist.new_group(backend="cudaonly")
    try:
        cuda_only._get_backend(torch.device("cpu"))
        raise AssertionError("a CPU backend for a cuda-only group")
    except RuntimeError:
        pass
    group = dist.new_group(backend="mpicoll")


    def summed(g, members, scale):
        t = torch.arange(4, dtype=torch.float64) * (rank + 1) * scale
        dist.all_reduce(t, group=g)
        want = torch.arange(4, dtype=torch.float64) * scale * sum(r + 1 for r in members)
        assert torch.equal(t, want), (t, want)


    summed(group, range(n), 1)
    assert reconfigure._is_mpicoll(group)
    assert not reconfigure._is_mpicoll(cuda_only) and not reconfigure._is_mpicoll(dist.group.WORLD)
    old = backend_of(group).comm
    context.set_world(None)                  # a new world generation (an elastic reset's)
    assert runtime_world.generation() == 1
    assert reconfigure.follow_world() == 1   # the mpicoll group only
    assert reconfigure.follow_world() == 0   # idempotent
    backend = backend_of(group)
    assert backend.generation == 1 and backend.comm is not old
    assert comms.record_of(backend.comm) is not None and not reconfigure.PARENT
    assert dist.get_process_group_ranks(group) == list(range(n))
    assert (dist.get_rank(group), dist.get_world_size(group)) == (rank, n)
    summed(group, range(n), 3)
    if rank < n - 1:                        # the last rank is left out
        shrunk = backend.shrink([n - 1])
        assert (shrunk.rank(), shrunk.size()) == (rank, n - 1)
        t = torch.full((3,), float(rank + 1))
        shrunk.allreduce([t]).wait()         # its first operation: adopt_wrapper
        assert torch.equal(t, torch.full((3,), float(sum(range(1, n))))), t
        shrunk.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} followed", flush=True)
""")

JOINING = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    import torch.nn.parallel.distributed as ddp
    import mpicoll.torch  # noqa: F401
    from mpicoll.torch.distributed import extension, reconfigure

    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0,
                            world_size=1)
    calls = []
    verify, sync = ddp._verify_param_shape_across_processes, ddp._sync_module_states
    ddp._verify_param_shape_across_processes = lambda *a, **k: (calls.append("verify"),
                                                               verify(*a, **k))[1]
    ddp._sync_module_states = lambda *a, **k: (calls.append("sync"), sync(*a, **k))[1]
    reconfigure.start_joining()
    held, wrapped = reconfigure._held, ddp._sync_module_states
    reconfigure.start_joining()              # again: the same hold, wrapped once
    assert reconfigure._held is held and ddp._sync_module_states is wrapped
    assert reconfigure.joining() and extension.loaded() is None
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    assert calls == ["verify", "sync"], calls   # not an mpicoll group: not held
    assert held == {} and extension.loaded() is None
    model(torch.ones(2, 3)).sum().backward()     # no refusing hook
    print("joined", flush=True)
    dist.destroy_process_group()
""")


def _run(script: str, tmp_path, n: int | None) -> str:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    launch = mpirun_command(n) if n else []
    proc = subprocess.run(launch + [sys.executable, str(path), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_mpicoll_group_beside_other_backends_follows_a_new_world(tmp_path):
    out = _run(WORLD_CHANGE, tmp_path, 2)
    assert "rank 0 followed" in out and "rank 1 followed" in out, out


def test_joining_without_the_extension_and_twice(tmp_path):
    assert "joined" in _run(JOINING, tmp_path, None)
