"""Is the MPI library CUDA-aware? Decided once per process, with the reason.

Order of the decision (the first step that answers wins):

1. ``MPICOLL_CUDA_AWARE`` = ``1``/``0`` (also ``true``/``false``, ``yes``/``no``,
   ``on``/``off``; ``auto`` or unset: detect). Any other value is a ``ValueError`` naming
   the variable.
2. The MPI-4.1 info key ``mpi_memory_alloc_kinds`` of ``MPI.COMM_WORLD``: a kind ``cuda``
   (bare, or with the restrictor ``device``) means aware. A value without it does not
   decide: the key lists only the kinds that were *requested* (by default ``mpi,system``),
   so a CUDA-aware library may still omit it.
3. MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` and Open MPI's (also
   MPICH's) ``MPIX_Query_cuda_support()``, called through ctypes on the MPI library the
   process has loaded, where it exports them. Either one saying yes means aware.
4. Otherwise: not aware (unknown counts as not aware, the safe side: the staged path
   works with any MPI library).

Every source is injectable (:func:`decide`), so the logic is tested without MPI or a GPU.
The variable is read through :mod:`mpicoll.config`.
This module imports nothing GPU-related and initialises MPI only when
:func:`cuda_aware` is first called.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from typing import Any, Callable

from .. import config

__all__ = ["VARIABLE", "cuda_aware", "decide", "parse_override", "parse_alloc_kinds",
           "info_alloc_kinds", "mpi_library_paths", "library_lookup", "query_library",
           "reset"]

#: The override variable.
VARIABLE = "MPICOLL_CUDA_AWARE"

#: MPICH's ``MPIX_GPU_SUPPORT_CUDA`` (mpi.h).
MPIX_GPU_SUPPORT_CUDA = 0

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_AUTO = ("", "auto")

_lock = threading.Lock()
_decided: tuple[bool, str] | None = None

#: ``lookup(symbol) -> callable or None``: how step 3 finds a library function.
Lookup = Callable[[str], Any]


def parse_override(raw: str | None) -> bool | None:
    """The value of ``MPICOLL_CUDA_AWARE``: ``True``/``False``, or ``None`` to detect.

    Raises:
        ValueError: a value other than 1/0 (true/false, yes/no, on/off) or auto.
    """
    if raw is None:
        return None
    low = raw.strip().lower()
    if low in _AUTO:
        return None
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{VARIABLE}={raw!r} is not valid: use 1 (the MPI library takes "
                     f"device pointers), 0 (stage through host memory) or auto (detect)")


def parse_alloc_kinds(value: str | None) -> tuple[bool | None, str]:
    """Read an ``mpi_memory_alloc_kinds`` info value.

    The value is a comma-separated list of ``kind[:restrictor[:restrictor...]]``
    (MPI 4.1, section 11.4.3), e.g. ``mpi,system`` or ``mpi,system,cuda:device,cuda:host``.

    Returns:
        ``(True, why)`` when device memory of kind ``cuda`` is listed (``cuda`` alone, or
        with the restrictor ``device`` or ``managed``); ``(None, why)`` otherwise (the key
        is absent, or does not list CUDA device memory: not decisive).
    """
    if value is None:
        return None, "the MPI library does not report mpi_memory_alloc_kinds"
    kinds = [k.strip().lower() for k in value.split(",") if k.strip()]
    cuda = [k.split(":")[1:] for k in kinds if k.split(":")[0] == "cuda"]
    if any(not r or "device" in r or "managed" in r for r in cuda):
        return True, f"mpi_memory_alloc_kinds={value!r} lists CUDA device memory"
    if cuda:
        return None, (f"mpi_memory_alloc_kinds={value!r} lists CUDA host memory only, "
                      f"not device memory")
    return None, f"mpi_memory_alloc_kinds={value!r} has no cuda kind"


def info_alloc_kinds() -> str | None:
    """``mpi_memory_alloc_kinds`` from ``MPI.COMM_WORLD.Get_info()`` (``None``: absent).

    Initialises MPI if mpi4py has not yet (importing ``mpi4py.MPI`` does that).
    """
    from mpi4py import MPI  # noqa: PLC0415  (initialises MPI: only when asked)

    try:
        info = MPI.COMM_WORLD.Get_info()
    except MPI.Exception:
        return None
    try:
        return info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()


def mpi_library_paths(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the loaded MPI libraries (``libmpi*.so*``), from ``/proc/self/maps``."""
    found: list[str] = []
    with contextlib.suppress(OSError), open(maps, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            name = os.path.basename(path)
            if re.match(r"lib(mpi|mpich|mpi_ilp64)(\.|_|\b)", name) and ".so" in name:
                found.append(path)
    return list(dict.fromkeys(found))  # each once, in order


def library_lookup(paths: list[str] | None = None) -> Lookup:
    """A ``lookup(symbol)`` over the loaded MPI libraries, then the global namespace."""
    handles: list[Any] = []
    for path in (mpi_library_paths() if paths is None else paths):
        with contextlib.suppress(OSError):
            handles.append(ctypes.CDLL(path))
    with contextlib.suppress(OSError):
        handles.append(ctypes.CDLL(None))

    def lookup(symbol: str) -> Any:
        for handle in handles:
            fn = getattr(handle, symbol, None)
            if fn is not None:
                return fn
        return None

    return lookup


def query_library(lookup: Lookup) -> tuple[bool | None, str]:
    """Ask the MPI library itself through its MPIX extensions (step 3).

    Returns:
        ``(True, why)`` when a query says CUDA is supported, ``(False, why)`` when a query
        exists and says no, ``(None, why)`` when the library has neither function.
    """
    answers: list[str] = []
    said_no = False
    gpu_query = _typed(lookup("MPIX_GPU_query_support"),
                       [ctypes.c_int, ctypes.POINTER(ctypes.c_int)])
    if gpu_query is not None:
        flag = ctypes.c_int(0)
        err = gpu_query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
        if err == 0 and flag.value:
            return True, "MPIX_GPU_query_support(CUDA) says supported"
        said_no = said_no or err == 0
        answers.append(f"MPIX_GPU_query_support(CUDA) = {flag.value}"
                       + (f" (error {err})" if err else ""))
    cuda_query = _typed(lookup("MPIX_Query_cuda_support"), [])
    if cuda_query is not None:
        value = int(cuda_query())
        if value:
            return True, "MPIX_Query_cuda_support() says supported"
        said_no = True
        answers.append(f"MPIX_Query_cuda_support() = {value}")
    if not answers:
        return None, "the MPI library has neither MPIX_GPU_query_support nor " \
                     "MPIX_Query_cuda_support"
    return (False if said_no else None), "; ".join(answers)


def _typed(fn: Any, argtypes: list) -> Any:
    """``fn`` (``None``: not exported) with its C signature set: ``argtypes``, ``int``."""
    try:
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    except (AttributeError, TypeError):
        pass  # None, or an injected plain Python callable
    return fn


def decide(override: str | None, alloc_kinds: str | None | Callable[[], str | None],
           lookup: Lookup | None) -> tuple[bool, str]:
    """The decision itself, from injectable sources.

    Args:
        override: the raw value of ``MPICOLL_CUDA_AWARE`` (``None``: unset).
        alloc_kinds: the ``mpi_memory_alloc_kinds`` value (``None``: absent), or a
            function returning it (called only when the override does not decide).
        lookup: ``lookup(symbol)`` returning a library function or ``None`` (``None``
            for the whole argument: no library to ask).
    Returns:
        ``(aware, reason)``; ``reason`` says which step decided and what it saw.
    Raises:
        ValueError: a bad ``MPICOLL_CUDA_AWARE`` value.
    """
    forced = parse_override(override)
    if forced is not None:
        return forced, f"{VARIABLE}={override.strip()} (override)"
    value = alloc_kinds() if callable(alloc_kinds) else alloc_kinds
    verdict, why_info = parse_alloc_kinds(value)
    if verdict:
        return True, why_info
    if lookup is None:
        return False, f"{why_info}; no MPI library to query: assumed not CUDA-aware"
    verdict, why_lib = query_library(lookup)
    if verdict:
        return True, f"{why_info}; {why_lib}"
    if verdict is False:
        return False, f"{why_info}; {why_lib}: not CUDA-aware"
    return False, f"{why_info}; {why_lib}: unknown, so assumed not CUDA-aware"


def cuda_aware() -> tuple[bool, str]:
    """Whether the MPI library takes device pointers, and why; decided once per process.

    Returns:
        ``(aware, reason)``.
    Raises:
        ValueError: ``MPICOLL_CUDA_AWARE`` has a bad value (raised on every call until
            it is fixed and :func:`reset` is called).
    """
    global _decided
    if _decided is not None:
        return _decided
    with _lock:
        if _decided is None:
            _decided = decide(config.env_str(VARIABLE), info_alloc_kinds,
                              library_lookup())
    return _decided


def reset() -> None:
    """Forget the decision: the next :func:`cuda_aware` decides again, reading the
    variables afresh (:func:`mpicoll.config.refresh`)."""
    global _decided
    with _lock:
        _decided = None
    config.refresh()
