"""The backend's C++ part (``csrc/c10d_backend.cpp``): a ``c10d::Backend`` that Python can
subclass, and the ``c10d::Work`` of a Python work. Built once with torch's JIT
(:func:`torch.utils.cpp_extension.load`) and cached; later processes import the cached
module without a compiler.

The cache is a directory per (source, torch, Python) under ``$TORCH_EXTENSIONS_DIR/mpicoll``
(default ``~/.cache/torch_extensions/mpicoll``). Several processes that import at once (the
ranks of one ``mpirun``) build it once: the first takes an exclusive ``flock`` on the
directory's lock file and builds, the others wait for the lock and then import what it
built. The operating system releases the lock of a process that is killed, so a build cut
short leaves no lock behind (torch's own lock file is removed before a new build).
``python -m mpicoll.torch.distributed.extension`` builds it ahead (a job script, a test
session's start).

Building needs a C++17 compiler (``c++``, or ``$CXX``), ``ninja`` and torch's headers (in
every torch wheel); :func:`load` raises :class:`ExtensionBuildError` naming what is
missing.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["load", "loaded", "build_directory", "ExtensionBuildError", "SOURCE"]

#: The C++ source.
SOURCE = Path(__file__).resolve().parent / "csrc" / "c10d_backend.cpp"
#: Compiler flags (part of the cache key).
CFLAGS = ("-O2",)

_module: ModuleType | None = None


def loaded() -> ModuleType | None:
    """The extension if this process has loaded it (no mpicoll group exists before), else
    ``None``: builds nothing."""
    return _module


class ExtensionBuildError(RuntimeError):
    """The backend's C++ extension could not be built or loaded."""


def _name() -> str:
    """The module's name, with a key of what the built module depends on: the source, the
    flags, torch, Python, platform."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, sysconfig.get_platform(),
                 str(torch.compiled_with_cxx11_abi())):
        digest.update(b"\0" + part.encode())
    return f"mpicoll_c10d_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """Where the module is built and cached (one directory per cache key)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        base = Path(root)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        base = Path(cache) / "torch_extensions"
    return base / "mpicoll" / _name()


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExtensionBuildError(f"cannot import the backend's C++ extension from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """Put this interpreter's scripts directory on ``PATH`` when ``ninja`` is not found
    there: ``pip install ninja`` (the ``torch`` extra) puts it beside the interpreter, which
    is not on ``PATH`` when a virtual environment's python runs without being activated."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _missing_tools() -> list[str]:
    """What building needs and this machine lacks."""
    from torch.utils import cpp_extension  # noqa: PLC0415  (imports setuptools: only here)

    _ninja_on_path()
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; install g++ or set CXX)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja (pip install ninja)")
    include = Path(cpp_extension.include_paths()[0])
    if not (include / "torch" / "csrc" / "distributed" / "c10d" / "Backend.hpp").exists():
        missing.append(f"torch's C++ headers (no c10d/Backend.hpp under {include})")
    return missing


def _build(name: str, directory: Path) -> ModuleType:
    """Build with torch's JIT into ``directory`` (the caller holds the lock)."""
    missing = _missing_tools()
    if missing:
        raise ExtensionBuildError(
            "mpicoll's torch.distributed backend needs its C++ extension "
            f"({SOURCE.name}), which cannot be built here: missing " + "; ".join(missing))
    from torch.utils import cpp_extension  # noqa: PLC0415

    # torch's own lock, left by a build that was killed
    (directory / "lock").unlink(missing_ok=True)
    try:
        return cpp_extension.load(name=name, sources=[str(SOURCE)],
                                  build_directory=str(directory), extra_cflags=list(CFLAGS),
                                  verbose=False)
    except Exception as exc:
        raise ExtensionBuildError(
            f"building mpicoll's torch.distributed C++ extension ({SOURCE}) in {directory} "
            f"failed: {exc}") from exc


def load() -> ModuleType:
    """The extension module, built first if this machine has no cached build.

    Returns:
        The module (``Backend``, ``WorkHandle``).
    Raises:
        ExtensionBuildError: no compiler, ninja or headers, or the build failed.
    """
    global _module
    if _module is not None:
        return _module
    name = _name()
    directory = build_directory()
    library = directory / f"{name}.so"
    if not library.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExtensionBuildError(
                f"cannot create {directory} for mpicoll's C++ extension ({exc}); set "
                f"TORCH_EXTENSIONS_DIR to a writable directory") from exc
        with open(directory.parent / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released on exit, also if killed
            try:
                if not library.exists():
                    _module = _build(name, directory)
                    return _module
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    _module = _import(name, library)
    return _module


if __name__ == "__main__":
    print(load().__file__)
