"""The "mpicoll" backend at start-up and exit, under ``mpirun -n 2``:

- torchrun-style ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
  set per rank) starts it (MPI's own variables: every MPI suite);
- a script that leaves asynchronous operations unwaited and never calls
  ``destroy_process_group`` exits cleanly (the groups' threads finish at exit);
- a rank whose asynchronous all-reduce the other rank never joins does not hang the job
  in ``MPI_Finalize``: the exit handler aborts it and says why.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from mpi_launcher import ROOT, mpirun_command

pytest.importorskip("torch")

UNWAITED = textwrap.dedent("""
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    dist.init_process_group("mpicoll")
    rank, n = dist.get_rank(), dist.get_world_size()
    tensors = [torch.full((1000,), float(rank + i)) for i in range(20)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    works[-1].wait()
    assert tensors[-1][0].item() == sum(r + 19 for r in range(n)), tensors[-1][0]
    print("rank", rank, "backend", dist.get_backend(), "ok", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(3), async_op=True)   # exits without waiting either
    else:
        dist.all_reduce(torch.ones(3), async_op=True)
""")

ABANDONED = textwrap.dedent("""
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    import mpicoll.torch.distributed.work as work
    work.EXIT_STALL_SECONDS = 1.0
    dist.init_process_group("mpicoll")
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3), async_op=True)   # rank 1 never joins
    print("rank", dist.get_rank(), "leaving", flush=True)
""")


def _run(script: str, tmp_path, env: dict | None = None, wrap: list[str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    full = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(mpirun_command(2) + (wrap or []) + [sys.executable, str(path)],
                          capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT,
                          check=False)


def test_torchrun_style_env_and_unwaited_operations_at_exit(tmp_path):
    """(``destroy_process_group`` with operations in flight: the MPI suite's teardown.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # each rank's RANK is its MPI rank, as a launcher that sets them would
    wrap = ["sh", "-c", 'RANK=${PMI_RANK:-$OMPI_COMM_WORLD_RANK} exec "$@"', "sh"]
    proc = _run(UNWAITED, tmp_path, env, wrap)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("backend mpicoll ok") == 2, out


def test_abandoned_operation_aborts_instead_of_hanging(tmp_path):
    proc = _run(ABANDONED, tmp_path, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "made no progress" in out and "aborting the job" in out, out
