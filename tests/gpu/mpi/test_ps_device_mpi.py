"""The parameter server with device arrays, on the CPU: fake device arrays
(``__cuda_array_interface__`` over numpy, :class:`doubles.device_backend.FakeDevice`)
handled by their registered device backend (:class:`doubles.device_backend.SimulatedBackend`
through :func:`mpicoll.gpu.backends.registered`), every layout this world size allows, uncompressed and
compressed. Each case runs twice, with host and with device arrays, and the values every
worker pulls must be the same bits; results land in device arrays; mixed device and host
arrays in one call fail on every rank taking part.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from gpu_helpers import FakeDevice, SimulatedBackend
from mpicoll.gpu import backends
from mpicoll.ps import COLOCATED, ParameterServer, PSError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
STEPS = 3
#: (layout, compression) at this world size: a separate server where one fits
CASES = [(COLOCATED, None), (COLOCATED, "int8:8")] + \
    ([(1, None), (1, "onebit:8")] if SIZE > 1 else []) + ([(2, "topk:0.3")] if SIZE > 2 else [])


def _params() -> dict[str, np.ndarray]:
    """A float64 matrix split over the servers (odd size), a float32 vector, a 0-d one."""
    return {"w": np.arange(23 * 5, dtype=np.float64).reshape(23, 5) / 8.0 - 3.0,
            "v": np.linspace(-1, 1, 29).astype(np.float32),
            "s": np.array(0.75, dtype=np.float64)}


def _grads(worker: int, step: int) -> dict[str, np.ndarray]:
    out = {}
    for name, p in _params().items():
        idx = np.arange(p.size, dtype=np.float64).reshape(p.shape)
        out[name] = np.array(np.sin(idx * 0.37 + worker * 1.3 + step * 0.71) * (1 + worker),
                             dtype=p.dtype)
    return out


class FakeSide:
    """How the tests make, read and clobber this side's arrays (fake device arrays)."""

    device_type = FakeDevice

    @staticmethod
    def put(a: np.ndarray) -> FakeDevice:
        return FakeDevice(a.copy())

    @staticmethod
    def get(a: FakeDevice) -> np.ndarray:
        return a.array

    @staticmethod
    def clobber(a: FakeDevice) -> None:
        a.array[...] = 1e6


def train(layout, compression, side=None) -> list[dict[str, bytes]]:
    """Pull, then push_pull STEPS times (``side``: device arrays made by ``side.put``;
    into the caller's ``out`` on odd steps, new device arrays on even ones; device
    gradients are overwritten right after push_pull_async is called, which staging makes
    harmless; host ones must not be). Returns what this worker pulled, as bytes."""
    def make(arrays):
        return {n: (a.copy() if side is None else side.put(a)) for n, a in arrays.items()}

    def read(arrays):
        return {n: (a if side is None else side.get(a)).tobytes() for n, a in arrays.items()}

    ps = ParameterServer(make(_params()), comm=COMM, num_servers=layout, optimizer="adam",
                         lr=0.05, compression=compression, chunk_bytes=96, split_bytes=64)
    pulled = []
    try:
        if ps.is_server:
            ps.serve()
            return pulled
        out = make(_params())
        pulled.append(read(ps.pull(out=out)))
        for step in range(STEPS):
            grads = make(_grads(ps.worker_index, step))
            handle = ps.push_pull_async(grads, out=out if step % 2 else None)
            if side is not None:      # staged at the call: the caller may reuse them
                for g in grads.values():
                    side.clobber(g)
            got = handle.wait()
            if side is not None:
                assert all(isinstance(a, side.device_type) for a in got.values())
                if step % 2:
                    assert all(got[n] is out[n] for n in out)
            pulled.append(read(got))
        ps.close()
    finally:
        ps.free()
    return pulled


@pytest.mark.parametrize("layout,compression", CASES)
def test_device_arrays_give_the_host_results(layout, compression):
    want = train(layout, compression)
    with backends.registered(SimulatedBackend()) as backend:
        got = train(layout, compression, FakeSide)
    copies = backend.simulated_copies
    assert got == want
    assert len(got) == (0 if layout != COLOCATED and RANK < layout else STEPS + 1)
    if got:                          # gradients went to the host, pulls came back
        assert copies.copied_bytes["d2h"] > 0 and copies.copied_bytes["h2d"] > 0


def _mixed(arrays: dict) -> dict:
    mixed = dict(arrays)
    mixed["v"] = FakeDevice(arrays["v"].copy())
    return mixed


@pytest.mark.parametrize("layout", [COLOCATED] + ([1] if SIZE > 1 else []))
def test_mixed_device_and_host_arrays_fail_on_every_rank(layout):
    with backends.registered(SimulatedBackend()):
        with pytest.raises(ValueError, match="same side"):     # constructor: every rank
            ParameterServer(_mixed(_params()) if RANK == SIZE - 1 else _params(),
                            comm=COMM, num_servers=layout)
        ps = ParameterServer(_params(), comm=COMM, num_servers=layout)
        try:
            if ps.is_server:
                ps.serve()
                return
            bad = ps.worker_index == 0
            grads = _mixed(_grads(0, 0)) if bad else _grads(0, 0)
            if layout == COLOCATED or bad:     # co-located: every rank; else the caller
                with pytest.raises(PSError, match="same side|bad arguments"):
                    ps.push_pull(grads)
                with pytest.raises(PSError, match="same side|bad arguments"):
                    ps.pull(out=_mixed(_params()) if bad else None)
                with pytest.raises(PSError, match="C-contiguous float64 device array|bad arg"):
                    ps.pull(out={"w": FakeDevice(np.zeros(3))} if bad else None)
            ps.push_pull(_grads(0, 1))         # the next call works
            ps.close()
        finally:
            ps.free()
