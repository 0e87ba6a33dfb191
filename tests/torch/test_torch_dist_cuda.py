"""CUDA tensors on the "mpicoll" backend (real GPU; skipped without one): under
``mpirun -n 2`` (both ranks on device 0), every operation on CUDA tensors equals the same
operation's reference, including data written on a side stream just before the call
(the backend must wait for the caller's stream), and DDP on CUDA float64 equals one
process on the concatenated batch to 1e-10. CPU CI covers the same path with a simulated
device (tests/torch/mpi_dist/test_dist_device.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mpi_launcher import ROOT, mpirun_command

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401
    dist.init_process_group("mpicoll")
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def data(r, count, dtype=torch.float32):
        return ((torch.arange(count) * 3 + r * 5) % 7 + 1).to(dtype)

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        side = torch.cuda.Stream()
        t = torch.zeros(1 << 20, dtype=dtype, device=dev)
        with torch.cuda.stream(side):                  # written on a side stream ...
            torch.cuda._sleep(20_000_000)
            t.copy_(data(rank, 1 << 20, dtype).to(dev, non_blocking=True))
            work = dist.all_reduce(t, async_op=True)   # ... and reduced from it
        work.wait()
        expected = sum(data(r, 1 << 20, torch.float64) for r in range(n))
        assert torch.equal(t.cpu().double(), expected), dtype

    b = data(rank, 33).to(dev)
    dist.broadcast(b, src=n - 1)
    assert torch.equal(b.cpu(), data(n - 1, 33))
    g = torch.empty(7 * n, device=dev)
    gather_into(g, data(rank, 7).to(dev))
    assert torch.equal(g.cpu(), torch.cat([data(r, 7) for r in range(n)]))
    s = torch.empty(5, device=dev)
    scatter_from(s, data(rank, 5 * n).to(dev))
    assert torch.equal(s.cpu(), sum(data(r, 5 * n) for r in range(n))[5 * rank:5 * rank + 5])
    out = torch.empty(n * (rank + 1), device=dev)
    dist.all_to_all_single(out, torch.cat([torch.full((d + 1,), float(rank)) for d in range(n)]).to(dev),
                           [rank + 1] * n, [d + 1 for d in range(n)])
    assert torch.equal(out.cpu(), torch.cat([torch.full((rank + 1,), float(r)) for r in range(n)]))
    if n > 1:
        x = torch.full((4,), float(rank), device=dev)
        y = torch.empty(4, device=dev)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n),
                                       dist.P2POp(dist.irecv, y, (rank - 1) % n)])
        for req in reqs:
            req.wait()
        assert torch.equal(y.cpu(), torch.full((4,), float((rank - 1) % n)))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    ref.load_state_dict(net.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(net.to(dev), device_ids=[0])
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(3 * n, 5, generator=gen, dtype=torch.float64), torch.randn(3 * n, 2, generator=gen, dtype=torch.float64)
        for model, o, xs, ys in ((ddp, opt, x[3 * rank:3 * rank + 3].to(dev), y[3 * rank:3 * rank + 3].to(dev)), (ref, ref_opt, x, y)):
            o.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            o.step()
    for p, q in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=0, atol=1e-10)
    print("rank", rank, "CUDA OK", flush=True)
    dist.destroy_process_group()
""")


def test_cuda_operations_and_ddp(tmp_path):
    path = tmp_path / "cuda_dist.py"
    path.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(mpirun_command(2) + [sys.executable, str(path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("CUDA OK") == 2, out
