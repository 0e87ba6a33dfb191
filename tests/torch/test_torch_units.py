"""mpicoll.torch pieces that need no other ranks: negotiation, fusion planning, ops,
dtypes, compression, settings."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpicoll.torch import Compression, ops  # noqa: E402
from mpicoll.torch.engine.dtypes import check_supported, numpy_view, reduce_dtype  # noqa: E402
from mpicoll.torch.engine.fusion import plan_buckets  # noqa: E402
from mpicoll.torch.engine.negotiation import (JOIN, SHUTDOWN, Meta, Negotiator,  # noqa: E402
                                       shutdown_message)
from mpicoll.torch.engine.settings import from_environment  # noqa: E402


def ar(name, shape=(4,), dtype="float32", op=0, pre=1.0, post=1.0):
    return Meta(name, "allreduce", dtype, shape, op, -1, pre, post)


def test_entries_complete_when_every_rank_submitted_in_shared_order():
    neg = Negotiator(3)
    out = neg.process([[ar("a"), ar("b")], [ar("b")], []], [False] * 3)
    assert out == [] and neg.busy()
    out = neg.process([[], [ar("a")], [ar("b"), ar("a")]], [False] * 3)
    # order of first appearance in the shared table: a (rank 0, round 1), then b
    assert [r.name for r in out] == ["a", "b"]
    assert all(r.error is None for r in out) and not neg.busy()


def test_mismatch_is_an_error_response_naming_ranks():
    neg = Negotiator(2)
    out = neg.process([[ar("x", shape=(3,))], [ar("x", shape=(4,))]], [False, False])
    assert len(out) == 1 and "shape" in out[0].error and "ranks 0 have (3,)" in out[0].error
    out = neg.process([[ar("y", dtype="float32")],
                       [Meta("y", "broadcast", "float32", (4,), -1, 0)]], [False, False])
    assert "kind" in out[0].error


def test_join_counts_joined_ranks_as_submitted_and_reports_last():
    neg = Negotiator(3)
    neg.process([[Meta(JOIN, "join")], [], []], [True, False, False])
    out = neg.process([[], [ar("g")], [ar("g")]], [True, False, False])
    assert [r.name for r in out] == ["g"] and out[0].error is None
    out = neg.process([[], [Meta(JOIN, "join")], []], [True, True, False])
    assert out == []
    out = neg.process([[], [], [Meta(JOIN, "join")]], [True, True, True])
    assert out[-1].kind == "join" and out[-1].last_joined == 2 and not neg.busy()


def test_one_rank_shutting_down_ends_the_round_for_everyone():
    # As in Horovod, one rank's shutdown is enough: the round runs what completed in it,
    # then ends with one shutdown response; what is still incomplete is dropped (the
    # engines fail it locally with shutdown_message).
    neg = Negotiator(3)
    assert neg.process([[ar("x")], [], []], [True, False, False]) == []
    leaving = Meta(SHUTDOWN, "shutdown", reason="its process is exiting")
    out = neg.process([[ar("y")], [leaving, ar("y")], [ar("y")]], [True, False, False])
    assert [(r.kind, r.error) for r in out] == [("allreduce", None), ("shutdown", None)]
    assert list(out[1].metas) == [1] and not neg.busy()
    message = shutdown_message(out[1].metas, 0)
    assert "rank 1 (its process is exiting)" in message and "has been shut down" in message
    assert "by this rank (" in shutdown_message(out[1].metas, 1)


def test_shutdown_message_names_every_leaving_rank():
    both = {0: Meta(SHUTDOWN, "shutdown"), 2: Meta(SHUTDOWN, "shutdown", reason="r2")}
    assert "rank 0 (it called hvd.shutdown()); rank 2 (r2)" in shutdown_message(both, 1)


def test_deadlock_fails_every_incomplete_entry():
    neg = Negotiator(2)
    assert neg.process([[ar("a")], [ar("b")]], [False, False]) == []
    # nobody blocked yet: no verdict
    assert neg.process([[], []], [True, False]) == []
    out = neg.process([[], []], [True, True])
    assert out[0].kind == "realign" and out[0].error is None   # first: see test below
    out = out[1:]
    assert sorted(r.name for r in out) == ["a", "b"]
    assert all("can never complete" in r.error for r in out)
    assert "not by ranks 1" in out[0].error and not neg.busy()



def test_a_deadlock_with_joined_ranks_fails_their_join_too():
    """Rank 0 joined, ranks 1 and 2 wait on different names: both entries and the join
    fail, the join's error naming the joined rank."""
    neg = Negotiator(3)
    out = neg.process([[Meta(JOIN, "join")], [ar("a")], [ar("b")]], [True, True, True])
    assert [r.name for r in out[1:3]] == ["a", "b"]
    assert "submitted by ranks 1 but not by ranks 2" in out[1].error
    assert out[-1].kind == "join" and out[-1].error.startswith(
        "join() can never complete: ranks 0 joined") and not neg.busy()


def test_a_name_submitted_twice_by_one_rank_is_an_error_naming_it():
    neg = Negotiator(2)
    out = neg.process([[ar("a")], [ar("a"), ar("a")]], [False, False])
    assert [(r.name, r.error) for r in out] == [
        ("a", "allreduce 'a': rank 1 submitted this name twice"), ("a", None)]


def test_an_allgather_of_scalars_is_refused_on_every_rank():
    neg = Negotiator(2)
    scalar = Meta("g", "allgather", "float32", ())
    out = neg.process([[scalar], [scalar]], [False, False])
    assert out[0].error == "allgather 'g': tensors must have at least one dimension"

def test_deadlock_of_diverged_unnamed_numbering_says_so_and_realigns_first():
    # rank 0 skipped allreduce.noname.4: ranks 0 and 1 wait on different numbers
    neg = Negotiator(3)
    out = neg.process([[ar("allreduce.noname.5")], [ar("allreduce.noname.4")],
                       [ar("allreduce.noname.4"), ar("named")]], [True, True, True])
    assert [r.kind for r in out][0] == "realign"
    errors = {r.name: r.error for r in out[1:]}
    assert "numbering of unnamed allreduce operations diverged" in \
        errors["allreduce.noname.5"]
    assert "allreduce.noname.4 by ranks 1,2; allreduce.noname.5 by ranks 0" in \
        errors["allreduce.noname.4"]
    assert "numbering" not in errors["named"]              # a named request: no verdict
    # one unnamed number only (one rank did one more operation): no divergence message
    neg = Negotiator(2)
    out = neg.process([[ar("allgather.noname.2")], [ar("other")]], [True, True])
    assert all("numbering" not in r.error for r in out[1:])


def test_joined_ranks_refuse_gathers_at_once_whatever_their_names():
    neg = Negotiator(3)
    gather = Meta("allgather.noname.3", "allgather", "float32", (2, 1))
    assert neg.process([[Meta(JOIN, "join")], [gather], []], [True, True, False]) != []
    out = neg.process([[], [], [gather._replace(name="allgather.noname.2")]],
                      [True, True, True])
    assert [(r.name, list(r.metas)) for r in out] == [("allgather.noname.2", [2])]
    assert "not supported with join" in out[0].error
    # a group with an all-gather member too; all-reduces still wait for their names
    group = Meta("g", "group", members=(gather._replace(name="g.0"),))
    out = neg.process([[], [group, ar("r")], [ar("r")]], [True, True, True])
    assert [(r.name, r.error is None) for r in out] == [("g", False), ("r", True)]


def test_stall_inspector_names_missing_ranks():
    neg = Negotiator(3)
    neg.process([[ar("a")], [ar("a")], []], [False] * 3, now=0.0)
    assert neg.stalled(now=10.0, after=60.0) == []
    assert neg.stalled(now=61.0, after=60.0) == [("a", [0, 1], [2])]
    assert neg.stalled(now=62.0, after=60.0) == []          # warned once per period


def test_fusion_buckets_respect_threshold_and_key():
    def resp(meta):
        from mpicoll.torch.engine.negotiation import Response
        return Response("allreduce", meta.name, {0: meta})
    rs = [resp(ar("a", (10,))), resp(ar("b", (10,))), resp(ar("c", (10,), dtype="float64")),
          resp(ar("d", (30,))), resp(ar("e", (10,), dtype="bfloat16"))]
    buckets = plan_buckets(rs, threshold=80)
    names = [[r.name for r in b] for b in buckets]
    # float32 and bfloat16 (reduced as float32) share buckets; 80 bytes = 20 floats
    assert names == [["a", "b"], ["d"], ["e"], ["c"]]
    assert [[r.name for r in b] for b in plan_buckets(rs, 10 ** 9)] == [["a", "b", "d", "e"],
                                                                        ["c"]]


def test_ops_resolution():
    assert ops.resolve_reduce_op() is not None and int(ops.resolve_reduce_op()) == int(ops.Average)
    assert int(ops.resolve_reduce_op(average=False)) == int(ops.Sum)
    assert repr(ops.Max) == "Max"
    with pytest.raises(ValueError, match="not both"):
        ops.resolve_reduce_op(average=True, op=ops.Sum)
    with pytest.raises(ValueError):
        ops.resolve_reduce_op(op=17)
    with pytest.raises(TypeError):
        ops.check_op_dtype(ops.Sum, torch.bool, 1.0, 1.0)


def test_dtype_views_are_zero_copy_and_bfloat16_moves_as_int16():
    t = torch.arange(6, dtype=torch.bfloat16)
    view = numpy_view(t)
    assert view.dtype.name == "int16" and view.ctypes.data == t.data_ptr()
    assert reduce_dtype(torch.bfloat16) is torch.float32
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_supported([1])


def test_fp16_compression_round_trip():
    t = torch.tensor([1.5, -2.25], dtype=torch.float64)
    c, ctx = Compression.fp16.compress(t)
    assert c.dtype is torch.float16
    assert torch.equal(Compression.fp16.decompress(c, ctx), t)
    i = torch.tensor([1, 2])
    assert Compression.fp16.compress(i)[0] is i
    assert Compression.none.compress(t)[0] is t


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("MPICOLL_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("MPICOLL_CYCLE_TIME_MS", "2")
    monkeypatch.setenv("MPICOLL_STALL_CHECK_TIME_SECONDS", "5")
    s = from_environment()
    assert (s.fusion_threshold, s.cycle_time, s.stall_check_time) == (1024, 0.002, 5.0)
    monkeypatch.setenv("MPICOLL_ALLREDUCE_ALGORITHM", "nonsense")
    with pytest.raises(ValueError, match="MPICOLL_ALLREDUCE_ALGORITHM"):
        from_environment()


def test_response_cache_learns_repeated_rounds_identically():
    from mpicoll.torch.engine.negotiation import ResponseCache

    neg, cache = Negotiator(2), ResponseCache(capacity=2)
    step = [ar("g.a"), ar("g.b", shape=(2,))]
    assert cache.lookup(step) == 0
    out = neg.process([step, list(step)], [True, True])
    cache.learn([step, list(step)], out, True, not neg.busy())
    assert cache.lookup(step) == 1 and cache.metas(1) == step
    assert [r.name for r in cache.responses(1)] == ["g.a", "g.b"]
    # not learned: ranks differ, an error, a pending table, joins
    other = [ar("h")]
    out = neg.process([other, []], [False, False])
    cache.learn([other, []], out, True, not neg.busy())
    out = neg.process([[], other], [False, False])
    cache.learn([[], other], out, False, not neg.busy())
    assert cache.lookup(other) == 0
    bad = [[ar("x", shape=(3,))], [ar("x", shape=(4,))]]
    cache.learn(bad, neg.process(bad, [False, False]), True, True)
    assert cache.lookup(bad[0]) == 0
    joins = [[Meta(JOIN, "join")], [Meta(JOIN, "join")]]
    cache.learn(joins, neg.process(joins, [True, True]), True, True)
    assert cache.lookup(joins[0]) == 0
    # full: emptied, then learns afresh (the same on every rank)
    for name in ("c1", "c2"):
        cache.learn([[ar(name)]] * 2, neg.process([[ar(name)]] * 2, [False] * 2), True, True)
    assert cache.lookup([ar("c2")]) == 1 and cache.lookup(step) == 0


def test_distributed_optimizer_backend_argument_errors():
    """Bad backend choices fail before any communication, with the reason."""
    from mpicoll.torch import DistributedOptimizer  # noqa: PLC0415

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backend must be"):
        DistributedOptimizer(opt, backend="nccl")
    with pytest.raises(TypeError, match="need backend='ps'"):
        DistributedOptimizer(opt, num_servers=1)
    with pytest.raises(ValueError, match="backend='allreduce'"):
        DistributedOptimizer(opt, backend="ps", backward_passes_per_step=2)
    with pytest.raises(ValueError, match="must be unique"):
        DistributedOptimizer(opt, named_parameters=[("w", p) for p in model.parameters()],
                             backend="ps")


def test_argument_errors_travel_and_fail_every_rank_naming_the_rank():
    from mpicoll.errors import RemoteError
    from mpicoll.torch.engine.execute import response_error

    neg = Negotiator(3)
    good = Meta("x", "alltoall", "float32", (4, 2), splits=(2, 1, 1))
    bad = good._replace(splits=(9, 0, 0), error="splits sum to 9")
    out = neg.process([[good], [bad], [good]], [False] * 3)
    assert len(out) == 1 and out[0].bad_ranks == (1,)
    assert out[0].error == "alltoall 'x': rank 1: splits sum to 9"
    assert type(response_error(1, out[0])) is ValueError
    remote = response_error(0, out[0])
    assert isinstance(remote, RemoteError) and remote.errors == {1: "splits sum to 9"}
    assert str(remote) == str(response_error(1, out[0]))


def test_collectives_but_allreduce_refuse_joined_ranks_and_check_fields():
    for kind in ("alltoall", "reducescatter", "allgather", "broadcast"):
        neg = Negotiator(2)
        neg.process([[Meta(JOIN, "join")], []], [False, False])
        out = neg.process([[], [Meta("y", kind, "int64", (2, 3))]], [False, False])
        assert "not supported with join()" in out[0].error, kind
    neg = Negotiator(2)
    out = neg.process([[Meta("z", "alltoall", "int64", (2, 3))],
                       [Meta("z", "alltoall", "int64", (5, 4))]], [False, False])
    assert "rows" in out[0].error and "disagree" in out[0].error
    out = neg.process([[Meta("w", "reducescatter", "float32", (5,), 0)],
                       [Meta("w", "reducescatter", "float32", (5,), 1)]], [False, False])
    assert "op" in out[0].error


def test_reducescatter_rows_follow_horovods_rule():
    from mpicoll.torch.engine.execute import reducescatter_rows

    assert reducescatter_rows(7, 3) == [3, 2, 2]
    assert reducescatter_rows(2, 4) == [1, 1, 0, 0]
    assert reducescatter_rows(8, 4) == [2, 2, 2, 2]


def test_a_group_is_one_entry_that_completes_or_fails_whole():
    def group(name, *shapes):
        return Meta(name, "group", members=tuple(ar(f"{name}.{i}", shape=s)
                                                 for i, s in enumerate(shapes)))

    neg = Negotiator(2)
    assert neg.process([[group("g", (2,), (3,))], []], [False, False]) == []
    out = neg.process([[], [group("g", (2,), (3,))]], [False, False])
    assert [(r.kind, r.name, r.error) for r in out] == [("group", "g", None)]
    out = neg.process([[group("h", (2,), (3,))], [group("h", (2,), (4,))]], [False, False])
    assert out[0].error.startswith("group 'h': member 1: allreduce 'h.1': ranks disagree")
    out = neg.process([[group("k", (2,))], [group("k", (2,), (3,))]], [False, False])
    assert "members: ranks 0 have 1; ranks 1 have 2" in out[0].error


def test_group_future_is_done_when_every_member_is():
    from mpicoll.torch.engine.handles import Future, GroupFuture

    a, b = Future(), Future()
    group = GroupFuture([a, b])
    a.set_result(1)
    assert not group.done() and not group.wait(0.01)
    b.set_error(ValueError("x"))
    assert group.done() and isinstance(group.error, ValueError) and group.result == [1, None]


def test_a_group_and_a_plain_request_of_one_name_fail_every_member():
    from mpicoll.torch.engine.execute import run_responses

    class FakeEngine:
        rank, size, comm, local = 1, 2, None, {}
        settings = from_environment()

        def __init__(self):
            self.finished = {}

        def finish(self, key, result=None, error=None, extra=None):
            self.finished[key] = error

    group = Meta("g", "group", members=(ar("g.0"), ar("g.1")))
    neg = Negotiator(2)
    out = neg.process([[ar("g")], [group]], [False, False])
    assert "kind" in out[0].error
    engine = FakeEngine()
    run_responses(engine, out)
    assert set(engine.finished) == {"g", "g.0", "g.1"}
    assert all("kind" in str(e) for e in engine.finished.values())


def test_horovod_internal_error_catches_only_what_elastic_recovers_from():
    """``except hvd.HorovodInternalError`` (what ``hvd.elastic.run`` recovers from) catches a
    lost rank, and lets mismatches, another rank's bad input, too few ranks and another
    rank's shutdown through (issue 32: it was CollectiveError, which catches them all)."""
    import mpicoll.torch as hvd
    from mpicoll import errors

    def caught(error: BaseException) -> bool:
        try:
            raise error
        except hvd.HorovodInternalError:
            return True
        except Exception:  # noqa: BLE001
            return False

    assert hvd.elastic.HorovodInternalError is hvd.HorovodInternalError
    assert caught(errors.ProcessFailedError("rank 2 failed", [2]))
    for error in (errors.MismatchError("ranks disagree on the shape"),
                  errors.RemoteError("rank 1's tensor is not contiguous", {1: "no"}),
                  errors.TooFewRanksError("1 rank left", 1, 2, [1, 2]),
                  errors.CollectiveError("mpicoll.torch has been shut down by rank 1"),
                  ValueError("bad argument")):
        assert not caught(error), type(error).__name__


def test_a_failing_shutdown_at_exit_is_logged_not_raised(monkeypatch, caplog):
    """The exit handler has nobody to raise to: a failing shutdown becomes a warning."""
    from mpicoll.torch import state

    def broken(reason: str) -> None:
        raise RuntimeError(f"cannot stop ({reason[:10]})")

    monkeypatch.setattr(state, "_stop", broken)
    with caplog.at_level("WARNING", logger="mpicoll.torch"):
        state._shutdown_at_exit()
    assert "shutdown at exit failed: cannot stop (its proces)" in caplog.text


def test_env_handler_falls_back_to_torchs_and_refuses_a_re_rendezvous(monkeypatch):
    """torch's ``env://`` handler answers where no MPI launcher started the process, or
    ``RANK`` is set; under one without ``RANK`` the MPI rendezvous answers once and a
    second rendezvous is refused (as torch's handlers refuse one)."""
    from mpicoll.torch.distributed import startup

    def torchs(url, **kwargs):
        yield ("torch's store", url, kwargs["timeout"])

    monkeypatch.setattr(startup, "_torch_env_handler", torchs)
    monkeypatch.setattr(startup, "mpi_rendezvous", lambda timeout: ("mpi store", 0, 1))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(startup, "in_mpi_launch", lambda: False)
    assert list(startup._env_handler("env://", timeout=5)) == [("torch's store", "env://", 5)]
    monkeypatch.setattr(startup, "in_mpi_launch", lambda: True)
    handler = startup._env_handler("env://")
    assert next(handler) == ("mpi store", 0, 1)
    with pytest.raises(RuntimeError, match="unable to perform re-rendezvous using the MPI"):
        next(handler)
    monkeypatch.setenv("RANK", "0")
    assert next(startup._env_handler("env://", timeout=7)) == ("torch's store", "env://", 7)


def test_answer_joiners_refuses_a_group_started_without_the_mpi_rendezvous(monkeypatch):
    """A grown world's new processes reach the default group's store only through the MPI
    rendezvous: with torchrun's or the user's own store, the running ranks refuse."""
    from mpicoll.torch.distributed import startup

    monkeypatch.setattr(startup, "_served", [])
    with pytest.raises(RuntimeError, match="not started through mpicoll's MPI rendezvous"):
        startup.answer_joiners(object())


def _elastic_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def test_torch_state_serialize_round_trips_the_last_commit():
    """TorchState's bytes (the relaunching supervisor's disk copy) carry the last commit of
    the model, the optimizer and the plain objects, not what changed since; deserialize
    then restore brings them into another state's objects."""
    from mpicoll.torch.elastic import TorchState

    model = _elastic_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()                                           # momentum buffers in the state
    state = TorchState(model=model, optimizer=opt, epoch=3)
    state.save()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    with torch.no_grad():
        model.weight.add_(5.0)                           # after the commit: not in it
    state.epoch = 9
    payload = state.serialize()

    other_model = _elastic_model(1)
    other_opt = torch.optim.SGD(other_model.parameters(), lr=0.1, momentum=0.9)
    other = TorchState(model=other_model, optimizer=other_opt, epoch=0)
    other.deserialize(payload)
    other.restore()
    for name, tensor in other_model.state_dict().items():
        assert torch.equal(tensor, committed[name]), name
    assert torch.equal(other_opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert other.epoch == 3


def test_torch_state_assigning_a_new_model_commits_it():
    """``state.model = other`` (Horovod's): the handler holds ``other`` and commits it at
    once, so a restore goes back to ``other`` as it was assigned."""
    from mpicoll.torch.elastic import TorchState

    state = TorchState(model=_elastic_model(0), epoch=0)
    other = _elastic_model(1)
    assigned = other.weight.detach().clone()
    state.model = other
    assert state.model is other
    with torch.no_grad():
        other.weight.zero_()
    state.restore()
    assert torch.equal(other.weight, assigned)
