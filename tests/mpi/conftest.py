"""Fixtures of the collectives MPI suite."""
from __future__ import annotations

import pytest

from mpicoll.context import get_context

from cases import COMM, SMALL_SEGMENT


@pytest.fixture(params=[SMALL_SEGMENT, None], ids=["seg64", "segdefault"])
def segment(request):
    """Run the test with tiny segments (multi-segment paths) and with the default size."""
    ctx = get_context(COMM)
    saved = ctx.segment_bytes
    if request.param:
        ctx.segment_bytes = request.param
    yield request.param or saved
    ctx.segment_bytes = saved
