"""The "mpicoll" backend at start-up and exit, under ``mpirun -n 2``:

- torchrun-style ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
  set per rank) starts it (MPI's own variables: every MPI suite);
- at exit, without ``destroy_process_group``, operations left unwaited complete (the
  groups' threads finish what is queued);
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

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    import mpicoll.torch.distributed.work as work
    import atexit
    work.EXIT_STALL_SECONDS = 1.0
    # registered before the backend's own exit handler, so it runs after it (LIFO)
    atexit.register(lambda: print("rank", rank, "drained", last.tolist(), flush=True))
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
    print("rank", rank, "backend", dist.get_backend(), "ok", flush=True)
""")


def _run(script: str, tmp_path, env: dict | None = None, wrap: list[str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    full = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(mpirun_command(2) + (wrap or []) + [sys.executable, str(path)],
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
    assert "made no progress" in out and "aborting the job" in out, out
