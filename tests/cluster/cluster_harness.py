"""Helpers for the namespace-cluster tests: a private cluster/cluster instance to drive."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster" / "cluster"


class Cluster:
    """A private namespace cluster: its state directory, prefix, and helpers to run in it."""

    def __init__(self, state: Path, prefix: str) -> None:
        self.state = state
        self.prefix = prefix
        self.env = dict(os.environ, MPICOLL_CLUSTER_DIR=str(state),
                        MPICOLL_CLUSTER_PREFIX=prefix, PYTHONPATH=str(ROOT),
                        PYTHONUNBUFFERED="1")
        mpirun = Path(sys.executable).parent / "mpirun"
        if mpirun.exists():
            self.env["MPICOLL_MPIRUN"] = str(mpirun)
        for var in ("MPICOLL_RANKS_PER_NODE", "MPICOLL_ALGORITHM", "MPICOLL_TUNING_FILE"):
            self.env.pop(var, None)  # the real layout, the shipped table
        for var in ("MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "FI_TCP_IFACE", "UCX_TLS",
                    "UCX_NET_DEVICES"):
            self.env.pop(var, None)  # the netmod and transports are the tests' to choose

    def run(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """``cluster/cluster ARGS`` with a timeout (the whole process group killed after it)."""
        proc = subprocess.Popen([str(CLUSTER), *args], cwd=ROOT, env={**self.env, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"cluster {' '.join(args)} timed out after {timeout} s:\n{out}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def link(self) -> tuple[float, int]:
        """(rate in bytes/s, tbf bucket in bytes) of the nodes' links, from the config."""
        config = dict(line.split("=", 1) for line in
                      (self.state / "config").read_text().split())
        return rate_bytes(config["bandwidth"]), int(config["burst"])

    def namespaces(self) -> list[str]:
        """Network namespaces that carry this cluster's prefix."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False,
                             timeout=10).stdout
        return [w.split()[0] for w in out.splitlines() if w.startswith(self.prefix + "-")]


def rate_bytes(rate: str) -> float:
    """A tc rate (``1gbit``, ``100mbit``, ``125mbps``) in bytes per second."""
    m = re.fullmatch(r"([0-9.]+)([kmgt]?)(bit|bps)?", rate.lower())
    if not m:
        raise ValueError(f"bad rate {rate!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / (1 if m.group(3) == "bps" else 8)


def unavailable() -> str | None:
    """Why the namespace cluster cannot run here, or None."""
    if os.environ.get("MPICOLL_CLUSTER_TESTS", "1") == "0":
        return "MPICOLL_CLUSTER_TESTS=0"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root: the namespace cluster needs root (ip netns, veth, tc)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"'{tool}' not found"
    return None


def new_cluster(tmp_path_factory: pytest.TempPathFactory, tag: str) -> Cluster:
    """A cluster with a private state directory and namespace prefix (not started)."""
    return Cluster(tmp_path_factory.mktemp(f"cluster-{tag}") / "state",
                   f"mpct{os.getpid() % 100000}{tag}")


@contextlib.contextmanager
def running_cluster(tmp_path_factory: pytest.TempPathFactory, tag: str, *up_args: str,
                    up_timeout: float = 60, down_timeout: float = 60,
                    prepare: Callable[[], None] | None = None
                    ) -> Iterator[tuple[Cluster, subprocess.CompletedProcess]]:
    """A cluster brought up with ``cluster/cluster up UP_ARGS`` for the ``with`` block,
    and its ``up`` output; always torn down, with no namespace left. Skips where the
    cluster cannot run (:func:`unavailable`, or ``up`` exiting 77); ``prepare`` runs once
    the cluster is known to be possible, before ``up``."""
    why = unavailable()
    if why:
        pytest.skip(why)
    if prepare is not None:
        prepare()
    what = "cluster or Slurm" if "--slurm" in up_args else "cluster"
    c = new_cluster(tmp_path_factory, tag)
    try:
        up = c.run("up", *up_args, timeout=up_timeout)
        if up.returncode == 77:
            pytest.skip(f"{what} cannot run here: "
                        + (up.stdout.strip().splitlines() or ["?"])[-1])
        slurm = " --slurm" if "--slurm" in up_args else ""
        assert up.returncode == 0, f"cluster up{slurm} failed ({up.returncode}):\n{up.stdout}"
        yield c, up
    finally:
        down = c.run("down", timeout=down_timeout)
        assert down.returncode == 0, down.stdout
        assert not c.namespaces(), f"namespaces left after down: {c.namespaces()}"
