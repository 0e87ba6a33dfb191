"""The elastic state API in one process (the MPICH venv, no failure): commits are copies,
restore goes back to them, the sampler splits an epoch without losing or repeating a
sample, also when the split changes mid-epoch, and the run loop's bookkeeping."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicoll.elastic as elastic
import mpicoll.torch as hvd
from mpicoll import context
from mpicoll.torch.elastic.sampler import ElasticSampler


@pytest.fixture(scope="module", autouse=True)
def _hvd() -> None:
    hvd.init()


def test_object_state_commit_is_a_copy_and_restore_goes_back() -> None:
    state = elastic.ObjectState(step=0, w=np.zeros(5))
    state.w += 1
    state.step = 3
    state.commit()
    state.w += 10                        # in place, after the commit
    state.step = 7
    state.restore()
    assert state.step == 3 and state.w.tolist() == [1.0] * 5
    state.w[0] = 99
    state.restore()                      # restore hands out copies too
    assert state.w[0] == 1.0


def test_object_state_serializes_its_commit() -> None:
    a = elastic.ObjectState(step=4, w=np.arange(3.0))
    b = elastic.ObjectState(step=0, w=np.zeros(3))
    b.deserialize(a.serialize())
    b.restore()
    assert b.step == 4 and b.w.tolist() == [0.0, 1.0, 2.0]


def test_torch_state_restores_model_optimizer_sampler_and_objects() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(40), shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=2)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()

    step()
    sampler.record_batch(0, 5)
    state.commit()
    saved = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    step()
    step()
    sampler.record_batch(1, 5)
    state.epoch = 5
    state.restore()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), momentum))
    assert state.epoch == 2 and sampler.processed_num == 5
    step()                               # the restored momentum is not the commit's memory
    state.restore()
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), momentum))


def test_elastic_sampler_resplits_the_rest_of_the_epoch() -> None:
    n, batch = 23, 2
    seen: list[int] = []
    # 3 ranks take 2 batches each, then the world shrinks to 2 for the rest of the epoch
    for r in range(3):
        s = ElasticSampler(range(n), shuffle=True, seed=7)
        s.split(3, r)
        seen += list(s)[:2 * batch]
    processed = 2 * batch * 3
    for r in range(2):
        s = ElasticSampler(range(n), shuffle=True, seed=7)
        s.load_state_dict({"epoch": 0, "processed_num": processed})
        s.split(2, r)
        seen += list(s)
    assert set(seen) == set(range(n))                 # nothing lost
    assert len(seen) - n <= 1                          # padding repeats at most one
    assert len(ElasticSampler(range(n))) == n          # one rank here: all of it


@pytest.mark.parametrize(("n", "processed", "ranks"), [(49, 48, 3), (1, 0, 3), (10, 3, 4),
                                                       (5, 0, 8)])
def test_elastic_sampler_gives_every_rank_as_many_samples(n, processed, ranks) -> None:
    """Fewer samples left than ranks (or than half of them): the padding goes round the
    remaining samples as often as needed, so every rank takes len() samples and as many
    steps (padding once round left some ranks short, and the ranks out of step)."""
    splits = []
    for r in range(ranks):
        s = ElasticSampler(range(n), shuffle=True, seed=7)
        s.load_state_dict({"epoch": 0, "processed_num": processed})
        s.split(ranks, r)
        splits.append(list(s))
        assert len(splits[-1]) == len(s), (r, splits[-1], len(s))
    rest = ElasticSampler(range(n), shuffle=True, seed=7)
    rest.load_state_dict({"epoch": 0, "processed_num": processed})
    rest.split(1, 0)
    assert {i for split in splits for i in split} == set(rest)     # nothing lost


def test_object_state_that_does_not_pickle_fails_the_sync_clearly() -> None:
    """Rank 0's attribute that does not pickle: a CollectiveError naming it (raised on
    every rank: the broadcast carries the reason, instead of rank 0 alone raising while
    the others wait), not a TypeError that makes rank 0 leave as a lost rank."""
    import threading

    from mpicoll import errors

    state = elastic.ObjectState(step=3, lock=threading.Lock())
    with pytest.raises(errors.CollectiveError, match="attribute 'lock' does not pickle"):
        state.sync()
    fine = elastic.ObjectState(step=3, weights=np.arange(4.0))
    fine.weights[:] = 0
    fine.sync()                     # (the last commit, rank 0's: restored here)
    assert fine.step == 3 and list(fine.weights) == [0.0, 1.0, 2.0, 3.0]


def test_set_epoch_reshuffles_and_clears_progress() -> None:
    s = ElasticSampler(range(50), shuffle=True, seed=3)
    first = list(s)
    s.record_batch(0, 10)
    assert s.processed_num == 10 and len(list(s)) == 50   # the split changes at a reset
    s.reset()
    assert len(list(s)) == 40 and list(s) == first[10:]
    s.set_epoch(1)
    assert s.processed_num == 0 and sorted(s) == list(range(50)) and list(s) != first


def test_run_syncs_then_calls_and_returns() -> None:
    calls = []
    state = elastic.ObjectState(x=1)

    @elastic.run
    def f(state: elastic.ObjectState, y: int) -> int:
        calls.append(state.x)
        return state.x + y

    assert f(state, 2) == 3 and calls == [1]
    with pytest.raises(TypeError, match="State"):
        f(object(), 1)
    with pytest.raises(ValueError, match="min_np"):
        elastic.run(min_np=0)


def test_world_is_settable_and_comm_none_follows_it() -> None:
    from mpi4py import MPI  # noqa: PLC0415

    dup = MPI.COMM_WORLD.Dup()
    try:
        context.set_world(dup)
        assert context.resolve_comm(None) is dup and elastic.world() is dup
    finally:
        context.set_world(None)
        dup.Free()
    assert context.resolve_comm(None) is MPI.COMM_WORLD


def test_object_state_keeps_what_cannot_be_copied_by_reference() -> None:
    import threading

    lock = threading.Lock()                          # deepcopy raises TypeError on it
    state = elastic.ObjectState(lock=lock, step=0, w=[1])
    state.w.append(2)
    state.commit()
    state.w.append(3)
    state.restore()
    assert state.lock is lock and state.w == [1, 2]  # the list a copy, the lock itself


@pytest.mark.parametrize("kwargs,bad", [({"min_np": 0}, "min_np"),
                                        ({"reset_limit": -1}, "reset_limit"),
                                        ({"reset_limit": 1.5}, "reset_limit")])
def test_run_refuses_bad_limits(kwargs, bad) -> None:
    for run in (elastic.run, hvd.elastic.run):
        with pytest.raises(ValueError, match=bad):
            run(**kwargs)


def test_limits_come_from_the_environment(monkeypatch) -> None:
    from mpicoll import config
    from mpicoll.elastic.runner import limits

    try:
        config.refresh()                    # config caches what it has read
        assert limits(None, None) == (1, None)
        monkeypatch.setenv("MPICOLL_ELASTIC_MIN_NP", "3")
        monkeypatch.setenv("MPICOLL_ELASTIC_RESET_LIMIT", "2")
        config.refresh()
        assert limits(None, None) == (3, 2) and limits(2, 0) == (2, 0)
        monkeypatch.setenv("MPICOLL_ELASTIC_RESET_LIMIT", "many")
        config.refresh()
        with pytest.raises(ValueError, match="MPICOLL_ELASTIC_RESET_LIMIT='many'"):
            limits(None, None)
        # out of range: the variable is named (the message spoke of min_np= the user
        # never passed)
        monkeypatch.setenv("MPICOLL_ELASTIC_RESET_LIMIT", "-1")
        config.refresh()
        with pytest.raises(ValueError, match="MPICOLL_ELASTIC_RESET_LIMIT=-1 must be >= 0"):
            limits(None, None)
        monkeypatch.setenv("MPICOLL_ELASTIC_RESET_LIMIT", "2")
        monkeypatch.setenv("MPICOLL_ELASTIC_MIN_NP", "0")
        config.refresh()
        with pytest.raises(ValueError, match="MPICOLL_ELASTIC_MIN_NP=0 must be >= 1"):
            limits(None, None)
    finally:
        monkeypatch.undo()
        config.refresh()


@pytest.fixture
def host_updates(mpicoll_env) -> None:
    """MPICOLL_ELASTIC_HOST_UPDATES=1 (no discovery here)."""
    mpicoll_env(MPICOLL_ELASTIC_HOST_UPDATES="1")


def test_host_update_messages_wait_without_a_discovery_or_the_variable() -> None:
    state = elastic.ObjectState(step=0)
    with pytest.warns(RuntimeWarning, match="MPICOLL_ELASTIC_HOST_UPDATES"):
        state.on_hosts_updated(5.0, elastic.HostUpdateResult.added)
    state.commit()                                   # local: not checked
    assert state._host_messages.qsize() == 1


def test_host_update_messages_interrupt_the_next_commit(host_updates) -> None:
    """Horovod's State.on_hosts_updated: a newer message interrupts the next commit
    (skip_sync when hosts were only removed), once; an older one does nothing; a reset
    drops what was not checked."""
    result = elastic.HostUpdateResult
    state = elastic.ObjectState(step=0)
    state.commit()                                   # no message: nothing
    state.on_hosts_updated(5.0, result.removed)
    state.step = 1
    with pytest.raises(elastic.HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is True and state.step == 1
    state.restore()
    assert state.step == 1                           # the commit was taken before the check
    state.commit()                                   # acted on: not again
    state.on_hosts_updated(4.0, result.added)        # older than the last acted on
    state.commit()
    state.on_hosts_updated(6.0, result.removed)
    state.on_hosts_updated(7.0, result.added)
    with pytest.raises(elastic.HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is False              # mixed: the state is synced again
    state.on_hosts_updated(9.0, result.added)
    state.on_reset()
    state.commit()                                   # dropped by the reset
    assert result.mixed == result.added | result.removed and int(result.no_update) == 0


def test_run_resets_on_a_host_update_and_goes_on(host_updates) -> None:
    state = elastic.ObjectState(step=0)
    resets, calls = [], []
    state.register_reset_callbacks([lambda: resets.append(state.step)])

    @elastic.run
    def f(state: elastic.ObjectState) -> int:
        calls.append(state.step)
        while state.step < 4:
            state.step += 1
            if state.step == 2 and not resets:
                state.on_hosts_updated(1.0, elastic.HostUpdateResult.added)
            state.commit()
        return state.step

    assert f(state) == 4 and resets == [2] and calls == [0, 2]


# ----- the run loop's failure paths, in one process (no ULFM here) ----------------------
def test_without_ulfm_an_exception_propagates_and_the_function_is_not_rerun() -> None:
    """Without ULFM, what the function raises (sys.exit(0) included) reaches the caller
    unchanged and nothing is restored or reset."""
    from mpicoll.runtime import failures

    assert not failures.ENABLED
    calls = []
    state = elastic.ObjectState(step=0)

    @elastic.run
    def f(state: elastic.ObjectState, how: str) -> None:
        calls.append(how)
        state.step += 1
        if how == "raise":
            raise KeyError("boom")
        raise SystemExit(0)

    with pytest.raises(KeyError, match="boom"):
        f(state, "raise")
    assert state.step == 1                       # not restored
    with pytest.raises(SystemExit) as ended:
        f(state, "exit")
    assert ended.value.code == 0 and calls == ["raise", "exit"]


def test_under_ulfm_which_exceptions_make_a_rank_leave(monkeypatch) -> None:
    """Under ULFM a rank leaves on any exception but mpicoll's job-ending errors, and on
    sys.exit with a non-zero status; a ProcessFailedError is a failure, a ValueError not."""
    from mpicoll import errors
    from mpicoll.elastic import runner

    monkeypatch.setattr(runner.failures, "ENABLED", True)
    assert runner._leaves(ValueError("x")) and runner._leaves(SystemExit(3))
    assert not runner._leaves(SystemExit(0)) and not runner._leaves(SystemExit(None))
    for exc in (errors.CollectiveError("x"), elastic.DiscoveryError("x"),
                runner.GrowthError("x"), KeyboardInterrupt()):
        assert not runner._leaves(exc), type(exc).__name__
    assert runner._failure(errors.ProcessFailedError("rank 2 failed", [2]))
    assert not runner._failure(ValueError("x"))
    # the function's own mpi4py call: a failure when the runtime translates it into one
    from mpi4py import MPI

    raw = MPI.Exception(MPI.ERR_OTHER)
    monkeypatch.setattr(runner.failures, "translate",
                        lambda exc, comm, what: errors.ProcessFailedError("lost", [1])
                        if exc is raw else exc)
    assert runner._failure(raw)
    assert not runner._failure(MPI.Exception(MPI.ERR_COUNT))


def test_a_rank_that_raises_under_ulfm_leaves_through_leave(monkeypatch) -> None:
    """The loop hands an exception that makes the rank leave to ``_leave`` (which never
    returns), and restores nothing."""
    from mpicoll.elastic import runner

    left = []

    def leave(exc: BaseException) -> None:
        left.append(exc)
        raise SystemExit(9)                       # as the real one, it does not return

    monkeypatch.setattr(runner, "_leaves", lambda exc: True)
    monkeypatch.setattr(runner, "_leave", leave)
    state = elastic.ObjectState(step=0)

    @elastic.run
    def f(state: elastic.ObjectState) -> None:
        raise RuntimeError("bad batch")

    with pytest.raises(SystemExit):
        f(state)
    assert [str(e) for e in left] == ["bad batch"]


class _Ended(Exception):
    """What the stand-ins for os._exit and SIGKILL raise, with the status."""


class _FakeWorld:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size


def _fake_exits(monkeypatch, runner, failed: list[int]) -> None:
    """``runner``'s world: rank 1 of 3, ``failed`` known failed; os._exit and the SIGKILL
    raise :class:`_Ended` (``"kill"`` for the kill)."""
    import types

    def exit_(status: int) -> None:
        raise _Ended(status)

    def kill() -> None:
        raise _Ended("kill")

    monkeypatch.setattr(runner.runtime_world, "comm", lambda: _FakeWorld(1, 3))
    monkeypatch.setattr(runner.failures, "failed_ranks", lambda *a, **k: list(failed))
    monkeypatch.setattr(runner, "os", types.SimpleNamespace(_exit=exit_))
    monkeypatch.setattr(runner, "_kill_self", kill)
    monkeypatch.setattr(runner, "LEAVE_WAIT_S", 0.01)


@pytest.mark.parametrize("failed, status", [([0], "kill"), ([0, 2], 1)])
def test_a_leaving_rank_says_why_and_kills_itself_unless_last(monkeypatch, capsys, failed,
                                                              status) -> None:
    """``_leave`` prints the traceback, then kills itself while another rank lives, or
    exits with LEFT_STATUS (1) when every other rank has failed."""
    from mpicoll.elastic import runner

    _fake_exits(monkeypatch, runner, failed)
    try:
        raise ValueError("bad input on this rank")
    except ValueError as exc:
        with pytest.raises(_Ended) as ended:
            runner._leave(exc)
    assert ended.value.args == (status,)
    err = capsys.readouterr().err
    assert "rank 1 of 3 raised ValueError" in err and "lost rank" in err
    assert "bad input on this rank" in err and "Traceback" in err


def test_a_rank_whose_function_ended_leaves_saying_why(monkeypatch, capsys) -> None:
    """``_leave_ended`` (the ending's ``leave``) prints the reason and kills the process."""
    from mpicoll.elastic import runner

    _fake_exits(monkeypatch, runner, [])
    with pytest.raises(_Ended, match="kill"):
        runner._leave_ended("rank 1's elastic function returned while rank 0 waits")
    err = capsys.readouterr().err
    assert "rank 1's elastic function returned while rank 0 waits: it leaves the job as " \
           "a lost rank" in err


def test_a_reset_is_retried_while_ranks_fail_and_other_errors_propagate() -> None:
    """``_reset_until_stable``: a ProcessFailedError during the reset means reset again
    (at most MAX_RESETS_PER_FAILURE times, then RuntimeError); any other MPI error is
    raised as it is."""
    from mpi4py import MPI

    from mpicoll import errors
    from mpicoll.elastic import runner

    calls = []

    def reset(fail_times: int) -> None:
        calls.append(1)
        if len(calls) <= fail_times:
            raise errors.ProcessFailedError("rank 1 failed", [1])

    runner._reset_until_stable(lambda: reset(2))
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="kept failing: 16 resets in a row"):
        runner._reset_until_stable(lambda: reset(100))
    assert len(calls) == runner.MAX_RESETS_PER_FAILURE

    def broken() -> None:
        raise MPI.Exception(MPI.ERR_OTHER)

    with pytest.raises(MPI.Exception):
        runner._reset_until_stable(broken)


def test_a_growth_that_fails_keeps_the_size_or_shrinks(monkeypatch, caplog) -> None:
    """``_grow_or_reset``: a GrowthError keeps the world (logged, and discovery does not
    retry that target); a process failure while growing shrinks instead; another MPI
    error is raised."""
    from mpi4py import MPI

    from mpicoll import errors
    from mpicoll.elastic import discovery, runner, shrink

    source = discovery.Discovery(lambda: 3)
    monkeypatch.setattr(discovery, "_active", source)
    interrupt = discovery.HostsAddedInterrupt(2, 3)
    resets = []

    def grow_with(exc: BaseException):
        def grow(new_size: int) -> None:
            assert new_size == 3
            raise exc
        return grow

    with caplog.at_level("ERROR", logger="mpicoll.elastic"):
        event = runner._grow_or_reset(interrupt, lambda: resets.append(1),
                                      grow_with(runner.GrowthError("no free slots")))
    assert event is None and resets == [] and source.failed_target == 3
    assert "no free slots; the job goes on at 2 ranks" in caplog.text
    recovery = object()
    monkeypatch.setattr(shrink, "last_recovery", recovery)
    event = runner._grow_or_reset(interrupt, lambda: resets.append(1),
                                  grow_with(errors.ProcessFailedError("rank 1", [1])))
    assert event is recovery and resets == [1]
    with pytest.raises(MPI.Exception):
        runner._grow_or_reset(interrupt, lambda: resets.append(1),
                              grow_with(MPI.Exception(MPI.ERR_OTHER)))
    assert resets == [1]


def test_a_job_launched_below_min_np_without_discovery_stops_at_once() -> None:
    """min_np above the launch size with nothing to grow the job: TooFewRanksError at the
    first call (it trained on, the limit checked only after a shrink); with min_np met,
    the function runs."""
    from mpicoll import errors

    size = context.world().Get_size()
    state = elastic.ObjectState(step=0)

    @elastic.run(min_np=size + 1)
    def f(state: elastic.ObjectState) -> int:
        return 7

    with pytest.raises(errors.TooFewRanksError, match=f"fewer than min_np={size + 1}"):
        f(state)
    assert elastic.run(min_np=size)(lambda state: 7)(state) == 7
