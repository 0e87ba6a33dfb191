"""Horovod's ``ElasticSampler``: a dataset split across the ranks, split again after a
reset among the ranks left, without repeating the samples already processed this epoch."""
from __future__ import annotations

import math
import random
from typing import Any, Iterator

import torch.utils.data

from .world import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions ``dataset``'s indices across the ranks like ``DistributedSampler``, and
    partitions what is left of the epoch again after each reset.

    Use it as Horovod documents: put it in the :class:`~mpicoll.torch.elastic.TorchState`
    (so that commits record how far the epoch got), call :meth:`record_batch` after each
    batch and :meth:`set_epoch` at the *end* of each epoch.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the indices (the same permutation on every rank: ``seed +
            epoch``).
        seed: the shuffling seed, the same on every rank.
    Attributes:
        epoch: the current epoch. processed_num: samples processed so far this epoch,
            summed over the ranks. num_replicas, rank: the split in force.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order (when shuffling) and nothing processed yet. Call
        it at the end of an epoch, so that a commit inside an epoch keeps its progress."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that every rank has processed one more batch of ``batch_size``
        samples (``batch_idx`` is accepted for Horovod's signature)."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "processed_num"}``: what a commit keeps."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Go back to ``state_dict`` and split what is left among the current ranks."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Split the epoch's unprocessed indices among the current ranks
        (``hvd.size()``, ``hvd.rank()``; without ``hvd.init()``, the world's)."""
        self.split(size(), rank())

    def split(self, num_replicas: int, rank: int) -> None:
        """Split the epoch's unprocessed indices as ``rank`` of ``num_replicas``
        (:meth:`reset` with the current world's; also for tests)."""
        self.num_replicas, self.rank = num_replicas, rank
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        pad = self.total_size - len(indices)    # evenly divisible: repeat from the start,
        if pad > 0:                             # several times round when few remain
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
