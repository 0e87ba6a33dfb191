"""What the CUDA backend asks of CuPy, with a fake ``cupy`` module that records the calls
(no GPU here): producers waited for, synchronisation before MPI touches device memory,
one set of pinned slots per thread, the error without CuPy, and ``auto`` never choosing
the host-only ``shm`` for device buffers."""
from __future__ import annotations

import contextlib
import sys
import threading
import types

import numpy as np
import pytest

import mpicoll.gpu
from mpicoll import buffers, config, selection
from mpicoll.gpu import backends


class _Stream:
    def __init__(self, *args, **kwargs) -> None:
        self.ptr, self.synced, self.waited = id(self), 0, []

    def synchronize(self) -> None:
        self.synced += 1

    def wait_event(self, event) -> None:
        self.waited.append(event)


class _Event:
    def __init__(self, **kwargs) -> None:
        self.on = None

    def record(self, stream) -> None:
        self.on = stream


@pytest.fixture
def cupy(monkeypatch):
    """A fake ``cupy``: ``calls`` lists the device-wide and per-stream synchronisations;
    the CuPy copies module is imported afresh on it, and forgotten afterwards."""
    fake = types.ModuleType("cupy")
    fake.calls = []
    current = _Stream()
    fake.cuda = types.SimpleNamespace(
        get_current_stream=lambda: current, Stream=_Stream, Event=_Event,
        ExternalStream=lambda ptr, device=None: ("external", ptr),
        Device=lambda device=0: contextlib.nullcontext(),
        alloc_pinned_memory=bytearray,
        runtime=types.SimpleNamespace(getDevice=lambda: 0,
                                      deviceSynchronize=lambda: fake.calls.append("device"),
                                      streamSynchronize=lambda p: fake.calls.append(p)))
    fake.current = current
    monkeypatch.setitem(sys.modules, "cupy", fake)
    saved = sys.modules.pop("mpicoll.gpu.cupy_copies", None)
    monkeypatch.setattr(mpicoll.gpu, "cupy_copies", None, raising=False)
    yield fake
    sys.modules.pop("mpicoll.gpu.cupy_copies", None)
    if saved is not None:
        sys.modules["mpicoll.gpu.cupy_copies"] = saved


def _interface(version: int, stream=None) -> object:
    cai = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": version}
    if version >= 3:
        cai["stream"] = stream
    return type("Foreign", (), {"__cuda_array_interface__": cai})()


def test_mpi_never_reads_a_device_buffer_before_its_kernels_ran(cupy) -> None:
    """A CuPy array handed to MPI (CUDA-aware: the algorithms' sends and receives) waits
    for CuPy's current stream first; host arrays do not."""
    device_array = type("ndarray", (), {"__module__": "cupy"})()
    assert buffers.msg(device_array)[0] is device_array
    assert cupy.current.synced == 1
    buffers.msg(np.zeros(3))
    assert cupy.current.synced == 1


def test_staged_copies_wait_for_producers_that_name_no_stream(cupy) -> None:
    """Interface version 2 (no stream; PyCUDA, Numba, ...): the device is synchronised
    before the copy streams read it; version 3 names its stream, or says ready."""
    from mpicoll.gpu.cupy_copies import copies_for

    copies = copies_for([])
    copies.begin([_interface(2), None])
    assert cupy.calls == ["device"]
    copies.begin([_interface(3, stream=None)])
    assert cupy.calls == ["device"]
    copies.begin([_interface(3, stream=7)])
    assert cupy.calls == ["device"]
    assert all(s.waited and s.waited[-1].on == ("external", 7)
               for s in copies.streams.values())
    backends.CudaBackend().synchronise(_interface(2))
    backends.CudaBackend().synchronise(_interface(3, stream=7))
    assert cupy.calls == ["device", "device", 7]


def test_threads_get_their_own_pinned_slots(cupy) -> None:
    """Two threads staging at once must not share slots (one's chunk overwrote the
    other's): one CupyCopies per device and thread."""
    from mpicoll.gpu.cupy_copies import copies_for

    mine = copies_for([])
    assert copies_for([]) is mine
    other = []
    t = threading.Thread(target=lambda: other.append(copies_for([])))
    t.start()
    t.join()
    assert other[0] is not mine and other[0].host_pool is not mine.host_pool


def test_without_cupy_the_error_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(ImportError, match=r"need CuPy: pip install 'mpicoll\[cuda12\]'"):
        backends.CudaBackend().array_module(_interface(3))
    with pytest.raises(ImportError, match="need CuPy"):
        backends.CudaBackend().copies([_interface(3)])


def test_auto_never_chooses_shm_for_device_buffers(monkeypatch) -> None:
    """``shm`` reduces in host shared memory: device buffers on a CUDA-aware MPI raised
    its TypeError wherever the tuning table (or ``MPICOLL_ALGORITHM``) chose it."""
    monkeypatch.setenv("MPICOLL_ALGORITHM", "shm")
    config.refresh()
    try:
        assert selection.resolve_algorithm("allreduce", "auto", 4, 4, 8 << 20) == "shm"
        name = selection.resolve_algorithm("allreduce", "auto", 4, 4, 8 << 20, host=False)
        assert name == selection.builtin_choice("allreduce", 4, 4, 8 << 20) != "shm"
    finally:
        monkeypatch.delenv("MPICOLL_ALGORITHM")
        config.refresh()
