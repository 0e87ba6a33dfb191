"""Test doubles: host stand-ins for devices, injected through the library's own extension
points (never shipped in ``mpicoll``).

Importable as ``doubles`` from every test (tests/ is on ``sys.path``: pytest puts the
directory of tests/conftest.py there, and tests/mpi_rank_entry.py does under mpirun).

- :mod:`.device_copies`: :class:`~.device_copies.SimulatedCopies`, the staged pipeline's
  copies (:class:`mpicoll.gpu.staging.Copies`) with deferred streams, passed as
  ``copies=`` or through a backend;
- :mod:`.device_backend`: :class:`~.device_backend.FakeDevice` (``__cuda_array_interface__``
  over numpy) and :class:`~.device_backend.SimulatedBackend`, a
  :class:`mpicoll.gpu.backends.DeviceBackend` for them (registered with
  :func:`mpicoll.gpu.backends.registered`);
- :mod:`.array_module`: :class:`~.array_module.DevArray` and
  :class:`~.array_module.FakeDeviceModule`, a device array module for the codecs, and
  :func:`~.array_module.fake_device_module` which registers its backend;
- :mod:`.torch_device`: :class:`~.torch_device.SimulatedDevice`, a
  :class:`mpicoll.torch.device.tensors.TensorDevice` (registered with
  :func:`mpicoll.torch.device.tensors.registered`).
"""
