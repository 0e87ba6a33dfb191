"""examples/train.py's ``flush_residuals`` in one process: after onebit + error feedback
with the local momentum compressed, moving the parameters by ``-lr e`` lands on the
uncompressed trajectory when the gradients do not depend on the parameters (a linear
loss), and the residuals start again from zero."""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

hvd = train.hvd


def _run(compression, steps: int, lr: float):
    """A linear loss ``sum(c_t * w)`` (gradient ``c_t``, step-dependent, not a function of
    ``w``) under SGD(momentum 0.9), through DistributedOptimizer with ``compression``
    (plain SGD, the uncompressed reference, for ``None``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if compression is not None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        opt.zero_grad()
        loss = sum((torch.randn(p.shape, generator=g) * (1 + step % 3) * p).sum()
                   for p in model.parameters())
        loss.backward()
        opt.step()
    return model, opt


def test_flush_lands_on_the_uncompressed_trajectory():
    hvd.init()
    try:
        if hvd.size() != 1:
            pytest.skip("one process only")
        lr = 0.05
        plain, _ = _run(None, 6, lr)
        model, opt = _run(hvd.Compression.onebit.with_momentum(0.9), 6, lr)
        far = max(float((p - q).detach().abs().max()) for p, q in
                  zip(model.parameters(), plain.parameters()))
        assert far > 1e-2                            # compression moved them
        residuals = {n: opt.error_feedback.residual(n).copy() for n in opt.error_feedback.keys()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert train.flush_residuals(opt, model, lr, 1.0) == 0     # one rank sends nothing
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-6)
            torch.testing.assert_close(
                p, before[name] - lr * torch.from_numpy(residuals[name]).view_as(p),
                rtol=0, atol=1e-6)
        assert len(opt.error_feedback) == 0
    finally:
        hvd.shutdown()
