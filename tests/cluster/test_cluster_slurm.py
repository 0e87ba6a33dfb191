"""Slurm across the namespace cluster: `sbatch -N 2 --ntasks-per-node 2 jobs/hierarchical.sbatch`.

Brings up a private 2-node cluster (cluster/cluster up --slurm: slurmctld on head, one
slurmd per node), submits the multi-node job as a user would, once with srun (PMI-2) and
once with mpirun inside the allocation, and checks that it ran on two real nodes (layout
from shared memory, not emulated) with exact results. Always tears the cluster down.
Where Slurm is not installed yet, installs it first through the CI recipe
(``.ci/slurm/start.sh``: apt, about 90 s, then ``.ci/slurm/stop.sh`` stops the one-node
cluster it started). Skips, saying why, where the cluster cannot be made or Slurm cannot be
installed, or with ``MPICOLL_CLUSTER_TESTS=0``.
About 40-60 s on two busy cores.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import Cluster, new_cluster, unavailable

ROOT = Path(__file__).resolve().parents[2]
CI_SLURM = ROOT / ".ci" / "slurm"


def _ensure_slurm_installed() -> None:
    """Install slurm-wlm through the CI recipe if missing (then stop its one-node cluster)."""
    if shutil.which("slurmctld", path="/usr/sbin:/usr/bin:/sbin:/bin") is not None:
        return
    start = CI_SLURM / "start.sh"
    if not start.exists():
        pytest.skip("Slurm is not installed and there is no .ci/slurm/start.sh")
    try:
        proc = subprocess.run([str(start)], capture_output=True, text=True, timeout=900,
                              check=False)
    finally:
        subprocess.run([str(CI_SLURM / "stop.sh")], capture_output=True, timeout=120,
                       check=False)
    if proc.returncode == 77:
        pytest.skip("Slurm cannot be installed here: "
                    + (proc.stderr.strip().splitlines() or ["?"])[-1])
    assert proc.returncode == 0, f".ci/slurm/start.sh failed:\n{proc.stderr}"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = unavailable()
    if why:
        pytest.skip(why)
    _ensure_slurm_installed()
    c = new_cluster(tmp_path_factory, "s")
    try:
        up = c.run("up", "--nodes", "2", "--bandwidth", "1gbit", "--slots", "2", "--slurm",
                   timeout=150)
        if up.returncode == 77:
            pytest.skip("cluster or Slurm cannot run here: "
                        + (up.stdout.strip().splitlines() or ["?"])[-1])
        assert up.returncode == 0, f"cluster up --slurm failed ({up.returncode}):\n{up.stdout}"
        assert "srun -N 2 hostname -> n1 n2" in up.stdout, up.stdout
        yield c
    finally:
        down = c.run("down", timeout=90)
        assert down.returncode == 0, down.stdout
        assert not c.namespaces(), c.namespaces()


def _wait(c: Cluster, job: str, timeout: float) -> int:
    """Poll squeue until JOB is gone; return its exit code (scontrol), cancel on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not c.run("slurm", "squeue", "-h", "-j", job, "-o", "%T", timeout=20).stdout.strip():
            break
        time.sleep(0.5)
    else:
        c.run("slurm", "scancel", job, timeout=20)
        raise AssertionError(f"job {job} still running after {timeout} s")
    info = c.run("slurm", "scontrol", "show", "job", job, timeout=20).stdout
    m = re.search(r"\bExitCode=(\d+):(\d+)", info)
    assert m, info
    return int(m.group(1)) or int(m.group(2))


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_hierarchical_job_on_two_nodes(slurm_cluster: Cluster, tmp_path: Path,
                                       launcher: str) -> None:
    env = {"FI_PROVIDER": "tcp", "MPIR_CVAR_CH4_NETMOD": "ofi",
           "MPICOLL_LAUNCHER": launcher, "HIER_COUNTS": "0,1,7,1000,65537",
           "HIER_BENCH_ARGS": "-m 8:64K --step 8 -i 3 -x 1 -c --algo hierarchical,ring "
                              "--memcpy-bytes 0"}
    r = slurm_cluster.run("slurm", "sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "2",
                          "-o", str(tmp_path / "%x-%j.out"), str(ROOT / "jobs" / "hierarchical.sbatch"),
                          env=env, timeout=30)
    assert r.returncode == 0, r.stdout
    job = r.stdout.strip().splitlines()[-1].split(";")[0]
    rc = _wait(slurm_cluster, job, 150)
    logs = list(tmp_path.glob(f"*-{job}.out"))
    text = logs[0].read_text() if logs else "<no log>"
    assert rc == 0, f"job {job} exited {rc}:\n{text}"
    assert re.search(r"^== mpicoll-hier \d+ restart 0 on n\[1-2\]: nodes=2 ntasks=4", text, re.MULTILINE), text
    assert f"launcher {launcher}" in text, text
    assert "world ok: size 4 == expected 4, 2 node(s), ranks per node [2, 2]" in text, text
    assert "topology: 2 node(s) real (shared memory), ranks per node [2, 2], leaders [0, 2]" \
        in text, text
    assert "emulating" not in text, text
    assert len(re.findall(r"^count\s+\d+: hierarchical", text, re.MULTILINE)) == 5, text
    assert "hierarchical allreduce: all results correct" in text, text
    assert "Ranks per node: 2" in text, text
    assert "# validation: all results correct" in text, text
