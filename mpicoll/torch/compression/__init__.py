"""Gradient compression in the adapter (Horovod's ``horovod.torch.compression`` module name).

- :mod:`.compressors`: the compressors users pass (``Compression.none``, ``.fp16``, and
  mpicoll's codecs ``.bf16``, ``.int8``, ``.onebit``, ``.topk(r)``, ``.randomk(r)``);
- :mod:`.allreduce`: ``hvd.allreduce``/``grouped_allreduce`` with a codec compressor;
- :mod:`.gradients`: DistributedOptimizer's reduction of its gradients with a codec;
- :mod:`.agreement`: what those two share (ordering through the engine, the communicator).
"""
from __future__ import annotations

from .compressors import CodecCompressor, Compression, Compressor

__all__ = ["Compression", "Compressor", "CodecCompressor"]
