"""Validated calls, cached so that a repeated collective on the same buffers skips validation.

Validating a call (flat views, dtype and size checks, op and algorithm resolution) costs
a few microseconds of Python, more than a small all-reduce itself. Training loops call the
same collective on the same arrays over and over, so the result of validation is kept per
(collective, buffer objects, op, algorithm, communicator) and reused while:

- the very same objects are passed again (held by weak reference, so a new array that
  happens to get a dead one's ``id`` never matches, and nothing is kept alive);
- the output is still writable;
- nothing that the choice of algorithm depends on has changed: :func:`invalidate` runs
  when the ``MPICOLL_*`` variables are re-read (:func:`mpicoll.config.refresh`) or the
  tuning table changes.

Only plain numpy arrays (and the in-place markers) are cached. Checked mode never uses the
cache: its agreement step runs on every call.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

__all__ = ["lookup", "store", "invalidate", "MAX_ENTRIES"]

#: Cached calls kept at most (least recently used dropped first).
MAX_ENTRIES = 64

_calls: "OrderedDict[tuple, tuple]" = OrderedDict()
_lock = threading.Lock()


def _ref(obj: Any) -> Callable[[], Any] | None:
    """A weak reference to an ndarray, a strong one to the in-place markers, else None."""
    if type(obj) is np.ndarray:
        return weakref.ref(obj)
    if obj is None or type(obj).__name__ == "InPlaceType":
        return lambda: obj
    return None


def _key(collective: str, args: tuple) -> tuple:
    return (collective,) + tuple(a if isinstance(a, str) else id(a) for a in args)


def lookup(collective: str, args: tuple, output: Any) -> Any:
    """The payload stored for these exact argument objects, or ``None``."""
    entry = _calls.get(_key(collective, args))
    if entry is None:
        return None
    refs, payload = entry
    for ref, arg in zip(refs, args):
        if ref() is not arg:
            return None
    if not getattr(output.flags, "writeable", True):
        return None
    return payload


def store(collective: str, args: tuple, payload: Any) -> None:
    """Remember ``payload`` for these argument objects (when they can be referenced)."""
    refs = []
    for arg in args:
        if isinstance(arg, str):
            refs.append(lambda a=arg: a)
            continue
        ref = _ref(arg)
        if ref is None:
            try:
                ref = weakref.ref(arg)
            except TypeError:
                return  # cannot tell a later object with the same id apart: do not cache
        refs.append(ref)
    key = _key(collective, args)
    with _lock:
        _calls[key] = (tuple(refs), payload)
        _calls.move_to_end(key)
        while len(_calls) > MAX_ENTRIES:
            _calls.popitem(last=False)


def invalidate() -> None:
    """Forget every cached call (settings that choose algorithms have changed)."""
    with _lock:
        _calls.clear()
