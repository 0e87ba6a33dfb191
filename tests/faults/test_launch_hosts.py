"""The relaunching supervisor's host discovery and command lines (serial, no MPI job):
horovodrun's discovery format, Slurm's allocation (fake scontrol/sinfo on PATH), and the
mpiexec/srun lines for MPICH, Open MPI and Slurm."""
from __future__ import annotations

import shutil
import sys

import pytest

from mpicoll.elastic import launch_hosts as lh
from mpicoll.elastic.launch_command import mpiexec_argv, place, srun_argv
from mpicoll.elastic.launch_hosts import Host


def test_parse_hosts():
    text = "# hosts alive\nnode-1:4\n\nnode-2   # default slots\nnode-1:2\nn3.example:1\n"
    assert lh.parse_hosts(text, default_slots=3) == [
        Host("node-1", 4), Host("node-2", 3), Host("n3.example", 1)]
    assert lh.total_slots(lh.parse_hosts(text, default_slots=3)) == 8
    assert lh.parse_hosts("") == []
    for bad in ("node 1:2", "node:x", "node:2:3", "node:0"):
        with pytest.raises(lh.DiscoveryError, match="line 1"):
            lh.parse_hosts(bad)


def test_slurm_tasks_per_node():
    assert lh.slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert lh.slurm_tasks_per_node("4") == [4]
    with pytest.raises(lh.DiscoveryError, match="Slurm's format"):
        lh.slurm_tasks_per_node("2(3)")


def _fake_slurm(tmp_path, monkeypatch, sinfo_lines):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n[ \"$1 $2 $3\" = 'show hostnames n[1-3]' ] || exit 9\n"
        "printf 'n1\\nn2\\nn3\\n'\n")
    (bin_dir / "sinfo").write_text("#!/bin/sh\nprintf '" + "\\n".join(sinfo_lines) + "\\n'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_slurm_hosts_drop_nodes_down(tmp_path, monkeypatch):
    _fake_slurm(tmp_path, monkeypatch, ["n1 alloc", "n2 down*", "n3 mix"])
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert lh.slurm_hosts(env) == [Host("n1", 2), Host("n3", 1)]
    _fake_slurm(tmp_path / "b", monkeypatch, ["n1 idle*", "n2 drain", "n3 alloc"])
    assert lh.slurm_hosts({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "4"}) \
        == [Host("n3", 4)]
    with pytest.raises(lh.DiscoveryError, match="3 nodes"):
        lh.slurm_hosts({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "1,1"})
    with pytest.raises(lh.DiscoveryError, match="not inside a Slurm allocation"):
        lh.slurm_hosts({})


def test_placement_and_command_lines():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 4)]
    assert place(hosts, 3) == [Host("a", 2), Host("b", 1)]
    assert mpiexec_argv("mpiexec", "mpich", hosts, 3, ["-v"], ["python", "t.py"], []) == [
        "mpiexec", "-n", "3", "-hosts", "a:2,b:1", "-v", "python", "t.py"]
    assert mpiexec_argv("mpiexec", "mpich", [Host("localhost", 4)], 3, [], ["x"], []) == [
        "mpiexec", "-n", "3", "x"]
    assert mpiexec_argv("mpirun", "openmpi", hosts, 5, [], ["x"], ["A", "B"]) == [
        "mpirun", "-n", "5", "--host", "a:2,b:2,c:1", "-x", "A", "-x", "B", "x"]
    assert srun_argv(hosts, 5, [], ["x"]) == [
        "srun", "--nodelist=a,b,c", "--nodes=3", "--ntasks=5", "--kill-on-bad-exit=1",
        "--mpi=pmi2", "x"]


def test_discovery_scripts_that_cannot_run_or_answer(tmp_path, monkeypatch):
    """An empty command, a script without the execute bit, and one that does not answer
    in time: a DiscoveryError saying which."""
    with pytest.raises(lh.DiscoveryError, match="script is empty"):
        lh.run_discovery_script("  ")
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o644)
    with pytest.raises(lh.DiscoveryError, match="is not executable"):
        lh.run_discovery_script(str(script))
    monkeypatch.setattr(lh, "DISCOVERY_TIMEOUT_S", 0.2)
    with pytest.raises(lh.DiscoveryError, match="sleep 5 did not answer within 0 s"):
        lh.run_discovery_script("sleep 5")


def test_slurm_hosts_skip_sinfo_lines_without_a_state(tmp_path, monkeypatch):
    """A sinfo line without a state column says nothing: the node is not dropped."""
    _fake_slurm(tmp_path, monkeypatch, ["n1", "n2 down", "n3 idle"])
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "1(x3)"}
    assert lh.slurm_hosts(env) == [Host("n1", 1), Host("n3", 1)]


def test_find_mpiexec_explicit_beside_python_or_on_path(tmp_path, monkeypatch):
    """--mpiexec by name or path (refused when absent), else PATH's mpiexec or mpirun when
    none is beside this Python; a launcher that cannot run is taken for MPICH's."""
    from mpicoll.elastic import launch_command as lc

    assert lc.find_mpiexec("sh") == shutil.which("sh")
    with pytest.raises(lc.LaunchError, match="'no-such-mpiexec': not found"):
        lc.find_mpiexec("no-such-mpiexec")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mpirun = bin_dir / "mpirun"
    mpirun.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 5.0.3'\n")
    mpirun.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(bin_dir))
    assert lc.find_mpiexec() == str(mpirun)
    assert lc.mpiexec_flavour(str(mpirun)) == "openmpi"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(lc.LaunchError, match="no mpiexec next to this Python nor on PATH"):
        lc.find_mpiexec()
    assert lc.mpiexec_flavour(str(tmp_path / "absent-mpiexec")) == "mpich"
