"""Fixtures of the collectives MPI suite."""
from __future__ import annotations

import pytest

from mpicoll.context import get_context

from cases import COMM, SMALL_SEGMENT


#: World sizes from which the tiny-segment variant is skipped: the multi-segment paths are
#: covered at n = 2..4 (even nodes, uneven nodes with shm in many chunks at n = 3, powers
#: of two and not); at n = 5 and 8 it took about half of the two longest runs of the CI
#: suite (kept under 15 minutes on 2 cores).
SMALL_SEGMENT_MAX_SIZE = 4


@pytest.fixture(params=[SMALL_SEGMENT, None], ids=["seg64", "segdefault"])
def segment(request):
    """Run the test with tiny segments (multi-segment paths) and with the default size."""
    if request.param and COMM.Get_size() > SMALL_SEGMENT_MAX_SIZE:
        pytest.skip(f"tiny segments are tested at n <= {SMALL_SEGMENT_MAX_SIZE} (CI time)")
    ctx = get_context(COMM)
    saved = ctx.segment_bytes
    if request.param:
        ctx.segment_bytes = request.param
    yield request.param or saved
    ctx.segment_bytes = saved
