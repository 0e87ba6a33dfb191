"""Shared pieces of the GPU tests: fake device arrays (:class:`FakeDevice` and
:func:`fake_copies` come from tests/doubles/device_backend.py), rank data, references, a
world of simulated ranks (threads) for the staged pipeline, and the skip reasons of GPU
tests."""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from mpicoll.partition import block_bounds

from doubles.device_backend import FakeDevice, SimulatedBackend, fake_copies  # noqa: F401


class FakeDLPack:
    """An object with only ``__dlpack__``/``__dlpack_device__`` (kind and ordinal given)."""

    def __init__(self, kind: int, ordinal: int = 0) -> None:
        self.kind, self.ordinal = kind, ordinal

    def __dlpack__(self, stream: Any = None) -> None:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.kind, self.ordinal)


def unwrap(obj: Any) -> Any:
    return obj.array if isinstance(obj, FakeDevice) else obj


def rank_data(rank: int, count: int, dtype: Any = np.int64, rep: int = 0) -> np.ndarray:
    """Small integers depending on rank, element index and repetition (exact)."""
    idx = np.arange(count, dtype=np.int64)
    return ((idx * 3 + rank * 5 + rep * 7) % 11 + 1).astype(dtype)


def reference(collective: str, inputs: list[np.ndarray], rank: int, root: int = 0
              ) -> np.ndarray | None:
    """What ``rank`` must get (sum reductions), from every rank's full input."""
    size = len(inputs)
    if collective in ("allreduce", "reduce", "reduce_scatter"):
        total = np.sum(np.stack([a.reshape(-1) for a in inputs]), axis=0).astype(
            inputs[0].dtype)
        if collective == "reduce":
            return total if rank == root else None
        if collective == "reduce_scatter":
            b = block_bounds(total.size, size)
            return total[b[rank]:b[rank + 1]]
        return total
    if collective == "allgather":
        return np.concatenate([a.reshape(-1) for a in inputs])
    if collective == "broadcast":
        return inputs[root].reshape(-1)
    raise ValueError(collective)


class SimulatedWorld:
    """``size`` ranks as threads; their host collectives meet at a barrier.

    Each rank's ``host_call(collective)`` returns a function that performs that host
    collective on numpy arguments in mpicoll's argument order (sum reductions), after
    checking that every rank made the same call with matching counts.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._slots: list[Any] = [None] * size
        self.calls: list[list[tuple]] = [[] for _ in range(size)]
        self.errors: list[BaseException] = []

    class _Comm:
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.size = rank, size

        def Get_rank(self) -> int:
            return self.rank

        def Get_size(self) -> int:
            return self.size

    def comm(self, rank: int) -> "SimulatedWorld._Comm":
        return self._Comm(rank, self.size)

    def host_call(self, collective: str, rank: int) -> Callable[[tuple], Any]:
        def call(args: tuple) -> Any:
            self.calls[rank].append((collective,) + tuple(_shape_of(a) for a in args))
            self._slots[rank] = args
            self._barrier.wait()
            everyone = list(self._slots)
            self._check_same(collective, everyone)
            write = _perform(collective, everyone, rank)  # reads everyone's input
            self._barrier.wait()  # nobody writes before every rank has read
            write()
            self._barrier.wait()  # nobody reuses its slot before all have written
            return None
        return call

    def _check_same(self, collective: str, everyone: list[tuple]) -> None:
        counts = [_count(collective, args, self.size) for args in everyone]
        if len(set(counts)) != 1:
            raise AssertionError(f"{collective}: ranks made host calls with counts {counts}")

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(rank)`` on every rank (thread); re-raise the first failure."""
        results: list[Any] = [None] * self.size

        def body(r: int) -> None:
            try:
                results[r] = fn(r)
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if self.errors:
            real = [e for e in self.errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or self.errors)[0]
        return results


def _shape_of(a: Any) -> Any:
    return a.size if isinstance(a, np.ndarray) else a if isinstance(a, (int, str)) else \
        type(a).__name__


def _count(collective: str, args: tuple, size: int) -> int:
    from mpicoll.buffers import is_in_place
    if collective == "allgather":
        return args[1].size // size if is_in_place(args[0]) else args[0].size
    if collective == "broadcast":
        return args[0].size
    return (args[1] if is_in_place(args[0]) else args[0]).size


def _perform(collective: str, everyone: list[tuple], rank: int) -> Callable[[], None]:
    """Compute ``rank``'s result now; return the function that writes it."""
    from mpicoll.buffers import is_in_place
    size = len(everyone)
    mine = everyone[rank]
    nothing = lambda: None  # noqa: E731
    if collective in ("allreduce", "reduce", "reduce_scatter"):
        data = [a[1] if is_in_place(a[0]) else a[0] for a in everyone]
        total = np.sum(np.stack(data), axis=0).astype(data[0].dtype)
        if collective == "reduce":
            if rank != mine[3]:
                return nothing
            out = mine[1] if mine[1] is not None else mine[0]
        elif collective == "reduce_scatter":
            b = block_bounds(total.size, size)
            out = mine[1]
            assert out.size == b[rank + 1] - b[rank], (out.size, b)
            total = total[b[rank]:b[rank + 1]]
        else:
            out = mine[1] if mine[1] is not None else mine[0]
    elif collective == "broadcast":
        root = mine[1]
        if rank == root:
            return nothing
        out, total = mine[0], everyone[root][0].copy()
    elif collective == "allgather":
        if is_in_place(mine[0]):
            block = mine[1].size // size
            parts = [a[1][r * block:(r + 1) * block] for r, a in enumerate(everyone)]
        else:
            parts = [a[0] for a in everyone]
        out, total = mine[1], np.concatenate(parts)
    else:
        raise ValueError(collective)

    def write() -> None:
        out[...] = total

    return write


def log_index(log: list, op: str, chunk: int) -> int:
    """Position of the first ``(op, stream, chunk)`` entry of a simulated copies log."""
    return next(i for i, e in enumerate(log) if e[0] == op and e[2] == chunk)


def assert_overlap(log: list, nslots: int, least: int = 5) -> None:
    """Check that a :class:`SimulatedCopies` log of one staged call, with ``("host", "",
    k)`` entries appended by its host calls, ran at least ``least`` chunks in the order
    that overlaps copies with host calls (see :mod:`mpicoll.gpu.staging`)."""
    chunks = sum(1 for e in log if e[0] == "host")
    assert chunks >= least, log
    for k in range(chunks):
        host_k = log_index(log, "host", k)
        # the host waits for chunk k's own d2h, and only for that, just before its call
        assert log_index(log, "wait", k) < host_k
        if k + 1 < chunks:  # d2h of k+1 issued before the host call on k: they overlap
            assert log_index(log, "d2h", k + 1) < host_k
        if k >= 1:  # h2d of k-1 issued after host(k-1), before host(k): overlaps host(k)
            assert log_index(log, "host", k - 1) < log_index(log, "h2d", k - 1) < host_k
            # and the host did not wait for it
            assert not any(e[0] == "wait" and e[1] == "h2d" for e in log[:host_k])
        assert host_k < log_index(log, "h2d", k)
        if k >= nslots:  # refilling a slot waits (on the stream) for its h2d
            refill = log_index(log, "d2h", k)
            assert log[refill - 1] == ("stream_wait", "d2h", k - nslots)
    assert log[-1][0] == "finish"


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here (``None``: CuPy and a CUDA device are available)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return "no CUDA device is visible"
    return None


def torch_cuda_skip_reason() -> str | None:
    """Why torch CUDA tests cannot run here (``None``: torch sees a CUDA device)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None
