"""Device tensors of one backend call, staged through host memory on the group's thread.

At submission (the caller's thread) :meth:`Staging.host` gives each device tensor a host
tensor of the same shape and dtype and records an event on the caller's current stream;
on the group's thread :meth:`Staging.before` makes the device's stream wait for that
event and copies the inputs to the host, the collective runs on host tensors, and
:meth:`Staging.after` copies the outputs back and synchronises the stream, so results are
ready on any stream when the work completes (as with the adapter's engine). Devices are
:mod:`mpicoll.torch.device.tensors`' (CUDA tensors, or a registered stand-in). Host
tensors pass through unchanged.
"""
from __future__ import annotations

from typing import Any

import torch

from ..device.tensors import device_of
from ..engine.dtypes import move_dtype

__all__ = ["Staging"]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(move_dtype(tensor.dtype))


class Staging:
    """The device tensors of one call (all on one device) and their host copies."""

    def __init__(self) -> None:
        self.device: Any = None
        self.event: Any = None
        self._loads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._stores: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(self, tensor: torch.Tensor, load: bool = True, store: bool = False) -> torch.Tensor:
        """``tensor`` itself on the host, else its host copy (``load``: filled from it
        before the collective; ``store``: written back to it after)."""
        dev = device_of(tensor)
        if dev is None:
            return tensor
        if self.device is None:
            self.device, self.event = dev, dev.record()
        elif dev is not self.device:
            raise TypeError(f"tensors of one call are on {self.device.name} and {dev.name}; "
                            f"pass them on one device")
        copy = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
        if load:
            self._loads.append((copy, tensor))
        if store:
            self._stores.append((tensor, copy))
        return copy

    def before(self) -> None:
        """On the group's thread: wait for the caller's stream, copy the inputs in."""
        dev = self.device
        if dev is None:
            return
        dev.wait(self.event)
        with dev.stream():
            for copy, tensor in self._loads:
                if tensor.numel():
                    dev.to_host(_flat(copy), _flat(tensor.contiguous()))
        dev.synchronize()

    def after(self) -> None:
        """On the group's thread: copy the outputs back; synchronise the stream."""
        dev = self.device
        if dev is None or not self._stores:
            return
        with dev.stream():
            for tensor, copy in self._stores:
                if not tensor.numel():
                    continue
                dense = tensor.contiguous()   # tensor itself where it is contiguous
                dev.to_device(_flat(dense), _flat(copy))
                if dense is not tensor:
                    tensor.copy_(dense)
        dev.synchronize()
