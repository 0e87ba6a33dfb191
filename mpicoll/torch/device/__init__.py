"""Device (CUDA) tensors in the adapter.

- :mod:`.tensors`: where a request's tensors live, the engine's stream, the staged path
  (:class:`~.tensors.TensorDevice` and its CUDA implementation);
- :mod:`.cuda_copies`: the staged pipeline's device copies with torch streams and events.
"""
