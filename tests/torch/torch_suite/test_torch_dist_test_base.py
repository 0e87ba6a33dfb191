"""torch's ``DistributedTest._DistTestBase`` on the "mpicoll" backend: every rank of the
MPI world is one of the test's ranks, with one ``init_process_group("mpicoll")`` for all
its tests (rank and size from MPI; destroyed after them), as torch's ``TestMPIWithFork``
ran its own MPI backend.

Three settings make torch's suite treat "mpicoll" as it treats its MPI backend: the
backend name when the module is imported (conftest.py); "mpicoll" declared in
``DistTestCases.backend_feature`` for ``ddp``, ``subgroup``, ``plugin`` and ``gpu``
(where torch records what each backend implements; "mpicoll" takes CUDA tensors too, and
the ``gpu`` tests that run on the CPU, the object all-gathers, then run); ``BACKEND=mpi``
after the import, which exempts a fixed MPI world from torch's small- and odd-world-size
skips, so that the group tests run at n = 3. Which tests skip and why:
docs/results/torch_distributed_torch_tests.md.
"""
from __future__ import annotations

import os

import torch.distributed as dist
from mpi4py import MPI
from torch.testing._internal.common_distributed import DistTestCases
from torch.testing._internal.common_utils import TestCase

import mpicoll.torch  # noqa: F401  registers "mpicoll"

for _feature in ("ddp", "subgroup", "plugin", "gpu"):
    DistTestCases.backend_feature[_feature].add("mpicoll")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
)

# torch's small- and odd-world-size skips exempt its MPI backend (a fixed world, which
# torch ran at n >= 3); at n = 2 they apply, as on gloo (the *_group tests use ranks 1, 2)
if MPI.COMM_WORLD.Get_size() > 2:
    os.environ["BACKEND"] = "mpi"


class TestMpicollDistributed(TestCase, DistributedTest._DistTestBase):
    rank = MPI.COMM_WORLD.Get_rank()
    world_size = os.environ["WORLD_SIZE"]
    file_name = os.path.join(os.environ["TEMP_DIR"], "mpicoll_init_file")

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        dist.init_process_group("mpicoll")

    @classmethod
    def tearDownClass(cls) -> None:
        dist.destroy_process_group()
        super().tearDownClass()

    def _barrier(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        dist.barrier()
