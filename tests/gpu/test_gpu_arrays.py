"""Recognising device arrays and checking one call's buffers, with fake objects."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import FakeDevice, FakeDLPack
from mpicoll import IN_PLACE
from mpicoll.gpu import arrays


def test_host_things_are_not_device() -> None:
    for obj in (None, IN_PLACE, np.zeros(3), bytearray(4), memoryview(b"ab"), 3, "sum",
                [np.zeros(2), "f"], FakeDLPack(kind=1), FakeDLPack(kind=3)):
        assert not arrays.is_device(obj), obj


def test_device_things() -> None:
    assert arrays.is_device(FakeDevice(np.zeros(3)))
    assert arrays.is_device([FakeDevice(np.zeros(3)), "float"])  # mpi4py buffer spec
    assert arrays.is_device(FakeDLPack(kind=arrays.KDL_CUDA))
    assert arrays.is_device(FakeDLPack(kind=arrays.KDL_CUDA_MANAGED))


def test_a_failing_interface_property_means_host() -> None:
    class CpuTensorLike:
        @property
        def __cuda_array_interface__(self):
            raise AttributeError("not a CUDA tensor")

        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None):
            raise NotImplementedError

    assert not arrays.is_device(CpuTensorLike())


def test_a_refused_interface_on_a_cuda_object_means_device() -> None:
    """torch refuses the interface of a CUDA tensor that requires grad (RuntimeError); its
    DLPack device says CUDA, so the call takes the device path (where torch's own error
    says to detach it), not the host path's "not a numpy array"."""
    class CudaTensorRequiringGrad:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that "
                               "requires grad. Use var.detach().__cuda_array_interface__")

        def __dlpack_device__(self):
            return (arrays.KDL_CUDA, 0)

        def __dlpack__(self, stream=None):
            raise RuntimeError("Can't export tensors that require gradient, use "
                               "tensor.detach()")

    assert arrays.is_device(CudaTensorRequiringGrad())


def test_producer_stream_from_interface_v3() -> None:
    assert arrays.producer_stream(FakeDevice(np.zeros(2), stream=1234)) == 1234
    assert arrays.producer_stream(FakeDevice(np.zeros(2), stream=None)) is None
    assert arrays.producer_stream(FakeDLPack(kind=2)) is None


def test_device_id() -> None:
    assert arrays.device_id(FakeDevice(np.zeros(2), device=3)) == 3
    assert arrays.device_id(FakeDLPack(kind=2, ordinal=1)) == 1


def test_mixed_device_and_host_names_both_arguments() -> None:
    dev, host = FakeDevice(np.zeros(4)), np.zeros(4)
    with pytest.raises(TypeError, match=r"sendbuf is a device array \(.*FakeDevice on "
                                        r"cuda:0\) but recvbuf is a host array "
                                        r"\(numpy.ndarray\)"):
        arrays.call_kind("allreduce", (dev, host, "sum", "auto"))
    with pytest.raises(TypeError, match="recvbuf is a device array .* but sendbuf is a host"):
        arrays.call_kind("allgather", (host, dev, "auto"))
    with pytest.raises(TypeError, match="on the same GPU"):
        arrays.call_kind("allreduce", (dev, FakeDevice(np.zeros(4), device=1), "sum", "auto"))


def test_kinds_of_calls() -> None:
    dev = FakeDevice(np.zeros(4))
    assert arrays.call_kind("allreduce", (np.zeros(4), None, "sum", "auto")) == "host"
    assert arrays.call_kind("allreduce", (IN_PLACE, dev, "sum", "auto")) == "device"
    assert arrays.call_kind("broadcast", (dev, 0, "auto")) == "device"
    assert arrays.call_kind("reduce", (dev, None, "sum", 0, "auto")) == "device"
    assert not arrays.any_device((np.zeros(4), None, "sum", "auto"))
    assert arrays.any_device((IN_PLACE, dev, "sum", "auto"))
    assert arrays.any_device((np.zeros(4), dev, "sum", "auto"))  # mixed: route() raises


def test_non_contiguous_device_array() -> None:
    base = np.zeros((4, 6), np.float32)
    strided = FakeDevice(base[:, ::2], strides=(24, 8))
    with pytest.raises(ValueError, match=r"sendbuf must be contiguous \(got strides \(24, 8\)"
                                         r" for shape \(4, 3\)\)"):
        arrays.call_kind("allreduce", (strided, None, "sum", "auto"))
    # C order, Fortran order, and size-1 dimensions are contiguous
    for strides in (None, (24, 4), (4, 16)):
        arrays.check_contiguous(FakeDevice(base, strides=strides), "x")
    arrays.check_contiguous(FakeDevice(np.zeros((1, 5), np.float32), strides=(999, 4)), "x")
