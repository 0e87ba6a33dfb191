"""Node layout of a communicator: node-local and cross-node communicators.

Ranks that share memory form a node (``MPI.COMM_TYPE_SHARED``; MPICH takes the node map
from the process manager, hydra's hosts or Slurm's nodes, not from hostnames: see
docs/cluster.md). ``MPICOLL_RANKS_PER_NODE=k``
instead cuts the runtime's world into emulated nodes of ``k`` consecutive ranks (the last
one may hold fewer), so node-aware code runs and is tested on one machine; a
subcommunicator's ranks keep their world rank's node, as they keep their host on a
cluster (a group of one rank of each node spans as many nodes). The layout is computed
collectively once per communicator and cached on its context.
"""
from __future__ import annotations

from mpi4py import MPI

from . import config
from .errors import MismatchError
from .runtime import comms
from .runtime import world as runtime_world

__all__ = ["Topology"]


class Topology:
    """Node layout of one communicator.

    Attributes:
        node_comm: the ranks on this rank's node (ordered by rank).
        cross_comm: the ranks with the same local rank on every node (ordered by rank);
            for local rank 0 these are the node leaders.
        local_rank, local_size: this rank's place on its node, and the node's size.
        node_index, num_nodes: this rank's node (ordered by lowest rank) and how many.
        node_sizes: the size of every node, by node index.
        uniform: every node holds the same number of ranks.
        emulated: the layout comes from ``MPICOLL_RANKS_PER_NODE``.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        rank = comm.Get_rank()
        per_node = config.env_int("MPICOLL_RANKS_PER_NODE", 0, minimum=0)
        # Every rank must agree on the emulation setting, or the splits below would not match.
        settings = comm.allgather(per_node)
        if len(set(settings)) != 1:
            raise MismatchError(f"MPICOLL_RANKS_PER_NODE differs across ranks: {settings}")
        self.emulated = per_node > 0
        if self.emulated:
            self.node_comm = comms.split(comm, _world_rank(comm, rank) // per_node, rank,
                                         "topology")
        else:
            self.node_comm = comms.split_shared(comm, rank, "topology")
        self.local_rank = self.node_comm.Get_rank()
        self.local_size = self.node_comm.Get_size()
        self.cross_comm = comms.split(comm, self.local_rank, rank, "topology")
        first = self.node_comm.allreduce(rank, op=MPI.MIN)  # identifies the node
        sizes = dict(comm.allgather((first, self.local_size)))  # node's first rank -> size
        firsts = sorted(sizes)
        self.node_sizes = [sizes[f] for f in firsts]
        self.num_nodes = len(firsts)
        self.node_index = firsts.index(first)
        self.uniform = len(set(self.node_sizes)) == 1

    def free(self) -> None:
        """Free the node and cross communicators."""
        comms.free(self.node_comm)
        comms.free(self.cross_comm)

    def __repr__(self) -> str:
        return (f"Topology(nodes={self.node_sizes}, local_rank={self.local_rank}, "
                f"node_index={self.node_index}, emulated={self.emulated})")


def _world_rank(comm: MPI.Comm, rank: int) -> int:
    """``rank`` of ``comm`` in the runtime's world (``rank`` itself outside it)."""
    mine, world = comm.Get_group(), runtime_world.comm().Get_group()
    try:
        (placed,) = MPI.Group.Translate_ranks(mine, [rank], world)
    finally:
        mine.Free()
        world.Free()
    return rank if placed == MPI.UNDEFINED else placed
