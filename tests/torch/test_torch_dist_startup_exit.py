"""The "mpicoll" backend at start-up and exit, under ``mpirun -n 2``:

- torchrun-style ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
  set per rank) starts it (MPI's own variables: every MPI suite);
- at exit, without ``destroy_process_group``, operations left unwaited complete (the
  groups' threads finish what is queued);
- a rank whose asynchronous all-reduce the other rank never joins does not hang the job
  in ``MPI_Finalize``: the exit handler aborts it and says why;
- a group broken by an expired ``Work.wait(timeout)`` and used again, or destroyed while
  an operation makes no progress, ends the job with the message (MPICH, no ULFM);
- an operation nobody calls ``wait`` on (a future's, DDP's bucket) that a peer never joins
  fails after the group's timeout, as gloo's does.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from mpi_launcher import ROOT, mpirun_command

pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    import mpicoll.runtime.progress as progress
    import atexit
    progress.EXIT_STALL_S = 1.0
    # registered before the backend's own exit handler, so it runs after it (LIFO)
    atexit.register(lambda: print(f"rank {rank} drained {last.tolist()}", flush=True))
    dist.init_process_group("mpicoll")
    rank, n = dist.get_rank(), dist.get_world_size()
    tensors = [torch.full((1000,), float(rank + i)) for i in range(20)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    works[-1].wait()
    assert tensors[-1][0].item() == sum(r + 19 for r in range(n)), tensors[-1][0]
    last = torch.ones(3)
    dist.all_reduce(last, async_op=True)                # never waited for
    if rank == 0:
        dist.all_reduce(torch.ones(3), async_op=True)   # rank 1 never joins this one
    print(f"rank {rank} backend {dist.get_backend()} ok", flush=True)  # one string
""")


def _run(script: str, tmp_path, env: dict | None = None, wrap: list[str] | None = None,
         timeout: float = 120, args: list[str] | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    full = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(mpirun_command(2) + (wrap or []) + [sys.executable, str(path)]
                          + (args or []),
                          capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT,
                          check=False)


def test_torchrun_style_env_unwaited_operations_and_abandoned_one_at_exit(tmp_path):
    """One run (each costs an MPI start and two torch imports): started torchrun-style
    (each rank's RANK is its MPI rank, as a launcher that sets them would); at exit the
    unwaited all-reduce completes on both ranks, and rank 0's all-reduce that rank 1
    never joins aborts the job with a message instead of hanging. (A clean exit after
    ``destroy_process_group`` with operations in flight: the MPI suite's teardown.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    wrap = ["sh", "-c", 'RANK=${PMI_RANK:-$OMPI_COMM_WORLD_RANK} exec "$@"', "sh"]
    proc = _run(SCRIPT, tmp_path, env, wrap, timeout=90)
    out = proc.stdout + proc.stderr
    assert out.count("backend mpicoll ok") == 2, out
    assert "rank 1 drained [2.0, 2.0, 2.0]" in out, out     # rank 0 aborts before its print
    assert proc.returncode != 0, out
    # the stall inspector sees rank 0 wait in the call's agreement step for a rank that
    # ended (or, with the inspector slower than the exit, the lane's exit bound ends it)
    assert ("ended its process and will never take part" in out
            or "made no progress" in out and "ending the job" in out), out


BROKEN = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    from mpicoll.errors import CollectiveTimeoutError
    from mpicoll.torch.distributed import Options, process_group
    mode = sys.argv[1]
    process_group.SHUTDOWN_STALL_S = 1.0
    # check="first": the second all-reduce enters mpicoll's collective at once, where the
    # stall inspector (asking after 0.3 s) sees that rank 1 never arrives
    dist.init_process_group("mpicoll", pg_options=Options(check="first"))
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        time.sleep(60)                       # skips the next collective; ended by rank 0
    work = dist.all_reduce(torch.ones(2), async_op=True)
    if mode == "reuse":
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=1))
        except CollectiveTimeoutError as exc:
            print(f"TIMEOUT {time.monotonic() - start:.2f} {exc.missing} {exc}", flush=True)
        dist.all_reduce(torch.ones(2))       # the group is broken: this ends the job
    else:
        start = time.monotonic()
        print("DESTROYING", flush=True)
        dist.destroy_process_group()         # the all-reduce never ends: this ends the job
    print("NOT ENDED", flush=True)
""")


@pytest.mark.parametrize("mode", ["reuse", "destroy"])
def test_broken_group_used_again_or_destroyed_ends_the_job(tmp_path, mode):
    """Without ULFM (MPICH), a collective rank 1 skips: rank 0's ``wait(timeout=1 s)``
    raises at once naming the operation and rank 1, and using the broken group again
    ends the job with that message (``reuse``); destroying a group whose operation makes
    no progress ends it after ``SHUTDOWN_STALL_S`` instead of the group's 30-minute
    timeout (``destroy``). Never a silent hang."""
    start = time.monotonic()
    proc = _run(BROKEN, tmp_path, {"MPICOLL_STALL_WARN_SECONDS": "0.3"}, args=[mode],
                timeout=120)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NOT ENDED" not in out, out
    if mode == "reuse":
        line = next(x for x in out.splitlines() if x.startswith("TIMEOUT"))
        secs = float(line.split()[1])
        assert 0.9 < secs < 4.0, line       # "at once": 1 s, plus a loaded machine
        assert "allreduce" in line and "timed out after 1 s" in line, line
        assert "rank(s) [1] did not arrive" in line, line
        assert "which is broken" in out and "ending the job" in out, out
    else:
        assert "DESTROYING" in out, out
        assert "made no progress for 1 s while shutting down" in out, out
        assert "ending the job" in out, out
    assert took < 60, f"the job took {took:.0f} s"


INIT = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    from mpicoll.torch.distributed import MPIProcessGroup, Options
    device = sys.argv[1]
    kwargs = {}
    if device == "cuda":
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group("mpicoll", timeout=timedelta(seconds=42),
                            pg_options=Options(check="first"), **kwargs)
    pg, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    backend = pg._get_backend(torch.device(device))
    assert isinstance(backend, MPIProcessGroup), backend
    assert backend is pg._get_backend(torch.device("cpu"))
    assert dist.get_backend_config() == "cpu:mpicoll,cuda:mpicoll"
    assert backend.options._timeout == timedelta(seconds=42), backend.options
    assert backend.options.check == "first" and backend._lane.timeout == 42.0
    assert pg.bound_device_id == kwargs.get("device_id"), pg.bound_device_id
    x = torch.full((5,), float(rank + 1), device=device)
    dist.all_reduce(x)
    assert x.device.type == device and x.cpu().tolist() == [n * (n + 1) / 2] * 5, x
    dist.barrier()
    objects = [None] * n
    dist.all_gather_object(objects, rank)
    assert objects == list(range(n)), objects
    sub = dist.new_group(list(range(n)))
    y = torch.ones(3, device=device)
    dist.all_reduce(y, group=sub)
    assert y.cpu().tolist() == [float(n)] * 3
    print(f"rank {rank} init {device} ok", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_init_options_timeout_and_device_id(tmp_path, device):
    """``init_process_group``'s ``timeout=`` and ``pg_options=`` reach the default group's
    backend, which torch registered for both devices; on CUDA (skipped without one) with
    ``device_id`` bound as for nccl and gloo: operations on the bound device, the
    barrier, object collectives and a subgroup."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (a CPU-only torch refuses every device_id: "
                    "test_torch_dist_registration.py)")
    proc = _run(INIT, tmp_path, args=[device], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(f"init {device} ok") == 2, out


TIMED = textwrap.dedent("""
    import time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    from mpicoll.torch.distributed import Options
    dist.init_process_group("mpicoll")
    rank = dist.get_rank()
    futures_group, ddp_group = (dist.new_group([0, 1], timeout=timedelta(seconds=1))
                                for _ in range(2))
    # unchecked after its first gather: MPI's own gather, waited for by polling
    first_group = dist.new_group([0, 1], timeout=timedelta(seconds=1),
                                 pg_options=Options(check="first"))
    parts = [torch.zeros(2), torch.zeros(2)] if rank == 0 else None
    dist.gather(torch.ones(2), parts, dst=0, group=first_group)
    # unchecked after its first all-reduce: a small one is MPI's own (``auto``'s native)
    native_group = dist.new_group([0, 1], timeout=timedelta(seconds=1),
                                  pg_options=Options(check="first"))
    dist.all_reduce(torch.ones(3), group=native_group)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2),
                                                      process_group=ddp_group)
    x = torch.randn(4, 8)
    for _ in range(2):                   # DDP's first pass, and one after its rebuild
        model(x).sum().backward()
    if rank == 1:
        time.sleep(60)                   # joins nothing more; ended by rank 0's exit

    def timed(what, call):
        start = time.monotonic()
        try:
            call()
            print(f"{what} COMPLETED", flush=True)
        except Exception as exc:
            print(f"{what} {time.monotonic() - start:.2f} {type(exc).__name__} {exc}",
                  flush=True)

    timed("FUTURE", lambda: dist.all_reduce(torch.ones(3), group=futures_group,
                                            async_op=True).get_future().wait())
    timed("BACKWARD", lambda: model(x).sum().backward())
    timed("GATHER", lambda: dist.gather(torch.ones(2), parts, dst=0, group=first_group))
    timed("NATIVE", lambda: dist.all_reduce(torch.ones(3), group=native_group,
                                            async_op=True).get_future().wait())
    print("EXITING", flush=True)
""")


@pytest.mark.parametrize("lane_wait", ["auto", "spin"])
def test_unwaited_operation_a_peer_never_joins_fails_after_the_groups_timeout(tmp_path,
                                                                               lane_wait):
    """Nobody calls ``Work.wait`` on an asynchronous all-reduce awaited through its
    future, nor on DDP's bucket (the reducer waits on the future; the last bucket runs on
    the caller's thread): when rank 1 never joins, each fails after the group's 1 s
    timeout (the future raises, ``backward()`` raises CollectiveTimeoutError), as gloo's
    operations time out, instead of waiting for as long as rank 1 lives; so do a gather
    and a small all-reduce on groups that agree on the first call only (MPI's own gather
    and all-reduce, no agreement step before them). Also with lanes that wait on the core
    (``MPICOLL_LANE_WAIT=spin``). Rank 0's exit then ends the job with the message (the
    abandoned operations are still in MPI)."""
    start = time.monotonic()
    proc = _run(TIMED, tmp_path, env={"MPICOLL_LANE_WAIT": lane_wait}, timeout=120)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    for what, kind in (("FUTURE", "allreduce"), ("BACKWARD", "allreduce"),
                       ("GATHER", "gather"), ("NATIVE", "allreduce")):
        line = next((x for x in out.splitlines() if x.startswith(what + " ")), None)
        assert line is not None, out
        secs = float(line.split()[1])
        assert 0.9 < secs < 4.0, line
        assert f"CollectiveTimeoutError mpicoll: {kind} on mpicoll-pg" in line, line
        assert "timed out after 1 s" in line, line
    assert "EXITING" in out, out
    assert proc.returncode != 0 and "is broken" in out and "ending the job" in out, out
    assert took < 50, f"the job took {took:.0f} s"


NEW_GROUP = textwrap.dedent("""
    import time
    from datetime import timedelta
    import torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    dist.init_process_group("mpicoll")
    rank = dist.get_rank()
    start = time.monotonic()
    if rank == 0:      # rank 1 never calls new_group
        try:
            dist.new_group([0, 1], timeout=timedelta(seconds=2),
                           use_local_synchronization=True)
            print("MADE", flush=True)
        except Exception as exc:
            print(f"RAISED {time.monotonic() - start:.2f} {type(exc).__name__}: {exc}",
                  flush=True)
    else:
        time.sleep(8)
    print(f"rank {rank} at exit", flush=True)
""")


def test_new_group_a_member_never_joins_raises_after_its_timeout(tmp_path):
    """A subgroup one member never creates: new_group raises CollectiveTimeoutError
    after the group's timeout on the member that waits (as gloo's store times out), and,
    MPI being unable to cancel the creation, the job ends at exit saying so (it waited
    until the missing member came, or forever)."""
    proc = _run(NEW_GROUP, tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    line = next((x for x in out.splitlines() if x.startswith(("RAISED", "MADE"))), out)
    assert line.startswith("RAISED"), line
    secs = float(line.split()[1])
    assert 1.9 < secs < 6.0, line
    assert "CollectiveTimeoutError" in line and "ranks [0, 1] was not made within 2 s" in line
    assert "ending the job" in out and proc.returncode != 0, out
