"""Where each parameter lives: whole on one server, or split in ranges over all servers.

Every rank computes the same :class:`Placement` from the same (name, shape, dtype) list:
names are taken in sorted order, a tensor smaller than ``split_bytes`` goes whole to server
``crc32(name) % num_servers`` (a stable hash, unlike Python's salted ``hash``), and a
larger one is cut into ``num_servers`` contiguous ``numpy.array_split`` ranges, range ``i``
on server ``i``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ..partition import block_bounds
from .errors import PSError
from .protocol import dtype_code, key_of

__all__ = ["ParamSpec", "Shard", "Placement", "DEFAULT_SPLIT_BYTES"]

DEFAULT_SPLIT_BYTES = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """A named tensor's metadata."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @functools.cached_property
    def size(self) -> int:
        """Number of elements (computed once)."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.size * self.dtype.itemsize

    @functools.cached_property
    def key(self) -> int:
        """The wire key (crc32 of the name; computed once)."""
        return key_of(self.name)

    def as_plain(self) -> list:
        """``[name, shape, dtype string]``: JSON- and pickle-free friendly."""
        return [self.name, list(self.shape), self.dtype.str]


@dataclass(frozen=True)
class Shard:
    """A contiguous range ``[lo, hi)`` of a flat tensor stored on one server."""

    spec: ParamSpec
    index: int
    server: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        """Elements in the shard."""
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        """Bytes in the shard."""
        return self.count * self.spec.dtype.itemsize

    @property
    def ident(self) -> tuple[int, int]:
        """(key, shard index): how requests name the shard."""
        return (self.spec.key, self.index)

    def label(self) -> str:
        """A readable, file-safe name: ``name[lo:hi]``."""
        return f"{self.spec.name}[{self.lo}:{self.hi}]"


def specs_from_params(params: dict[str, Any]) -> list[ParamSpec]:
    """Turn ``name -> array`` into sorted :class:`ParamSpec`s, validating names and dtypes.

    Raises:
        TypeError: ``params`` is not a dict of str -> array, or a dtype is not carried.
    """
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict name -> array, not {type(params).__name__}")
    specs = []
    for name in sorted(params):
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {name!r}")
        arr = params[name]
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"params[{name!r}] must be an array, not {type(arr).__name__}")
        dtype = np.dtype(arr.dtype)
        if dtype_code(dtype) < 0:
            raise TypeError(f"params[{name!r}] has dtype {dtype}, which the parameter server "
                            f"does not carry")
        specs.append(ParamSpec(name, tuple(int(s) for s in arr.shape), dtype))
    return specs


class Placement:
    """The shards of every parameter and the server each lives on.

    Args:
        specs: the parameters (any order; placement sorts by name).
        num_servers: number of servers (>= 1).
        split_bytes: tensors of at least this many bytes are split over all servers.
    Raises:
        PSError: two names with the same crc32 key.
    """

    def __init__(self, specs: Iterable[ParamSpec], num_servers: int,
                 split_bytes: int = DEFAULT_SPLIT_BYTES) -> None:
        self.num_servers = int(num_servers)
        self.split_bytes = int(split_bytes)
        self.specs: dict[str, ParamSpec] = {s.name: s for s in sorted(specs, key=lambda s: s.name)}
        seen: dict[int, str] = {}
        for spec in self.specs.values():
            if spec.key in seen:
                raise PSError(f"parameter names {seen[spec.key]!r} and {spec.name!r} have the "
                              f"same crc32 key; rename one")
            seen[spec.key] = spec.name
        self.shards: dict[str, list[Shard]] = {}
        for spec in self.specs.values():
            if spec.nbytes >= self.split_bytes and self.num_servers > 1 and spec.size > 1:
                bounds = block_bounds(spec.size, self.num_servers)
                parts = [(i, bounds[i], bounds[i + 1]) for i in range(self.num_servers)]
            else:
                parts = [(spec.key % self.num_servers, 0, spec.size)]
            self.shards[spec.name] = [Shard(spec, i, srv, lo, hi)
                                      for i, (srv, lo, hi) in enumerate(parts)]
        #: every shard, in (name, index) order
        self.all_shards = [sh for shards in self.shards.values() for sh in shards]
        self.by_ident: dict[tuple[int, int], Shard] = {sh.ident: sh for sh in self.all_shards}

    def server_of_unknown(self, name: str) -> int:
        """The server a name that is not a parameter is sent to (so it can say so)."""
        return key_of(name) % self.num_servers

    def shards_on(self, server: int) -> list[Shard]:
        """The shards stored on ``server``, in (name, index) order."""
        return [sh for sh in self.all_shards if sh.server == server]

    def bytes_per_server(self) -> list[int]:
        """Bytes of parameters stored on each server (skew shows here)."""
        out = [0] * self.num_servers
        for sh in self.all_shards:
            out[sh.server] += sh.nbytes
        return out

    def describe(self) -> dict:
        """The layout as plain values (checkpoints compare these)."""
        return {"num_servers": self.num_servers, "split_bytes": self.split_bytes,
                "params": [s.as_plain() for s in self.specs.values()],
                "shards": [[sh.spec.name, sh.index, sh.server, sh.lo, sh.hi]
                           for sh in self.all_shards]}
