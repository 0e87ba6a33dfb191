"""mpicoll.torch MPI suite: one ``hvd.init()`` per process, one torch thread per rank."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="session", autouse=True)
def hvd():
    import mpicoll.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    yield hvd
    hvd.shutdown()
