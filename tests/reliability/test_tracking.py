"""The record the stall inspector reads: call numbering, history, descriptions."""
from __future__ import annotations

import pytest

from mpicoll import tracking
from mpicoll.tracking import HISTORY, CallInfo, Tracker


def test_recorded_calls_are_numbered_and_described():
    t = Tracker("w")
    info = CallInfo("allreduce", 10, "<f4", "sum", None, "auto", "ring", 40)
    call = tracking.recorded(t, info, lambda: "result")
    assert call() == "result" and call() == "result"
    assert (t.entered, t.done) == (2, 2)
    assert t.info(1) == t.info(2) == info and t.info(3) is None


def test_a_call_that_raises_still_completes_its_number():
    t = Tracker("w")

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        tracking.recorded(t, CallInfo("broadcast"), fail)()
    assert (t.entered, t.done) == (1, 1)


def test_history_keeps_the_latest_calls_only():
    t = Tracker("w")
    for seq in range(1, HISTORY + 11):
        t.begin(CallInfo("allreduce", seq))
        t.done = seq
    assert t.info(10) is None and t.info(11).count == 11
    recent = t.recent(HISTORY + 10)
    assert sorted(recent) == list(range(11, HISTORY + 11))


def test_differences_name_each_field_from_the_other_side():
    here = CallInfo("allreduce", 1000, "<f8", "sum", None, "ring")
    there = CallInfo("allreduce", 999, "<f4", "max", None, "tree")
    assert here.differences(there) == ["count 999 (here 1000)", "dtype float32 (here float64)",
                                       "op max (here sum)", "algorithm tree (here ring)"]
    assert here.differences(here) == []
    assert here.describe() == "allreduce(count=1000, dtype=float64, op=sum, algorithm=ring)"
    auto = CallInfo("reduce", 4, "<i4", "sum", 2, "auto", "binomial")
    assert auto.describe() == "reduce(count=4, dtype=int32, op=sum, root=2, algorithm=auto->binomial)"
