"""GPU: the parameter server with CuPy arrays and torch CUDA tensors as parameters,
gradients and ``out`` (every layout the world size allows, uncompressed and compressed)
pulls the same bits as with host arrays; results land in device arrays. Under mpirun at
1, 2 and 4 ranks sharing one GPU; skipped, with the reason, without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import gpu_skip_reason, torch_cuda_skip_reason
from test_ps_device_mpi import CASES, train

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120),
              pytest.mark.skipif(_REASON is not None, reason=f"GPU tests: {_REASON}")]


@pytest.fixture(scope="module", autouse=True)
def device():
    from mpicoll.gpu.device import select_device
    return select_device()


class CupySide:
    """CuPy arrays on this rank's device."""

    @property
    def device_type(self):
        import cupy
        return cupy.ndarray

    @staticmethod
    def put(a: np.ndarray):
        import cupy
        return cupy.asarray(a)

    @staticmethod
    def get(a) -> np.ndarray:
        import cupy
        return cupy.asnumpy(a)

    @staticmethod
    def clobber(a) -> None:
        a.fill(1e6)


class TorchSide:
    """torch CUDA tensors in; pulls without ``out`` come back as CuPy arrays."""

    device_type = object

    @staticmethod
    def put(a: np.ndarray):
        import torch
        return torch.as_tensor(a, device="cuda")

    @staticmethod
    def get(a) -> np.ndarray:
        import cupy
        return a.cpu().numpy() if type(a).__module__.startswith("torch") else cupy.asnumpy(a)

    @staticmethod
    def clobber(a) -> None:
        a.fill_(1e6)


@pytest.mark.parametrize("layout,compression", CASES)
def test_cupy_arrays_give_the_host_results(layout, compression):
    assert train(layout, compression, CupySide()) == train(layout, compression)


def test_torch_cuda_tensors_give_the_host_results():
    reason = torch_cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    layout, compression = CASES[-1]
    assert train(layout, compression, TorchSide()) == train(layout, compression)
