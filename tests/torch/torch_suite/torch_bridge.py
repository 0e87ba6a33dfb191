"""pytest plugin: torch's multi-process distributed tests, run by the ranks of an MPI world.

torch's ``MultiProcessTestCase`` (the base of ``FSDPTest``, which the FSDP2 test files
use) starts its ranks itself: the test process spawns ``world_size`` children that meet
through a file store. A backend over MPI cannot serve such children: MPI must start
them. Under ``mpirun`` this plugin makes every MPI rank one of the test's ranks instead:

- no child is spawned (``_spawn_processes``/``_fork_processes`` do nothing);
- each rank runs the test as torch's child would (the class's ``_run``: its
  ``init_process_group`` with rank 0's store file, the test, torch's
  ``destroy_process_group``), in this process;
- without CUDA, ``FSDPTest`` runs its tests through torch's CPU-capable ``_run`` (that of
  ``FSDPTestMixin``, which needs accelerators only off the CPU): torch 2.13's ``FSDPTest``
  overrides it with one that skips every test where ranks outnumber accelerators, so on
  a CPU-only machine all its tests would skip, on gloo as on "mpicoll";
- the ranks' outcomes are exchanged and judged as torch's parent judges its children's
  exit codes: any rank's error fails the test on every rank (with each failing rank's
  traceback), torch's skip codes skip it, a test written for another world size skips.

The backend is ``TORCH_BRIDGE_BACKEND`` (default ``"mpicoll"``; ``"gloo"`` runs the same
tests on gloo for comparison): ``FSDPTest``'s ``DISTRIBUTED_BACKEND``. Usage, from the
repository root, for a test file of torch's source tree (not in the wheel, not kept
here)::

    mpirun -n 2 env PYTHONPATH=tests/torch/torch_suite python -m pytest -p torch_bridge \
        path/to/pytorch/test/distributed/_composable/fsdp/test_fully_shard_training.py

Every rank prints pytest's report; they agree (the verdict is exchanged per test).
"""
from __future__ import annotations

import os
import unittest
from typing import Any, Callable

from mpi4py import MPI

#: The backend the bridged tests use.
BACKEND = os.environ.get("TORCH_BRIDGE_BACKEND", "mpicoll")


def pytest_configure(config: Any) -> None:  # noqa: ARG001
    import torch  # noqa: PLC0415
    from torch.testing._internal import common_fsdp  # noqa: PLC0415
    from torch.testing._internal.common_distributed import (  # noqa: PLC0415
        MultiProcessTestCase,
    )

    import mpicoll.torch  # noqa: F401, PLC0415  registers "mpicoll"

    common_fsdp.DISTRIBUTED_BACKEND = BACKEND
    if not torch.cuda.is_available():
        common_fsdp.FSDPTest._run = common_fsdp.FSDPTestMixin.__dict__["_run"]
    MultiProcessTestCase._spawn_processes = _no_children
    MultiProcessTestCase._fork_processes = _no_children
    MultiProcessTestCase._join_processes = _run_here


def skip_messages() -> dict[int, str]:
    """torch's skip exit codes (``TEST_SKIPS``) and their messages."""
    from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: PLC0415

    return {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


def _no_children(self: Any) -> None:  # noqa: ARG001
    """The ranks are MPI's: nothing to start."""


def _run_here(self: Any, fn: Callable[[], None]) -> None:  # noqa: ARG001
    """Run this test as rank ``MPI.COMM_WORLD.Get_rank()`` of its world, then judge every
    rank's outcome as torch's parent process judges its children's."""
    import torch  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    wanted = int(self.world_size)
    if wanted != comm.Get_size():
        raise unittest.SkipTest(f"written for {wanted} ranks; this MPI world has "
                                f"{comm.Get_size()}")
    file_name = comm.bcast(self.file_name)          # rank 0's store file for every rank
    parent, child = torch.multiprocessing.Pipe()
    code = 0
    try:
        type(self)._run(comm.Get_rank(), self._current_test_name(), file_name, child,
                        fake_pg=getattr(self, "fake_pg", False))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    errors = []
    while parent.poll():
        try:
            errors.append(parent.recv())
        except EOFError:
            break
    outcomes = comm.allgather((code, "\n".join(errors)))
    skips = skip_messages()
    failed = {r: (c, e) for r, (c, e) in enumerate(outcomes) if c != 0 and c not in skips}
    if failed:
        raise AssertionError("\n".join(f"rank {r} (exit code {c}):\n{e}"
                                       for r, (c, e) in failed.items()))
    skipped = [c for c, _ in outcomes if c in skips]
    if skipped:
        raise unittest.SkipTest(skips[skipped[0]])
