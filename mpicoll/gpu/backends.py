"""Device backends: who handles a family of device arrays, in one registry.

A :class:`DeviceBackend` says which objects it handles (:meth:`~DeviceBackend.claims`) and
does, for them, everything mpicoll needs of a device: the array module whose kernels the
codecs run (:meth:`~DeviceBackend.array_module`), the CUDA-awareness decision
(:meth:`~DeviceBackend.aware`), the staged path's copies (:meth:`~DeviceBackend.copies`),
zero-copy array views (:meth:`~DeviceBackend.view`), producer synchronisation, and
whole-array copies to and from the host (the parameter server's workers).

The library registers its own backend, :class:`CudaBackend` (CuPy arrays and every object
:func:`mpicoll.gpu.arrays.is_device` accepts: ``__cuda_array_interface__``, CUDA DLPack;
CuPy is imported only when one of them is handled). Another family registers its backend
with :func:`register` (or :func:`registered`, a context manager: the CPU tests register
their host stand-ins this way); the most recently registered backend that claims an object
handles it.

The module functions :func:`device_view`, :func:`to_host` and :func:`from_host` serve code
whose state stays on the host (the parameter server's workers stage device gradients and
pulls with them): each object goes through its backend; for CUDA objects, a zero-copy CuPy
view read or written after the producer stream is synchronised (with the CuPy copies
:mod:`mpicoll.gpu.array_modules` makes for the codecs).

Only objects that are not exact numpy arrays are ever looked up here: host calls never
reach the registry.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import arrays, detect

__all__ = ["DeviceBackend", "CudaBackend", "register", "unregister", "registered",
           "backend_for", "require", "backend_of", "device_view", "to_host", "from_host"]


def _same(array: Any) -> Any:
    return array


class DeviceBackend:
    """How mpicoll handles one family of device arrays (subclass it; see the module doc).

    A backend implements what its arrays reach: a family used only with the codecs needs
    :meth:`claims` and :meth:`array_module`; one passed to the collectives also needs
    :meth:`aware`, :meth:`copies` and :meth:`view`; the parameter server's workers use
    :meth:`to_host`, :meth:`from_host` and :meth:`new_like`.
    """

    #: Shown in messages.
    name = "device"

    def claims(self, obj: Any) -> bool:
        """Whether ``obj`` is one of this backend's device arrays (never raises)."""
        raise NotImplementedError

    def array_module(self, obj: Any) -> Any:
        """The module whose kernels handle ``obj`` (numpy's names: CuPy for CUDA)."""
        raise NotImplementedError(f"{self.name}: no array module")

    def aware(self) -> tuple[bool, str]:
        """Whether the MPI library takes these arrays directly, and why (default:
        :func:`mpicoll.gpu.detect.cuda_aware`)."""
        return detect.cuda_aware()

    def copies(self, args: Sequence[Any]) -> Any:
        """The staged path's device interface (:class:`mpicoll.gpu.staging.Copies`) for
        one call whose arguments are ``args``."""
        raise NotImplementedError(f"{self.name}: no staged path")

    def view(self, obj: Any) -> tuple[Any, Callable[[Any], Any]]:
        """A zero-copy array view of ``obj`` (an array of :meth:`array_module`) and the
        function that makes a view of it a device argument again (default: ``obj`` is
        such an array already)."""
        return obj, _same

    def synchronise(self, obj: Any) -> None:
        """Block until the work producing ``obj``'s contents has finished (default:
        nothing to wait for)."""

    def to_host(self, obj: Any, out: np.ndarray) -> np.ndarray:
        """Copy ``obj`` (whole, producer synchronised) into host array ``out``."""
        raise NotImplementedError(f"{self.name}: no host copies")

    def from_host(self, obj: Any, host: np.ndarray) -> None:
        """Copy C-contiguous host array ``host`` (``obj``'s shape) into ``obj``."""
        raise NotImplementedError(f"{self.name}: no host copies")

    def new_like(self, obj: Any, shape: tuple, dtype: Any) -> Any:
        """A new device array of ``shape`` and ``dtype`` where ``obj`` is."""
        raise NotImplementedError(f"{self.name}: cannot allocate")


class CudaBackend(DeviceBackend):
    """CUDA memory through CuPy: CuPy arrays, and objects exposing
    ``__cuda_array_interface__`` or a CUDA ``__dlpack__`` (torch CUDA tensors, Numba
    arrays), read through zero-copy CuPy views after their producer stream is
    synchronised (see :mod:`mpicoll.gpu.route`)."""

    name = "cuda"

    def claims(self, obj: Any) -> bool:
        return arrays.package_of(obj) == "cupy" or arrays.is_device(obj)

    def array_module(self, obj: Any) -> Any:
        return _cupy()

    def copies(self, args: Sequence[Any]) -> Any:
        _cupy()
        from .cupy_copies import copies_for  # noqa: PLC0415  (imports CuPy)

        return copies_for(args)

    def view(self, obj: Any) -> tuple[Any, Callable[[Any], Any]]:
        cupy = _cupy()
        if isinstance(obj, cupy.ndarray) or not arrays.is_device(obj):
            return obj, _same
        if arrays.cuda_interface(obj) is not None:
            return cupy.asarray(obj), _same
        return cupy.from_dlpack(obj), _same

    def synchronise(self, obj: Any) -> None:
        """Wait for ``obj``'s producer stream (:func:`mpicoll.gpu.arrays.producer_stream`:
        CuPy's current stream, the ``stream`` of ``__cuda_array_interface__`` v3, torch's
        current stream); the whole device for objects that name none."""
        cupy = _cupy()
        stream = arrays.producer_stream(obj)
        if stream is not None:
            cupy.cuda.runtime.streamSynchronize(stream)
        elif arrays.unsynchronised(obj):
            cupy.cuda.runtime.deviceSynchronize()  # nothing says which stream: be safe

    def to_host(self, obj: Any, out: np.ndarray) -> np.ndarray:
        cupy = _cupy()
        self.synchronise(obj)
        return cupy.asnumpy(self.view(obj)[0], out=out)

    def from_host(self, obj: Any, host: np.ndarray) -> None:
        cupy = _cupy()
        self.synchronise(obj)
        view = self.view(obj)[0]
        host = host.reshape(view.shape)
        if view.flags.c_contiguous:
            view.set(host)
        else:
            cupy.copyto(view, cupy.asarray(host))

    def new_like(self, obj: Any, shape: tuple, dtype: Any) -> Any:
        """A CuPy array on ``obj``'s device (the current one if ``obj`` names none)."""
        cupy = _cupy()
        device = arrays.device_id(obj)
        with cupy.cuda.Device(cupy.cuda.runtime.getDevice() if device is None else device):
            return cupy.empty(shape, dtype=dtype)


def _cupy() -> Any:
    """CuPy, which the CUDA backend's device work needs.

    Raises:
        ImportError: CuPy is not installed (the message says how to install it).
    """
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("mpicoll's collectives on CUDA arrays and tensors need CuPy: pip "
                          "install 'mpicoll[cuda12]' (or [cuda13]; mpicoll.torch's "
                          "operations on torch tensors need none)") from exc
    return cupy


#: Registered backends, the most recent first; the library's own is last.
_backends: list[DeviceBackend] = [CudaBackend()]


def register(backend: DeviceBackend) -> None:
    """Handle the objects ``backend`` claims with it (before every backend registered
    earlier, the library's CUDA backend included)."""
    _backends.insert(0, backend)


def unregister(backend: DeviceBackend) -> None:
    """Undo :func:`register` (nothing if ``backend`` is not registered)."""
    if backend in _backends[:-1]:
        _backends.remove(backend)


@contextlib.contextmanager
def registered(backend: DeviceBackend) -> Iterator[DeviceBackend]:
    """Within: ``backend`` is registered (:func:`register`); yields it."""
    register(backend)
    try:
        yield backend
    finally:
        unregister(backend)


def backend_for(obj: Any) -> DeviceBackend | None:
    """The backend handling ``obj`` (the buffer of an mpi4py spec too), ``None`` for
    host objects."""
    obj = arrays.unwrap_spec(obj)
    if obj is None or type(obj) is np.ndarray:
        return None
    for backend in _backends:
        if backend.claims(obj):
            return backend
    return None


def require(obj: Any) -> DeviceBackend:
    """:func:`backend_for` a device object.

    Raises:
        TypeError: ``obj`` is not a device array of any backend.
    """
    backend = backend_for(obj)
    if backend is None:
        raise TypeError(f"{type(obj).__name__} is not a device array")
    return backend


def backend_of(args: Sequence[Any]) -> DeviceBackend:
    """The backend of the first device object among one call's ``args``.

    Raises:
        TypeError: no argument is a device array.
    """
    for a in args:
        if isinstance(a, (str, int)):
            continue
        backend = backend_for(a)
        if backend is not None:
            return backend
    raise TypeError("no device array among the arguments")


def device_view(obj: Any) -> Any:
    """An array view (CuPy for CUDA) of device object ``obj``, with its ``shape``,
    ``dtype`` and ``flags``; ``obj``'s producer synchronised."""
    backend = require(obj)
    backend.synchronise(obj)
    return backend.view(obj)[0]


def to_host(obj: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy device object ``obj`` (whole) into host memory: ``out`` or a new C-ordered
    numpy array; complete when this returns."""
    backend = require(obj)
    if out is None:
        view = backend.view(obj)[0]
        out = np.empty(view.shape, dtype=view.dtype)
    return backend.to_host(obj, out)


def from_host(obj: Any, host: np.ndarray) -> None:
    """Copy host array ``host`` into device object ``obj`` (same shape and dtype, C-
    contiguous); complete when this returns."""
    require(obj).from_host(obj, np.ascontiguousarray(host))
