"""The registry of algorithms: collective name -> algorithm name -> function.

Every algorithm module registers its run function here with :func:`register`; tests and
benchmarks enumerate :func:`names` instead of listing algorithms by hand.

Run-function signatures, by collective (arrays are flat; ``ctx`` is a
:class:`mpicoll.context.CommContext`; ``op`` is anything with ``combine(a, b, out)``):

- ``allreduce(ctx, send, recv, op)``: ``send is recv`` means in place.
- ``reduce_scatter(ctx, send, recv, op)``: ``send`` holds the full vector, ``recv`` this
  rank's ``array_split`` block.
- ``allgather(ctx, send, recv)``: ``send`` is this rank's block or ``None`` when the block
  is already in place in ``recv``.
- ``broadcast(ctx, buf, root)``.
- ``reduce(ctx, send, recv, op, root)``: ``recv`` may be ``None`` off the root.

Algorithms are only called with ``ctx.size > 1`` and a non-empty buffer; the caller handles
the trivial cases and the final scaling of ``average``. An algorithm that needs a choice
made above it takes it as a keyword argument (``hierarchical`` takes ``inner=``, the
all-reduce it runs among nodes), supplied by :func:`mpicoll.selection.algorithm_options`.

:func:`bind` fixes a run function to its arguments for repeated calls (the cached calls of
:mod:`mpicoll.fastpath`); a run function with a ``bind(ctx, *args)`` attribute prepares
more there (native MPI builds its buffer specs once).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["COLLECTIVES", "register", "lookup", "bind", "names", "is_registered",
           "scales_shards"]

#: The collectives mpicoll implements.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")

_REGISTRY: dict[str, dict[str, Callable]] = {c: {} for c in COLLECTIVES}
_SCALES_SHARDS: set[tuple[str, str]] = set()


def register(collective: str, name: str, *,
             scales_shards: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as algorithm ``name`` of ``collective``.

    ``scales_shards``: the run function takes ``finalize=True`` and then applies
    ``op.finalize`` (the division of ``average``) itself, to each shard on the one rank
    that reduces it, before the shards are copied to every rank: one pass over ``1/n`` of
    the vector instead of a pass over all of it on every rank.
    """
    def deco(fn: Callable) -> Callable:
        _REGISTRY[collective][name] = fn
        if scales_shards:
            _SCALES_SHARDS.add((collective, name))
        return fn

    return deco


def lookup(collective: str, name: str) -> Callable:
    """Return the run function of algorithm ``name`` of ``collective`` (a name the caller
    validated: :func:`mpicoll.selection.resolve_algorithm`)."""
    return _REGISTRY[collective][name]


def bind(collective: str, name: str, ctx: Any, *args: Any, **options: Any) -> Callable[[], Any]:
    """A zero-argument callable that runs algorithm ``name`` (registered) with these
    arguments."""
    fn = lookup(collective, name)
    binder = getattr(fn, "bind", None)
    if binder is not None:
        return binder(ctx, *args, **options)
    return functools.partial(fn, ctx, *args, **options)


def scales_shards(collective: str, name: str) -> bool:
    """Whether algorithm ``name`` applies ``op.finalize`` itself when given ``finalize=True``."""
    return (collective, name) in _SCALES_SHARDS


def is_registered(collective: str, name: str) -> bool:
    """Whether ``name`` is a registered algorithm of ``collective`` (cheap: a dict lookup)."""
    return name in _REGISTRY.get(collective, ())


def names(collective: str) -> list[str]:
    """Registered algorithm names of ``collective`` (``"auto"`` not included), sorted."""
    if collective not in _REGISTRY:
        raise ValueError(f"unknown collective {collective!r}; choose one of {COLLECTIVES}")
    return sorted(_REGISTRY[collective])
