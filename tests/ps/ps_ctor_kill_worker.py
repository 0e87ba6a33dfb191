"""One rank SIGKILLs itself inside the ParameterServer constructor (Open MPI, ULFM).

Usage: ``mpirun --with-ft ulfm -n 3 python ps_ctor_kill_worker.py STEP SERVERS``: rank 0
dies on entering the constructor's step ``STEP`` (a method name of
:class:`mpicoll.ps.core.ParameterServer`, e.g. ``_agree``); ``SERVERS`` is ``1`` or
``colocated``. Every survivor prints ``RESULT <rank> pfe <seconds> <failed ranks>`` when the
constructor raised :class:`mpicoll.ProcessFailedError`, else ``RESULT <rank> other ...``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.ps import ParameterServer
from mpicoll.ps import core


def main() -> None:
    step, servers = sys.argv[1], sys.argv[2]
    rank = MPI.COMM_WORLD.Get_rank()
    original = getattr(core.ParameterServer, step)

    def dying(self, *args, **kwargs):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    setattr(core.ParameterServer, step, dying)
    start = time.monotonic()
    try:
        ParameterServer({"w": np.zeros(100, np.float32)},
                        num_servers=servers if servers == "colocated" else int(servers))
        print("RESULT", rank, "none", flush=True)
    except mpicoll.ProcessFailedError as exc:
        print("RESULT", rank, "pfe", f"{time.monotonic() - start:.2f}",
              ",".join(map(str, exc.failed_ranks or [])), flush=True)
    except Exception as exc:  # noqa: BLE001
        print("RESULT", rank, "other", type(exc).__name__, str(exc)[:200].replace("\n", " "),
              flush=True)


if __name__ == "__main__":
    main()
