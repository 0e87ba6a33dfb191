"""This rank and the world's size for the elastic API: ``hvd.rank()``/``hvd.size()`` when
``hvd.init()`` has run, else the runtime's world (a program that only uses
``torch.distributed``, DDP say, needs no ``hvd.init()``)."""
from __future__ import annotations

from ...elastic.state import _world_rank
from .. import state as torch_state
from ...runtime import world as runtime_world

__all__ = ["hvd_started", "rank", "size"]


def hvd_started() -> bool:
    """Whether ``hvd.init()`` has run (syncs then go through ``mpicoll.torch``)."""
    return torch_state.started()


def rank() -> int:
    """This rank (``hvd.rank()``, or the world's without ``hvd.init()``)."""
    return torch_state.rank() if hvd_started() else _world_rank()


def size() -> int:
    """The number of ranks (``hvd.size()``, or the world's without ``hvd.init()``)."""
    return torch_state.size() if hvd_started() else runtime_world.comm().Get_size()
