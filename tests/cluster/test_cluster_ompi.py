"""Open MPI with ULFM across the namespace bed: ``cluster/cluster ompirun`` (opt-in:
``MPICOLL_CLUSTER_ELASTIC=1``, like the bed's other fault test; 30-60 s on two busy
cores, skipped at once otherwise).

One cluster of 2 nodes x 2 slots at 1 Gb/s for the module, Open MPI 5 from
``tests/ompi_env.py`` (its mpirun found through ``ULFM_TEST_PYTHON``):

- every all-reduce algorithm checked exactly across the two nodes, with the real node
  layout (2 nodes of 2, from Open MPI's own node map);
- 16 MiB from a rank on n1 to one on n2 takes at least the link's time (Open MPI's
  shared-memory and CMA paths are not used between nodes), and the ranks of a node see
  the same Open MPI segments in ``/dev/shm``, the other node none of them;
- ULFM across nodes: a rank of n2 dies, the three survivors (both nodes) shrink under
  ``mpicoll.elastic.run`` and finish with the exact totals of that history.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import Cluster, running_cluster

import ompi_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LINK_MARGIN = 0.10

pytestmark = pytest.mark.skipif(os.environ.get("MPICOLL_CLUSTER_ELASTIC") != "1",
                                reason="opt-in: MPICOLL_CLUSTER_ELASTIC=1 (30-60 s)")

SHM_PROBE = """
import os
from mpi4py import MPI
c = MPI.COMM_WORLD
c.Barrier()
mine = sorted(f for f in os.listdir("/dev/shm") if f.startswith("sm_segment."))
c.Barrier()
for r, (host, names) in enumerate(c.gather((MPI.Get_processor_name(), mine)) or []):
    print(f"shm rank {r} on {host}: {' '.join(names)}", flush=True)
"""


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    python = ompi_env.ompi_python()   # fails, with the reason, without Open MPI + ULFM
    with running_cluster(tmp_path_factory, "o", "--nodes", "2", "--bandwidth", "1gbit",
                         "--slots", "2") as (c, _):
        yield c, python


def ompirun(bed: tuple[Cluster, Path], *args: str, timeout: float = 120
            ) -> subprocess.CompletedProcess:
    c, python = bed
    return c.run("ompirun", "--with-ft", "ulfm", "-n", "4", str(python), "-u", *args,
                 timeout=timeout, env={"ULFM_TEST_PYTHON": str(python)})


def test_every_allreduce_exact_across_two_nodes(bed: tuple[Cluster, Path]) -> None:
    r = ompirun(bed, str(HERE / "cluster_allreduce_check.py"), "--counts",
                "0,1,2,7,1001,65537", "--expect-nodes", "2,2")
    out = r.stdout
    assert r.returncode == 0, out
    assert "layout: nodes [2, 2] emulated False hosts ['n1', 'n1', 'n2', 'n2']" in out, out
    assert "cluster allreduce: all results correct" in out, out
    assert "Error" not in out, out    # e.g. a one-sided component failing its query


def test_nodes_talk_only_through_their_shaped_links(bed: tuple[Cluster, Path]) -> None:
    c, _ = bed
    r = ompirun(bed, str(HERE / "cluster_p2p_bw.py"), "--bytes", str(16 << 20))
    out = r.stdout
    assert r.returncode == 0, out
    m = re.search(r"^p2p inter (\S+)->(\S+): (\d+) B, best ([0-9.]+) s", out, re.MULTILINE)
    assert m and (m.group(1), m.group(2)) == ("n1", "n2"), out
    size, best = int(m.group(3)), float(m.group(4))
    rate, burst = c.link()
    floor = (size - burst) / rate
    assert best >= (1 - LINK_MARGIN) * floor, (
        f"{size} B from n1 to n2 in {best:.4f} s, faster than the link allows "
        f"({floor:.4f} s): Open MPI bypasses the shaped link\n{out}")
    r = ompirun(bed, "-c", SHM_PROBE)
    assert r.returncode == 0, r.stdout
    seen: dict[str, set[frozenset[str]]] = {}
    for host, names in re.findall(r"^shm rank \d+ on (\S+): ?(.*)$", r.stdout, re.MULTILINE):
        seen.setdefault(host, set()).add(frozenset(names.split()))
    assert sorted(seen) == ["n1", "n2"], r.stdout
    assert all(len(views) == 1 and next(iter(views)) for views in seen.values()), (
        f"the ranks of a node do not see the same Open MPI segments:\n{r.stdout}")
    assert not set.intersection(*(set(next(iter(v))) for v in seen.values())), (
        f"a node sees another node's /dev/shm:\n{r.stdout}")


def test_survivors_on_both_nodes_shrink_and_go_on(bed: tuple[Cluster, Path]) -> None:
    r = ompirun(bed, str(HERE / "cluster_ulfm_check.py"))
    out = r.stdout
    results = re.findall(r"^RESULT (\d+) (\S+) size (\d+) failed (\S+) (ok|WRONG)", out,
                         re.MULTILINE)
    assert sorted(results) == [("0", "n1", "3", "3", "ok"), ("1", "n1", "3", "3", "ok"),
                               ("2", "n2", "3", "3", "ok")], out
