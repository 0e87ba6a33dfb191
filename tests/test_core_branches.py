"""Serial tests of the core's rarely taken branches: bad arguments, fallbacks and guards
of the configuration, the contexts, the topology, the runtime's communicators, the cached
calls and the algorithms called directly (a world of one rank, no mpirun)."""
from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import config, context, fastpath
from mpicoll.algorithms import adasum, registry
from mpicoll.algorithms.allreduce_shm import shm_allreduce
from mpicoll.errors import CollectiveError, MismatchError
from mpicoll.ops import resolve_op
from mpicoll.runtime import comms
from mpicoll.runtime import world as runtime_world
from mpicoll.topology import Topology


@pytest.mark.parametrize("raw, expected", [("0", False), (" Off ", False), ("no", False),
                                           ("false", False), ("YES", True)])
def test_env_bool_reads_each_spelling(monkeypatch, raw, expected):
    """env_bool accepts 1/0, true/false, yes/no, on/off in any case and spacing."""
    monkeypatch.setenv("MPICOLL_CHECK", raw)
    config.refresh()
    try:
        assert config.env_bool("MPICOLL_CHECK", not expected) is expected
    finally:
        monkeypatch.delenv("MPICOLL_CHECK")
        config.refresh()


def test_env_bool_refuses_other_values_naming_the_variable(monkeypatch):
    """A value that is no boolean raises ValueError naming the variable and the value."""
    monkeypatch.setenv("MPICOLL_CHECK", "maybe")
    config.refresh()
    try:
        with pytest.raises(ValueError, match=r"MPICOLL_CHECK='maybe' is not a boolean"):
            config.env_bool("MPICOLL_CHECK", True)
    finally:
        monkeypatch.delenv("MPICOLL_CHECK")
        config.refresh()


def test_mpicoll_info_is_imported_on_first_use():
    """``mpicoll.info`` (the documented ``mpicoll.info()``) loads on attribute access in a
    fresh interpreter; another unknown attribute is an AttributeError."""
    code = ("import sys, mpicoll\n"
            "assert 'mpicoll.info' not in sys.modules\n"
            "m = mpicoll.info\n"
            "assert m is sys.modules['mpicoll.info'] and callable(m.info)\n"
            "try:\n"
            "    mpicoll.no_such_name\n"
            "except AttributeError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "module 'mpicoll' has no attribute 'no_such_name'" in out.stdout


def test_comm_null_is_refused_naming_the_argument():
    """A collective on a null intracommunicator (a freed one) raises ValueError naming
    ``comm``."""
    freed = MPI.COMM_WORLD.Dup()
    freed.Free()
    with pytest.raises(ValueError, match="comm is MPI.COMM_NULL"):
        mpicoll.allreduce(np.ones(3), comm=freed)


def test_a_communicator_mpi_cannot_describe_is_named_by_its_handle():
    """_comm_name falls back to the handle when MPI raises while naming the communicator."""
    def fail():
        raise MPI.Exception(MPI.ERR_COMM)

    fake = types.SimpleNamespace(Get_name=fail, handle=0x2A)
    assert context._comm_name(fake) == "communicator 0x2a"


def test_ranks_that_disagree_on_ranks_per_node_are_refused():
    """Topology raises MismatchError (before any split) when the ranks' settings differ."""
    fake = types.SimpleNamespace(Get_rank=lambda: 0, allgather=lambda value: [value, 2])
    with pytest.raises(MismatchError, match=r"MPICOLL_RANKS_PER_NODE differs across ranks: "
                                            r"\[0, 2\]"):
        Topology(fake)


def test_topology_repr_describes_the_layout():
    """A world of one rank is one node of one rank, not emulated."""
    topo = Topology(MPI.COMM_WORLD)
    try:
        assert repr(topo) == ("Topology(nodes=[1], local_rank=0, node_index=0, "
                              "emulated=False)")
    finally:
        topo.free()


def test_a_cached_call_takes_at_most_arity_arguments():
    """fastpath keys refuse more argument objects than ARITY, naming both numbers."""
    with pytest.raises(ValueError, match=f"at most {fastpath.ARITY} arguments, not 7"):
        fastpath.key("allreduce", *range(7))


@pytest.mark.parametrize("check", [True, False])
def test_a_bad_argument_raises_its_own_error_checked_or_not(check):
    """The rank whose argument is invalid raises that ValueError itself, after the
    agreement step in checked mode (not a CollectiveError)."""
    with pytest.raises(ValueError, match="unknown algorithm='no_such_algorithm'") as info:
        mpicoll.allreduce(np.ones(4), algorithm="no_such_algorithm", check=check)
    assert not isinstance(info.value, CollectiveError)


def test_world_of_an_object_without_a_handle_is_the_current_world():
    """world_of takes a communicator it cannot identify to belong to the current world."""
    assert runtime_world.world_of(object()) == runtime_world.generation()


def test_a_failed_creation_without_ulfm_raises_mpis_own_error():
    """Without ULFM a communicator creation's MPI error passes unchanged."""
    def make():
        raise MPI.Exception(MPI.ERR_OTHER)

    with pytest.raises(MPI.Exception) as info:
        comms._made(MPI.COMM_WORLD, make, "test", "owner")
    assert info.value.Get_error_class() == MPI.ERR_OTHER


def test_adasum_of_one_rank_or_nothing_leaves_the_buffer():
    """On one rank (or an empty buffer) Adasum is the identity."""
    buf = np.arange(6, dtype=np.float32)
    adasum.adasum_allreduce(buf, [6], MPI.COMM_SELF)
    assert buf.tolist() == list(range(6))


def test_adasum_refuses_counts_that_do_not_cover_the_buffer():
    """Counts that do not sum to the buffer's size raise ValueError before any message."""
    two = types.SimpleNamespace(Get_size=lambda: 2, Get_rank=lambda: 0)
    with pytest.raises(ValueError, match="counts sum to 5, the buffer has 6 elements"):
        adasum.adasum_allreduce(np.ones(6, np.float32), [2, 3], two)


def test_native_run_function_called_directly_reduces():
    """The registered native all-reduce, called as a run function (as hierarchical calls
    its inner all-reduce), reduces out of place and in place."""
    ctx = context.get_context(MPI.COMM_WORLD)
    run = registry.lookup("allreduce", "native")
    send, recv = np.arange(5, dtype=np.float64), np.zeros(5)
    run(ctx, send, recv, resolve_op("sum"))
    assert recv.tolist() == send.tolist()
    run(ctx, recv, recv, resolve_op("max"))
    assert recv.tolist() == send.tolist()


def test_shm_allreduce_refuses_device_buffers():
    """algorithm='shm' works on numpy buffers only: anything else is a TypeError."""
    ctx = context.get_context(MPI.COMM_WORLD)
    with pytest.raises(TypeError, match="host \\(numpy\\) buffers only"):
        shm_allreduce(ctx, [1.0], [0.0], resolve_op("sum"))
