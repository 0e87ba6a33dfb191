"""The array module a codec's kernels run in: numpy for host arrays, the device backend's
module on the device (CuPy for CUDA; :mod:`mpicoll.gpu.array_modules`, re-exported here
for the codecs), and how the chunked codecs block their work in each.

Other device array families bring their module through a device backend
(:func:`mpicoll.gpu.backends.register`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..gpu.array_modules import (array_module, as_module_array, constant, is_host_module,
                                 to_device, to_host, to_side)

__all__ = ["array_module", "is_host_module", "as_module_array", "to_host", "to_device", "to_side",
           "constant", "block_elements", "side"]


def block_elements(xp: Any, default: int) -> int | None:
    """Elements the chunked codecs process per inner block in module ``xp``: ``default``
    on the host (temporaries stay in cache), ``None`` (the whole vector in one block:
    fewer kernel launches) on a device."""
    return default if xp is np else None


def side(a: Any) -> str:
    """Where array ``a`` lives, in words (for errors)."""
    xp = array_module(a)
    return "in host memory" if xp is np else f"a {xp.__name__} array"
