"""Operations started during a backward pass (DDP's reducer all-reducing its buckets):
their errors raised from ``backward()`` itself, after DDP has finished its own work.

DDP's reducer waits for each bucket's future at the end of the backward pass and reads
its value; in torch 2.13 a future completed with an error there ends the process (a
segmentation fault in ``c10d::detail::parseCppCommHookResult``), and a reducer stopped
half-way would keep the previous world size as its divisor for the next backward. So an
operation started inside a backward pass (:func:`task`) completes its future with its
input tensors when it fails, its ``Work`` keeping the error (``wait()`` raises it); the
first such operation of a backward pass queues a callback with torch's autograd engine
that queues another, which runs after DDP's own (queued later) and raises the first error
of the pass's operations from ``loss.backward()``, before any optimizer step. Under
elastic mode that error is a process failure (:mod:`mpicoll.elastic`) and the DDP module
goes on with the survivors.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.autograd import Variable

__all__ = ["task", "watch"]

_lock = threading.Lock()
#: graph task id -> the works started during it
_works: dict[int, list[Any]] = {}


def task() -> int:
    """The backward pass the calling thread runs (torch's graph task id; -1: none)."""
    return torch._C._current_graph_task_id()


def watch(work: Any, task: int) -> None:
    """Raise ``work``'s error (if it fails) from the backward pass that started it (the
    calling thread's, :func:`task`), after the callbacks queued during it (DDP's)."""
    with _lock:
        first = task not in _works
        _works.setdefault(task, []).append(work)
    if first:
        engine = Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(lambda: _check(task)))


def _check(task: int) -> None:
    with _lock:
        works = _works.pop(task, [])
    for work in works:
        work.work.wait()      # raises the work's error
