"""GPU buffers: CUDA-awareness detection, device arrays, the staged (pinned host) path.

Importing this package imports nothing GPU-related: CuPy is imported only by
:mod:`mpicoll.gpu.cupy_copies`, when a device array actually reaches a collective.

Modules:
    detect: :func:`~mpicoll.gpu.detect.cuda_aware`, decided once per process.
    arrays: recognising device arrays (CuPy, ``__cuda_array_interface__``, DLPack),
        their producer streams, and the checks on one call's buffers.
    staging: :func:`~mpicoll.gpu.staging.staged`, the chunked, pipelined path through
        pinned host buffers for MPI libraries that are not CUDA-aware.
    backends: the registry of device backends (:class:`~mpicoll.gpu.backends.CudaBackend`,
        the library's, and any registered with :func:`~mpicoll.gpu.backends.register`):
        which one handles a device array, its array module, copies and views; whole-array
        copies between a device array and host memory (the parameter server's workers).
    cupy_copies: the CuPy implementation of the copy interface.
    numpy_copies: the copy interface on host arrays (ranks whose buffers are on the host).
    device: :func:`~mpicoll.gpu.device.select_device` (``MPICOLL_DEVICE``).
    route: what :func:`mpicoll.collectives.dispatch` calls when a device array is passed.
    array_modules: which array module (numpy, CuPy, a registered one) handles an array,
        and copies between host and device in any of them (the codecs use them).

See docs/gpu.md.
"""
from __future__ import annotations

__all__: list[str] = []
