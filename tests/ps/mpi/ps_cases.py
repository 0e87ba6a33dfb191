"""Shared helpers of the parameter-server MPI suite."""
from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.ps import ParameterServer, PSError

COMM = MPI.COMM_WORLD
SIZE = COMM.Get_size()
RANK = COMM.Get_rank()

#: server counts to try at this world size (at least one worker must remain)
SERVER_COUNTS = [k for k in (1, 2) if k < SIZE]

#: small chunks and split threshold, so tests reach multi-chunk payloads and split tensors
SMALL = dict(chunk_bytes=96, split_bytes=64)


def wait_request(req: MPI.Request, deadline: float) -> bool:
    """Wait for ``req`` without spinning, at most ``deadline`` seconds; whether it completed."""
    end = time.monotonic() + deadline
    while not req.Test():
        if time.monotonic() > end:
            return False
        time.sleep(1e-3)
    return True


def need_servers(k: int | str) -> None:
    """Skip (identically on every rank) when ``k`` servers leave no worker (the
    co-located layout, ``k="colocated"``, runs at every size)."""
    if k != "colocated" and k >= SIZE:
        pytest.skip(f"{k} servers need more than {SIZE} ranks")


def expect_ps_error(fn: Callable[[], Any], *fragments: str) -> PSError:
    """Call ``fn``; assert that it raises :class:`PSError` whose message has every fragment."""
    with pytest.raises(PSError) as info:
        fn()
    for frag in fragments:
        assert frag in str(info.value), str(info.value)
    return info.value


def make_params() -> dict[str, np.ndarray]:
    """A float64 matrix (split over servers), a float32 vector, a small bias, a 0-d and an
    empty tensor."""
    return {"w": (np.arange(37 * 5, dtype=np.float64).reshape(37, 5) / 8.0),
            "v": np.linspace(-1, 1, 29).astype(np.float32),
            "b": np.array([0.5, -0.25, 1.0], dtype=np.float64),
            "s": np.array(0.75, dtype=np.float64),          # 0-d
            "e": np.zeros((0, 4), dtype=np.float32)}        # empty


def make_grads(params: dict[str, np.ndarray], worker: int, step: int) -> dict[str, np.ndarray]:
    """Gradients that depend on worker, element index and step (so mix-ups show)."""
    out = {}
    for name, p in params.items():
        idx = np.arange(p.size, dtype=np.float64).reshape(p.shape)
        g = np.sin(idx * 0.37 + worker * 1.3 + step * 0.71) * (1 + worker) + 0.01 * step
        out[name] = np.array(g, dtype=p.dtype)   # (0-d stays an array, not a scalar)
    return out


def run_ps(params: dict[str, Any] | None, worker_fn: Callable[[ParameterServer], Any],
           num_servers: int | str, between: Callable[[ParameterServer], None] | None = None,
           **kwargs: Any) -> tuple[ParameterServer, Any]:
    """Build a ParameterServer on COMM_WORLD, serve or run ``worker_fn``, tear down.

    ``between(ps)``, if given, runs on every rank after construction, before serve().
    A worker always closes (even when ``worker_fn`` or ``between`` raises), so servers
    return and the failure reaches the collective verdict instead of hanging the run.
    Returns (ps, result): result is ``ps.stats()`` on servers, ``worker_fn(ps)`` on workers.
    """
    ps = ParameterServer(params, comm=COMM, num_servers=num_servers, **kwargs)
    error = None
    result = None
    try:
        if between is not None:
            between(ps)
        if ps.is_server:
            ps.serve()
            result = ps.stats()
        else:
            result = worker_fn(ps)
    except BaseException as exc:  # noqa: BLE001  (re-raised after tear-down)
        error = exc
    finally:
        if ps.is_worker:
            try:
                ps.close()
            except Exception:  # noqa: BLE001
                pass
    ps.free()
    if error is not None:
        raise error
    return ps, result


def shared_tmpdir() -> str:
    """A fresh directory, the same path on every rank (made by rank 0)."""
    path = tempfile.mkdtemp(prefix="mpicoll-ps-") if RANK == 0 else None
    return COMM.bcast(path, root=0)


def remove_shared(path: str) -> None:
    """Remove a :func:`shared_tmpdir` once every rank is done with it."""
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def reference_bsp(params: dict[str, np.ndarray], grads_per_step: list[list[dict]],
                  update: Callable[[str, np.ndarray, np.ndarray, int], None]) -> list[dict]:
    """Single-process BSP: each step, sum contributors' gradients in worker order, divide
    by their number and call ``update(name, param, mean_grad, t)`` (t from 1).

    Returns the parameters after each step (copies).
    """
    w = {k: v.copy() for k, v in params.items()}
    history = []
    for t, grads in enumerate(grads_per_step, start=1):
        for name in sorted(w):
            acc = grads[0][name].copy()
            for g in grads[1:]:
                acc += g[name]
            if len(grads) > 1:
                np.divide(acc, len(grads), out=acc)
            update(name, w[name], acc, t)
        history.append({k: v.copy() for k, v in w.items()})
    return history


def sgd_update(lr: float) -> Callable:
    def update(name: str, p: np.ndarray, g: np.ndarray, t: int) -> None:
        p -= lr * g
    return update


def momentum_update(lr: float, mu: float) -> Callable:
    vel: dict[str, np.ndarray] = {}

    def update(name: str, p: np.ndarray, g: np.ndarray, t: int) -> None:
        v = vel.setdefault(name, np.zeros_like(p))
        v *= mu
        v += g
        p -= lr * v
    return update


def adam_update(lr: float, b1: float, b2: float, eps: float) -> Callable:
    state: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def update(name: str, p: np.ndarray, g: np.ndarray, t: int) -> None:
        m, v = state.setdefault(name, (np.zeros_like(p), np.zeros_like(p)))
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * (g * g)
        mhat = m / (1.0 - b1 ** t)
        vhat = v / (1.0 - b2 ** t)
        p -= lr * mhat / (np.sqrt(vhat) + eps)
    return update


def assert_params_equal(got: dict, want: dict, what: str = "") -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what} {k}")
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
