"""Slurm and MPI across the namespace cluster: isolation of the nodes, and a multi-node job.

Brings up one private 2-node cluster (cluster/cluster up --slurm: slurmctld on head, one
slurmd per node, 1 Gb/s links) for the whole module and always tears it down. Then:

- Nodes talk only through their shaped links: under each launcher (``cluster/cluster
  mpirun``; ``srun`` of the bed's Slurm) and each netmod (ofi; ucx, MPICH's default), a
  16 MiB point-to-point transfer between two nodes must take at least the link's time
  (the tbf bucket and 10% allowed for), and MPICH's shared-memory segments must be
  shared by the ranks of a node and invisible to the other node (``cluster_p2p_bw.py``).
  When the nodes shared /dev/shm and the PID space, UCX carried the transfer through
  shared memory at 2-4 GB/s, 15-30 times the link.
- ``sbatch -N 2 --ntasks-per-node 2 jobs/hierarchical.sbatch`` as a user would submit it
  (no netmod chosen: UCX), once with srun (PMI-2) and once with mpirun inside the
  allocation: it runs on two real nodes (layout from shared memory, not emulated) with
  exact results and prints no UCX warning (mpicoll's exit notices once ended unreceived:
  "unexpected tag-receive descriptor ... was not matched").

Where Slurm is not installed yet, installs it first through the CI recipe
(``.ci/slurm/start.sh``: apt, about 90 s, then ``.ci/slurm/stop.sh`` stops the one-node
cluster it started). Skips, saying why, where the cluster cannot be made or Slurm cannot be
installed, or with ``MPICOLL_CLUSTER_TESTS=0``.
About 50-80 s on two busy cores.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import Cluster, running_cluster

ROOT = Path(__file__).resolve().parents[2]
CI_SLURM = ROOT / ".ci" / "slurm"
PROBE = Path(__file__).resolve().parent / "cluster_p2p_bw.py"
#: A transfer may beat the link's time by this fraction (timer and rate granularity).
LINK_MARGIN = 0.10
UCX_COMPLAINTS = re.compile(r"UCX +(WARN|ERROR)")


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
    with running_cluster(tmp_path_factory, "s", "--nodes", "2", "--bandwidth", "1gbit",
                         "--slots", "2", "--slurm", up_timeout=150, down_timeout=90,
                         prepare=_ensure_slurm_installed) as (c, up):
        assert "srun -N 2 hostname -> n1 n2" in up.stdout, up.stdout
        yield c


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


@pytest.mark.parametrize("launcher,netmod", [("mpirun", "ofi"), ("mpirun", "ucx"),
                                             ("srun", "ofi"), ("srun", "ucx")])
def test_nodes_talk_only_through_their_shaped_links(slurm_cluster: Cluster, launcher: str,
                                                    netmod: str) -> None:
    """16 MiB from a rank on n1 to one on n2 takes at least the link's time, whichever the
    launcher and netmod; the ranks of a node share MPICH's segments, other nodes see none.

    ``cluster/cluster mpirun`` uses ofi with libfabric's tcp provider unless told otherwise;
    under srun nothing is chosen for ucx (MPICH's default, as a user's job gets it) and
    libfabric picks the provider for ofi."""
    env = {"MPIR_CVAR_DEBUG_SUMMARY": "1", "UCX_PROTO_INFO": "y"}
    if launcher == "mpirun" or netmod == "ofi":
        env["MPIR_CVAR_CH4_NETMOD"] = netmod
    if launcher == "mpirun":
        cmd = ["mpirun", "-n", "4", "-ppn", "2"]
    else:
        cmd = ["slurm", "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmi2", "-t", "2"]
    r = slurm_cluster.run(*cmd, sys.executable, str(PROBE), "--bytes", str(16 << 20),
                          env=env, timeout=90)
    out = r.stdout
    assert r.returncode == 0, f"rc {r.returncode}:\n{out}"
    assert not UCX_COMPLAINTS.search(out), out
    m = re.search(r"^p2p inter (\S+)->(\S+): (\d+) B, best ([0-9.]+) s, ([0-9.]+) MB/s", out,
                  re.MULTILINE)
    assert m and m.group(1) != m.group(2), out
    size, best = int(m.group(3)), float(m.group(4))
    rate, burst = slurm_cluster.link()
    floor = (size - burst) / rate  # the bucket passes at once, the rest at the link's rate
    assert best >= (1 - LINK_MARGIN) * floor, (
        f"{launcher}/{netmod}: {size} B from {m.group(1)} to {m.group(2)} in {best:.4f} s "
        f"({size / best / 1e6:.0f} MB/s), faster than the link allows ({floor:.4f} s at "
        f"{rate / 1e6:.0f} MB/s): a transport bypasses the shaped link\n{out}")
    if netmod == "ucx":  # UCX ran, and took the peer on the other node for a remote one
        assert "ucp_context" in out and "inter-node cfg" in out, out
    else:
        assert "libfabric provider:" in out and "ucp_context" not in out, out
    seen: dict[str, set[frozenset[str]]] = {}
    for host, names in re.findall(r"^shm rank \d+ on (\S+): ?(.*)$", out, re.MULTILINE):
        seen.setdefault(host, set()).add(frozenset(names.split()))
    assert sorted(seen) == ["n1", "n2"], out
    assert all(len(views) == 1 and next(iter(views)) for views in seen.values()), (
        f"the ranks of a node do not see the same MPICH shared-memory segments:\n{out}")
    assert not set.intersection(*(set(next(iter(v))) for v in seen.values())), (
        f"a node sees another node's /dev/shm:\n{out}")


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_hierarchical_job_on_two_nodes(slurm_cluster: Cluster, tmp_path: Path,
                                       launcher: str) -> None:
    env = {"MPICOLL_LAUNCHER": launcher, "HIER_COUNTS": "0,1,7,1000,65537",
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
    assert not UCX_COMPLAINTS.search(text), f"UCX complained in job {job}:\n{text}"
