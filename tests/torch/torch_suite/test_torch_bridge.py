"""torch_bridge.py: torch's multi-process harness (``FSDPTest``) run by the MPI world's
ranks on "mpicoll", with torch's own FSDP2 helpers (its ``MLP``, its parity check against
``replicate``) as torch's FSDP2 tests use them; the whole-suite runs of torch's FSDP2
files: docs/results/torch_distributed_torch_tests.md."""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.distributed as dist
import torch_bridge
from mpi4py import MPI
from torch.distributed._composable import replicate
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_fsdp import MLP, FSDPTest, check_sharded_parity

SIZE = MPI.COMM_WORLD.Get_size()


class TestBridge(FSDPTest):
    @property
    def world_size(self) -> int:
        return SIZE

    def test_each_rank_is_its_mpi_rank_on_the_backend(self) -> None:
        self.assertEqual(dist.get_backend(), torch_bridge.BACKEND)   # "mpicoll" in CI
        self.assertEqual((self.rank, dist.get_rank(), dist.get_world_size()),
                         (MPI.COMM_WORLD.Get_rank(),) * 2 + (SIZE,))
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), SIZE * (SIZE + 1) / 2)

    def test_fsdp2_trains_as_replicate(self) -> None:
        """fully_shard (uneven shards: 28 rows over the ranks) against replicate, Adam, 4
        steps on rank-dependent inputs; the parameters then equal on every rank (checked
        over MPI, outside torch)."""
        torch.manual_seed(42)
        model = MLP(7)
        ref = copy.deepcopy(model)
        replicate(ref)
        ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for module in (model.in_proj, model.out_proj, model):
            fully_shard(module)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        check_sharded_parity(self, ref, model)
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((2, 7))
        first = None
        for _ in range(4):
            losses = []
            for net, opt in ((ref, ref_optim), (model, optim)):
                opt.zero_grad()
                loss = net(inp).sum()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            self.assertEqual(losses[0], losses[1])
            first = losses[0].item() if first is None else first
        check_sharded_parity(self, ref, model)
        flat = torch.cat([p.detach().flatten() for p in ref.parameters()]).numpy()
        every = MPI.COMM_WORLD.allgather(flat)
        self.assertTrue(all(np.array_equal(every[0], other) for other in every))
        self.assertEqual(len(set(MPI.COMM_WORLD.allgather(first))), SIZE)  # inputs differed
