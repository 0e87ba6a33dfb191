"""What both compressed reductions of the adapter (the optimizer's,
:mod:`.gradients`, and the per-tensor calls', :mod:`.allreduce`) share: the engine request
that orders a reduction running outside the engine (:func:`check_presence`). The reduction
then runs on the engine's side communicator
(:meth:`mpicoll.torch.engine.core.Engine.side_comm`).
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import CollectiveError, MismatchError
from ..engine.dtypes import dtype_name
from ..engine.negotiation import Meta
from ..ops import Sum
from ..state import engine

__all__ = ["check_presence"]


def check_presence(name: str, layout: str, what: str) -> Any:
    """Start a reduction that runs outside the engine: one all-reduce named ``name`` of a
    1 per rank through the engine in scope; return that engine.

    It orders the reduction with the engine's other requests of the same name, and the
    engine checks that every rank's ``layout`` (what the reduction covers) is the same.
    A rank that called ``hvd.join()`` adds 0: the others then raise here instead of
    waiting for it in a reduction it will never join.

    Args:
        name: the request's name (matched across ranks). layout: what ranks must agree
            on. what: the caller, for the message (``"DistributedOptimizer(...)"``).
    Raises:
        mpicoll.MismatchError: ranks disagree on the layout (or some ranks submitted an
            uncompressed request of this name).
        CollectiveError: a rank has joined, or the engine stopped.
    """
    eng = engine()
    present = torch.zeros(1, dtype=torch.int32)
    meta = Meta(name, "allreduce", dtype_name(torch.int32), (1,), int(Sum), layout=layout)
    future = eng.submit(meta, _ONE, present, waiting=True)
    eng.wait(future)
    error = future.error
    if isinstance(error, MismatchError):    # in the caller's terms, not the request's
        detail = str(error).partition("ranks disagree: ")[2].removeprefix("layout: ")
        raise MismatchError(f"{what}: ranks disagree on the compressed reduction (codec, "
                            f"options, parameters): {detail}") from error
    if error is not None:
        raise error
    joined = eng.size - int(present[0])
    if joined:
        raise CollectiveError(
            f"{what}: {joined} rank(s) called hvd.join(); a compressed all-reduce runs "
            f"outside the engine and cannot stand in zeros for joined ranks (use "
            f"Compression.none or Compression.fp16 with join())")
    return eng


#: Every rank's contribution to :func:`check_presence` (never written).
_ONE = torch.ones(1, dtype=torch.int32)
