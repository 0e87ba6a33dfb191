"""Serial: importing mpicoll.torch registers the "mpicoll" torch.distributed backend."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_backend_registered_on_import():
    import torch.distributed as dist

    import mpicoll.torch  # noqa: F401
    from mpicoll.torch import distributed

    assert "mpicoll" in dist.Backend.backend_list
    assert dist.Backend.MPICOLL == "mpicoll"
    assert dist.Backend._plugins["MPICOLL"].creator_fn is distributed._create
    distributed.register()          # idempotent
    assert dist.Backend.backend_list.count("mpicoll") == 1


def test_reduce_op_names():
    import torch.distributed as dist

    from mpicoll.torch.distributed import _op_name

    assert _op_name(dist.ReduceOp.AVG) == "average"
    assert _op_name(dist.ReduceOp.BXOR) == "bxor"
    with pytest.raises(ValueError, match="does not support"):
        _op_name(dist.ReduceOp.PREMUL_SUM)
