"""Which GPU a rank uses: its local rank on the node, unless ``MPICOLL_DEVICE`` says.

``MPICOLL_DEVICE``:

- unset or ``auto``: device ``local_rank % device_count`` (more ranks than GPUs share
  them round-robin: the test machines have one GPU for 1, 2 and 4 ranks);
- ``N``: every rank uses device ``N``;
- ``N,M,...``: local rank ``i`` uses the ``i % len``-th entry (like
  ``CUDA_VISIBLE_DEVICES``, but per rank);
- ``none``: mpicoll leaves the current device alone.

The local rank comes from splitting the communicator by ``MPI.COMM_TYPE_SHARED``
(:func:`local_rank`, collective), so it is right whatever the launcher. The variable is read through :mod:`mpicoll.config`.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

from .. import config

__all__ = ["VARIABLE", "parse_device_setting", "choose_device", "local_rank",
           "visible_device_count", "select_device"]

#: The variable naming the device.
VARIABLE = "MPICOLL_DEVICE"


def parse_device_setting(raw: str | None) -> list[int] | str | None:
    """``MPICOLL_DEVICE`` parsed: ``None`` (auto), ``"none"``, or a list of ordinals.

    Raises:
        ValueError: anything else (the message names the variable).
    """
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    low = raw.strip().lower()
    if low == "none":
        return "none"
    try:
        ordinals = [int(part) for part in low.split(",")]
    except ValueError:
        raise ValueError(f"{VARIABLE}={raw!r} is not valid: use auto, none, a device "
                         f"ordinal (0) or a list of ordinals (0,1,2,3)") from None
    if any(o < 0 for o in ordinals):
        raise ValueError(f"{VARIABLE}={raw!r}: device ordinals are >= 0")
    return ordinals


def choose_device(local: int, device_count: int, setting: str | None) -> int | None:
    """The device ordinal for local rank ``local`` (``None``: leave the current one).

    Args:
        local: the rank's index among the ranks of its node.
        device_count: GPUs visible to the process.
        setting: the raw ``MPICOLL_DEVICE`` value.
    Raises:
        ValueError: a bad setting, no visible GPU, or an ordinal that is not visible.
    """
    parsed = parse_device_setting(setting)
    if parsed == "none":
        return None
    if device_count < 1:
        raise ValueError("no CUDA device is visible to this process (check "
                         "CUDA_VISIBLE_DEVICES)")
    if parsed is None:
        return local % device_count
    ordinal = parsed[local % len(parsed)]
    if ordinal >= device_count:
        raise ValueError(f"{VARIABLE}={setting!r} gives local rank {local} device "
                         f"{ordinal}, but only {device_count} device(s) are visible")
    return ordinal


def local_rank(comm: Any = None) -> int:
    """This rank's index among the ranks of its node (collective over ``comm``)."""
    from ..runtime import comms, world  # noqa: PLC0415

    comm = world.comm() if comm is None else comm
    node = comms.split_shared(comm, comm.Get_rank(), "device")
    try:
        return node.Get_rank()
    finally:
        comms.free(node)


def visible_device_count() -> int:
    """GPUs visible to the process, through CuPy, else torch; 0 when neither works."""
    with contextlib.suppress(Exception):  # (no CuPy, no driver, no device)
        import cupy  # noqa: PLC0415

        return int(cupy.cuda.runtime.getDeviceCount())
    with contextlib.suppress(Exception):
        import torch  # noqa: PLC0415

        return int(torch.cuda.device_count())
    return 0


def select_device(local: int | None = None, *, comm: Any = None,
                  device_count: int | None = None, activate: bool = True) -> int | None:
    """Choose (and by default make current) this rank's GPU.

    Args:
        local: the local rank; ``None`` computes it with :func:`local_rank` (collective).
        comm: the communicator for :func:`local_rank`.
        device_count: visible GPUs (default: :func:`visible_device_count`).
        activate: make the device current in CuPy and, if imported, torch.
    Returns:
        The ordinal, or ``None`` with ``MPICOLL_DEVICE=none``.
    Raises:
        ValueError: see :func:`choose_device`.
    """
    if local is None:
        local = local_rank(comm)
    count = visible_device_count() if device_count is None else device_count
    ordinal = choose_device(local, count, config.env_str(VARIABLE))
    if ordinal is not None and activate:
        with contextlib.suppress(ImportError):
            import cupy  # noqa: PLC0415

            cupy.cuda.Device(ordinal).use()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.set_device(ordinal)
    return ordinal
