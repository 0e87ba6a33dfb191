"""The line each rank of a fault job prints when its loop of collectives ends, which the
fault tests parse (``ulfm_jobs.lines(out, "RESULT")``):

- ``RESULT <rank> none``: the loop ended without an error;
- ``RESULT <rank> pfe <failed ranks, comma-separated, or -> <time>``: the expected
  process-failure error;
- ``RESULT <rank> other <exception class> <time> <message>``: anything else.
"""
from __future__ import annotations

import time

import mpicoll


def report(rank: int, exc: BaseException | None = None,
           kinds: tuple[type, ...] = (mpicoll.ProcessFailedError,)) -> None:
    """Print ``rank``'s RESULT line for ``exc`` (``None``: no error); the error counts as
    ``pfe`` only if it is an instance of every class in ``kinds``."""
    if exc is None:
        line = f"RESULT {rank} none"
    elif all(isinstance(exc, kind) for kind in kinds):
        ranks = ",".join(map(str, exc.failed_ranks)) or "-"
        line = f"RESULT {rank} pfe {ranks} {time.time():.6f}"
    else:
        msg = str(exc).replace("\n", " ")[:160]
        line = f"RESULT {rank} other {type(exc).__name__} {time.time():.6f} {msg}"
    print(line, flush=True)
