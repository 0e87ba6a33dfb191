"""The commit on disk that the relaunching supervisor (:mod:`mpicoll.elastic.launch`)
restarts a job from.

The supervisor gives every launch of the job two environment variables:

- ``MPICOLL_ELASTIC_DIR``: the commit directory (set: :func:`active` is true);
- ``MPICOLL_ELASTIC_RESTART``: ``0`` for the first launch, ``1``, ``2``, ... after each
  relaunch (:func:`restart_count`).

Rank 0 calls :func:`save` at each commit (``mpicoll.elastic.State.commit`` does it), and a
relaunched job calls :func:`load` at its start. A save is atomic: the payload goes to a
temporary file with a header (magic, length, CRC-32), is fsync'ed, and replaces
``commit.bin`` by a rename; the commit before it stays as ``commit.prev.bin``. :func:`load`
returns the newest intact one, so a process killed in the middle of a save never leaves a
job without a commit.

Free of heavy imports (no MPI, no numpy, no torch): the supervisor and any rank import it
cheaply.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from pathlib import Path

__all__ = ["ENV_DIR", "ENV_RESTART", "COMMIT_NAME", "PREVIOUS_NAME", "active",
           "commit_dir", "save", "load", "restart_count", "CommitError"]

log = logging.getLogger("mpicoll.elastic.disk")

#: Environment variable naming the commit directory.
ENV_DIR = "MPICOLL_ELASTIC_DIR"
#: Environment variable counting the relaunches (0 for the first launch).
ENV_RESTART = "MPICOLL_ELASTIC_RESTART"
#: The last commit's file, in the commit directory.
COMMIT_NAME = "commit.bin"
#: The commit before it.
PREVIOUS_NAME = "commit.prev.bin"

_MAGIC = b"MPCE"
_VERSION = 1
# magic, version (u8), payload length (u64), CRC-32 of the payload (u32)
_HEADER = struct.Struct("<4sBQI")


class CommitError(RuntimeError):
    """The commit directory cannot be used (not a directory, not writable)."""


def active() -> bool:
    """Whether this process runs under the relaunching supervisor
    (``MPICOLL_ELASTIC_DIR`` is set and not empty)."""
    return bool(os.environ.get(ENV_DIR))


def commit_dir() -> Path:
    """The commit directory (``MPICOLL_ELASTIC_DIR``).

    Raises:
        CommitError: the variable is not set.
    """
    value = os.environ.get(ENV_DIR)
    if not value:
        raise CommitError(f"{ENV_DIR} is not set: this process does not run under "
                          f"python -m mpicoll.elastic.launch")
    return Path(value)


def restart_count() -> int:
    """How many times the supervisor has relaunched the job (``MPICOLL_ELASTIC_RESTART``;
    0 when unset).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    value = os.environ.get(ENV_RESTART, "").strip()
    if not value:
        return 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{ENV_RESTART} must be a non-negative integer, not {value!r}")
    return count


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the platform allows opening a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(payload: bytes) -> None:
    """Write ``payload`` as the last commit, atomically (call it on one rank: rank 0).

    Args:
        payload: the serialized state (``bytes``-like).
    Raises:
        TypeError: ``payload`` is not bytes-like.
        CommitError: no commit directory, or it cannot be created or written.
    """
    try:
        data = memoryview(payload).cast("B")
    except TypeError:
        raise TypeError(f"payload must be bytes-like, not {type(payload).__name__}") from None
    directory = commit_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommitError(f"cannot create the commit directory {directory}: {exc}") from exc
    header = _HEADER.pack(_MAGIC, _VERSION, data.nbytes, zlib.crc32(data))
    current = directory / COMMIT_NAME
    temporary = directory / f".{COMMIT_NAME}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as file:
            file.write(header)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if current.exists():
            # keep the commit before this one: a hard link, then a rename over the old
            # previous one, so commit.bin itself never goes missing
            link = directory / f".{PREVIOUS_NAME}.{os.getpid()}.tmp"
            try:
                link.unlink(missing_ok=True)
                os.link(current, link)
                os.replace(link, directory / PREVIOUS_NAME)
            except OSError as exc:  # a file system without hard links: no previous copy
                log.debug("no previous commit kept: %s", exc)
        os.replace(temporary, current)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise CommitError(f"cannot write the commit in {directory}: {exc}") from exc
    _fsync_dir(directory)


def _read(path: Path) -> bytes | None:
    """The payload of one commit file, ``None`` if missing, truncated or corrupt."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(blob) < _HEADER.size:
        log.warning("commit %s is truncated (%d bytes); ignored", path, len(blob))
        return None
    magic, version, length, crc = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != _MAGIC or version != _VERSION:
        log.warning("%s is not a commit of this version; ignored", path)
        return None
    if len(payload) != length or zlib.crc32(payload) != crc:
        log.warning("commit %s is truncated or corrupt; ignored", path)
        return None
    return payload


def load() -> bytes | None:
    """The last intact commit's payload (the previous one if the last is damaged), or
    ``None`` when there is none or no commit directory is set."""
    if not active():
        return None
    directory = commit_dir()
    for name in (COMMIT_NAME, PREVIOUS_NAME):
        payload = _read(directory / name)
        if payload is not None:
            if name == PREVIOUS_NAME:
                log.warning("the last commit in %s is damaged: using the previous one",
                            directory)
            return payload
    return None
