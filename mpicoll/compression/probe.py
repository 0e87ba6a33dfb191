"""Measurements behind ``compression="auto"``: the codecs' speed on this machine (local,
once per process and array module) and the link's latency and bandwidth (collective, once
per communicator), agreed across ranks so that every rank holds the same numbers.

- :func:`codec_speeds`: each codec's ``encode`` and ``decode`` timed on float32 vectors
  of :data:`SMALL_BYTES` and :data:`LARGE_BYTES`, interleaved across codecs, a few runs
  each, in the **CPU time** of the calling thread (what the codec costs, whatever other
  processes preempt it for): the medians give the rate (the large size over the time
  difference) and the overhead (what is left of the small time). Then the **CPU share**
  this process got over the whole measurement (CPU time over wall-clock time, at most 1)
  scales both: on cores shared with other processes (ranks of the same node, other jobs)
  a codec runs that much slower, as it does inside a collective. The same for one
  ``add`` (the reductions every codec pays). Cached per process (another array module
  measures again; device codecs are timed by the wall clock, after synchronising).
  :mod:`.auto` runs it on every rank at once (after a barrier), so ranks that share
  cores measure the share they get while all of them compute, as in the ring.
- :func:`measure_link`: every rank sends :data:`PROBE_SMALL` and then
  :data:`PROBE_LARGE` bytes to its right neighbour in a ring while receiving from its
  left one (what one step of the ring schedules does), a few times each; the medians.
- :func:`agree_inputs`: one ``Allreduce(MAX)`` of every rank's figures: the slowest
  rank's codec and the slowest link set the ring's pace, and the result is the same bits
  on every rank (so the choice is too).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from . import namespace
from .codecs import get_codec, new_payload
from .cost_model import ModelInputs, Speed

__all__ = ["codec_speeds", "cpu_share", "measure_link", "agree_inputs", "SMALL_BYTES",
           "LARGE_BYTES", "PROBE_SMALL", "PROBE_LARGE", "TAG_PROBE"]

#: Sizes of the codec timings (bytes of float32 input).
SMALL_BYTES = 16 << 10
LARGE_BYTES = 4 << 20

#: Sizes of the link probe's messages (bytes).
PROBE_SMALL = 8
PROBE_LARGE = 4 << 20

#: Tag of the link probe's messages on the context's private communicator.
TAG_PROBE = 105

_REPEATS = 5

_lock = threading.Lock()
#: (array module name, codec name) -> (encode Speed, decode Speed); "add" for the adds.
_speeds: dict[tuple[str, str], tuple[Speed, Speed]] = {}
#: array module name -> the CPU share of the latest measurement.
_shares: dict[str, float] = {}


def cpu_share(module: str = "numpy") -> float | None:
    """The CPU share (CPU time over wall-clock time) of this process's latest codec
    measurement in array module ``module`` (``None`` before any)."""
    return _shares.get(module)


def _waiter(like: Any) -> Callable[[], None]:
    """A function that waits for the work queued on ``like``'s side (nothing on the host)."""
    if namespace.is_host_module(namespace.array_module(like)):
        return lambda: None
    from ..gpu.backends import require  # noqa: PLC0415  (device arrays only)
    return lambda: require(like).synchronise(like)


def _timed(fn: Callable[[], Any], wait: Callable[[], None], cpu: bool
           ) -> tuple[float, float]:
    """``(wall-clock seconds, seconds to count)`` of one call: the thread's CPU time when
    ``cpu``, else the wall clock (device work runs off the CPU)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    fn()
    wait()
    wall = time.perf_counter() - start
    return wall, (time.thread_time() - start_cpu) if cpu else wall


def _speed(small: float, large: float, share: float) -> Speed:
    """``Speed`` from the median times at :data:`SMALL_BYTES` and :data:`LARGE_BYTES`,
    slowed by the CPU ``share`` (in (0, 1]). Where the two times hardly differ (a device
    whose calls cost their launch, or noise) the difference is taken as at least 5% of
    the large time, so the rate stays finite and the overhead carries the cost."""
    span = max(large - small, 0.05 * large, 1e-9)
    rate = (LARGE_BYTES - SMALL_BYTES) / span
    return Speed(max(0.0, small - SMALL_BYTES / rate) / share, rate * share)


def _measure(names: Sequence[str], like: Any) -> None:
    """Time encode and decode of every codec in ``names`` (and ``add``) into the cache."""
    wait = _waiter(like)
    host = namespace.is_host_module(namespace.array_module(like))
    rng = np.random.default_rng(12345)
    data = {}
    for size in (SMALL_BYTES, LARGE_BYTES):
        x = rng.standard_normal(size // 4).astype(np.float32)
        data[size] = namespace.to_side(x, like)
    xp = namespace.array_module(like)
    jobs: dict[tuple[str, str, int], Callable[[], Any]] = {}
    for name in names:
        codec = get_codec(name)
        for size, x in data.items():
            payload = new_payload(codec, x.size, x.dtype, like=x)[1]
            out = xp.empty_like(x)
            jobs[(name, "encode", size)] = (lambda c=codec, x=x, p=payload: c.encode(x, p))
            codec.encode(x, payload)
            jobs[(name, "decode", size)] = (lambda c=codec, p=payload, x=x, o=out:
                                            c.decode(p, x.size, x.dtype, out=o))
    for size, x in data.items():
        out = xp.empty_like(x)
        jobs[("add", "add", size)] = (lambda x=x, o=out: xp.add(x, x, out=o))
    for job in jobs.values():                     # warm up (allocations, caches)
        job()
    times: dict[tuple[str, str, int], list[float]] = {k: [] for k in jobs}
    wall_total = counted_total = 0.0
    for _ in range(_REPEATS):                     # interleaved: load hits every codec alike
        for key, job in jobs.items():
            wall, counted = _timed(job, wait, host)
            times[key].append(counted)
            wall_total += wall
            counted_total += counted
    share = min(1.0, max(0.02, counted_total / wall_total)) if host and wall_total > 0 \
        else 1.0
    typical = {k: statistics.median(v) for k, v in times.items()}
    module = xp.__name__
    for name in list(names) + ["add"]:
        ops = ("add", "add") if name == "add" else ("encode", "decode")
        _speeds[(module, name)] = tuple(
            _speed(typical[(name, op, SMALL_BYTES)], typical[(name, op, LARGE_BYTES)], share)
            for op in ops)
    _shares[module] = share


def codec_speeds(names: Sequence[str], like: Any = None
                 ) -> tuple[dict[str, Speed], dict[str, Speed], Speed]:
    """This process's encode and decode :class:`Speed` per codec name, and the add's
    (measured on first use in ``like``'s array module, numpy when ``None``; cached).

    ``none`` is always measured too (the model uses its encode, a copy, for zero fills
    and intra-node copies).
    """
    like = np.empty(0, np.float32) if like is None else like
    module = namespace.array_module(like).__name__
    wanted = list(dict.fromkeys(["none", *names]))
    with _lock:
        missing = [n for n in wanted if (module, n) not in _speeds]
        if missing or (module, "add") not in _speeds:
            _measure(missing or ["none"], like)
        enc = {n: _speeds[(module, n)][0] for n in wanted}
        dec = {n: _speeds[(module, n)][1] for n in wanted}
        return enc, dec, _speeds[(module, "add")][0]


def measure_link(comm: MPI.Intracomm, repeats: int = _REPEATS) -> tuple[float, float]:
    """``(latency, seconds per byte)`` of one ring step as this rank saw it: the median
    time of a :data:`PROBE_SMALL`-byte step, and the median time of a
    :data:`PROBE_LARGE`-byte step less that, per byte (medians: what a message typically
    sees on a shared machine, not the best case). Collective over ``comm``; ``(0, 0)``
    for one rank."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n == 1:
        return 0.0, 0.0
    left, right = (rank - 1) % n, (rank + 1) % n
    out = []
    for size in (PROBE_SMALL, PROBE_LARGE):
        send = np.zeros(size, np.uint8)
        recv = np.empty(size, np.uint8)
        times = []
        # small steps are cheap: four times as many, for a steadier median on a busy machine
        for i in range((4 * repeats if size == PROBE_SMALL else repeats) + 1):
            comm.Barrier()
            start = time.perf_counter()
            comm.Sendrecv([send, MPI.BYTE], right, TAG_PROBE, [recv, MPI.BYTE], left,
                          TAG_PROBE)
            if i:                                  # the first one warms the connection
                times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out[0], max(out[1] - out[0], 1e-12) / (PROBE_LARGE - PROBE_SMALL)


def agree_inputs(comm: MPI.Intracomm, enc: dict[str, Speed], dec: dict[str, Speed],
                 add: Speed, link: tuple[float, float], source: str,
                 share: float | None = None) -> ModelInputs:
    """The model's inputs, identical on every rank: ``Allreduce(MAX)`` of every rank's
    codec overheads and seconds per byte, and of its link figures.

    Args:
        enc, dec, add: this rank's speeds (the same codec names, in the same order, on
            every rank).
        link: ``(latency, seconds per byte)`` as this rank has them (measured with
            :func:`measure_link`, or given); ``(0, 0)``: no link (one rank).
        source: where the link figures come from (``"measured"`` or a description).
        share: this rank's CPU share (:func:`cpu_share`; reported, the least over ranks;
            ``None``: 1).
    """
    names = list(enc)
    speeds = [s for n in names for s in (enc[n], dec[n])] + [add]   # as (overhead, 1/rate)
    row = [x for s in speeds for x in (s.overhead, 1.0 / s.rate)]
    row += [float(link[0]), float(link[1]), -(1.0 if share is None else float(share))]
    mine = np.array(row, dtype=np.float64)
    agreed = np.empty_like(mine)
    comm.Allreduce(mine, agreed, op=MPI.MAX)
    *pairs, latency, per_byte, minus_share = agreed.tolist()
    got = [Speed(pairs[i], 1.0 / pairs[i + 1]) for i in range(0, len(pairs), 2)]
    bandwidth = 1.0 / per_byte if per_byte > 0 else math.inf
    return ModelInputs(latency, bandwidth, dict(zip(names, got[0:-1:2])),
                       dict(zip(names, got[1:-1:2])), got[-1], source, -minus_share)
