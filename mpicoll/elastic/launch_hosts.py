"""Host discovery for the relaunching supervisor (:mod:`mpicoll.elastic.launch`).

Three sources, the first that applies:

1. ``--host-discovery-script S`` (horovodrun's format): ``S`` is run (split like a shell
   command line, no shell) and prints one host a line, ``hostname`` or ``hostname:slots``;
   a host without a count has ``--slots`` slots. Blank lines and ``#`` comments are
   skipped. The hosts printed are the hosts alive now.
2. Inside a Slurm allocation (``SLURM_JOB_NODELIST`` set): the allocation's nodes
   (``scontrol show hostnames``), their task slots (``SLURM_TASKS_PER_NODE``, e.g.
   ``2(x3),1``), minus the nodes ``sinfo`` reports down, drained, failed or not
   responding.
3. Otherwise this host, with ``--max-np`` slots.

No MPI, no numpy: the supervisor is not an MPI process.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass

__all__ = ["Host", "DiscoveryError", "parse_hosts", "run_discovery_script",
           "slurm_tasks_per_node", "slurm_hosts", "local_hosts", "is_local",
           "total_slots", "DISCOVERY_TIMEOUT_S"]

#: Longest a discovery command (script, scontrol, sinfo) may run.
DISCOVERY_TIMEOUT_S = 30.0

_HOST_LINE = re.compile(r"^([A-Za-z0-9_.\-\[\]]+)(?::(\d+))?$")
#: sinfo's short state names (``%t``) of a node that cannot run tasks.
_GONE_STATES = ("down", "drain", "drng", "fail", "failg", "maint", "unk", "futr",
                "npc", "pow_dn", "powered_down", "powering_down", "inval", "boot")


class DiscoveryError(RuntimeError):
    """The hosts could not be discovered (the script failed or printed nonsense)."""


@dataclass(frozen=True)
class Host:
    """One host and how many ranks it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def total_slots(hosts: list[Host]) -> int:
    """The slots of all ``hosts`` together."""
    return sum(host.slots for host in hosts)


def parse_hosts(text: str, default_slots: int = 1, source: str = "discovery") -> list[Host]:
    """Hosts from ``hostname[:slots]`` lines; a host named twice keeps its first entry.

    Raises:
        DiscoveryError: a line that is not ``hostname[:slots]``, or zero slots.
    """
    hosts: dict[str, Host] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            raise DiscoveryError(f"{source}, line {number}: {raw!r} is not "
                                 f"'hostname' or 'hostname:slots'")
        slots = int(match.group(2)) if match.group(2) else default_slots
        if slots < 1:
            raise DiscoveryError(f"{source}, line {number}: {raw!r} has no slots")
        hosts.setdefault(match.group(1), Host(match.group(1), slots))
    return list(hosts.values())


def _run(argv: list[str], what: str) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                              timeout=DISCOVERY_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise DiscoveryError(f"{what}: cannot run {argv[0]!r}: {exc.strerror}") from exc
    except PermissionError as exc:
        raise DiscoveryError(f"{what}: {argv[0]!r} is not executable") from exc
    except subprocess.TimeoutExpired as exc:
        raise DiscoveryError(f"{what}: {' '.join(argv)} did not answer within "
                             f"{DISCOVERY_TIMEOUT_S:.0f} s") from exc
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise DiscoveryError(f"{what}: {' '.join(argv)} exited with {proc.returncode}"
                             + (": " + " | ".join(tail) if tail else ""))
    return proc.stdout


def run_discovery_script(script: str, default_slots: int = 1) -> list[Host]:
    """The hosts a horovodrun-style discovery script prints (see the module's docstring).

    Raises:
        DiscoveryError: the script cannot run, fails, times out or prints a bad line.
    """
    argv = shlex.split(script)
    if not argv:
        raise DiscoveryError("the host discovery script is empty")
    return parse_hosts(_run(argv, "host discovery script"), default_slots,
                       source=f"host discovery script {argv[0]}")


def slurm_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1`` -> ``[2, 2, 2, 1]``).

    Raises:
        DiscoveryError: not in Slurm's format.
    """
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise DiscoveryError(f"SLURM_TASKS_PER_NODE={value!r} is not Slurm's format")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _gone_nodes(nodes: list[str]) -> set[str]:
    """The nodes among ``nodes`` that sinfo reports unable to run tasks (``*``: not
    responding)."""
    out = _run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], "sinfo")
    gone = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        name, state = fields[0], fields[1].lower()
        if state.endswith("*") or state.rstrip("*~#!%$@^-+") in _GONE_STATES:
            gone.add(name)
    return gone


def slurm_hosts(environ: dict[str, str] | None = None) -> list[Host]:
    """The allocation's nodes still able to run tasks, with their task slots.

    Slots per node: ``SLURM_TASKS_PER_NODE`` (``SLURM_JOB_CPUS_PER_NODE`` without it,
    1 without both).

    Raises:
        DiscoveryError: not in an allocation, or scontrol/sinfo failed.
    """
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise DiscoveryError("not inside a Slurm allocation (no SLURM_JOB_NODELIST)")
    nodes = _run(["scontrol", "show", "hostnames", nodelist], "scontrol").split()
    spec = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE")
    counts = slurm_tasks_per_node(spec) if spec else [1] * len(nodes)
    if len(counts) == 1:
        counts *= len(nodes)
    if len(counts) != len(nodes):
        raise DiscoveryError(f"{len(nodes)} nodes in {nodelist} but slot counts {spec!r}")
    gone = _gone_nodes(nodes)
    return [Host(node, slots) for node, slots in zip(nodes, counts) if node not in gone]


def local_hosts(slots: int) -> list[Host]:
    """This host with ``slots`` slots."""
    return [Host("localhost", slots)]


def is_local(name: str) -> bool:
    """Whether ``name`` is this host (so the launcher needs no remote start)."""
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname(),
                    socket.gethostname().split(".")[0])
