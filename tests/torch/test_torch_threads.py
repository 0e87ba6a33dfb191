"""MPICOLL_TORCH_THREADS: torch threads per rank fitted to the node's cores (torchrun's
policy) where the launcher did not (mpicoll/torch/threads.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from mpi_launcher import ROOT, mpirun_command  # noqa: E402

from mpicoll.torch.threads import planned_threads, ranks_on_node  # noqa: E402


@pytest.mark.parametrize("setting,current,default,cores,local,env,expected", [
    ("auto", 2, 2, 2, 2, {}, 1),                      # 2 ranks x 2 threads on 2 cores
    ("auto", 8, 8, 8, 3, {}, 2),                      # 3 ranks on 8 cores: 8 // 3
    ("auto", 4, 4, 2, 4, {}, 1),                      # more ranks than cores: at least 1
    ("auto", 2, 2, 2, 1, {}, None),                   # one rank: room enough
    ("auto", 1, 1, 2, 2, {}, None),                   # already fits
    ("auto", 2, 2, 2, 2, {"OMP_NUM_THREADS": "2"}, None),   # the user chose
    ("auto", 3, 2, 2, 2, {}, None),                   # the user called set_num_threads
    ("auto", 2, 2, 2, None, {}, None),                # node layout unknown
    ("keep", 2, 2, 2, 2, {}, None),
    ("3", 2, 2, 2, 2, {"OMP_NUM_THREADS": "2"}, 3),   # a number always wins
])
def test_planned_threads(setting, current, default, cores, local, env, expected):
    assert planned_threads(setting, current, default, cores, local, env) == expected


@pytest.mark.parametrize("setting", ["0", "-1", "many", ""])
def test_bad_setting_is_a_value_error(setting):
    with pytest.raises(ValueError, match="MPICOLL_TORCH_THREADS"):
        planned_threads(setting, 2, 2, 2, 2, {})


def test_ranks_on_node_from_each_launcher():
    assert ranks_on_node({"MPI_LOCALNRANKS": "3"}) == 3
    assert ranks_on_node({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert ranks_on_node({"SLURM_NTASKS_PER_NODE": "2"}) == 2
    assert ranks_on_node({"SLURM_NTASKS_PER_NODE": "2(x3)"}) is None
    assert ranks_on_node({}) is None


SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    import mpicoll.torch as hvd
    before = torch.get_num_threads()
    if sys.argv[1] == "hvd":
        hvd.init()
    else:
        dist.init_process_group("mpicoll")
    os.write(1, f"THREADS {before} {torch.get_num_threads()}\\n".encode())  # one write per line
    if sys.argv[1] != "hvd":
        dist.destroy_process_group()
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("front", ["hvd", "dist"])
@pytest.mark.parametrize("setting,expected", [("auto", "2 1"), ("keep", "2 2")])
def test_two_ranks_on_two_cores_get_one_thread_each(tmp_path, front, setting, expected):
    """A launch torch does not recognise (no MPI_LOCALNRANKS: srun, a wrapper) leaves
    torch at one thread per core in each rank; init fits it to one per rank."""
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MPICOLL_TORCH_THREADS")}
    env.update(PYTHONPATH=str(ROOT), MPICOLL_TORCH_THREADS=setting)
    cmd = mpirun_command(2) + ["env", "-u", "MPI_LOCALNRANKS", "-u",
                               "OMPI_COMM_WORLD_LOCAL_SIZE", sys.executable, str(script), front]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("THREADS")]
    assert lines == [expected] * 2, out
