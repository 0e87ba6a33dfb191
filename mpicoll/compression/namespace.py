"""The array module a codec's kernels run in: numpy for host arrays, CuPy on the device
(:mod:`mpicoll.gpu.array_modules`, re-exported here for the codecs), and how the chunked
codecs block their work in each.

The CPU tests register a fake device module over numpy (:func:`register`) that refuses
host arrays in its kernels and counts the bytes copied between the sides.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..gpu.array_modules import (array_module, as_module_array, constant, is_host_module,
                                 register, to_device, to_host, to_side, unregister)

__all__ = ["array_module", "is_host_module", "as_module_array", "to_host", "to_device", "to_side",
           "register", "unregister", "constant", "block_elements"]


def block_elements(xp: Any, default: int) -> int | None:
    """Elements the chunked codecs process per inner block in module ``xp``: ``default``
    on the host (temporaries stay in cache), ``None`` (the whole vector in one block:
    fewer kernel launches) on a device."""
    return default if xp is np else None
