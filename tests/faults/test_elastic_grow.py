"""Growing back (Horovod's "hosts added"): new ranks join a running job under Open MPI.

In one process (any MPI): the discovery source's answers (slots from a script, a
callable's int, lines or garbage), rank 0's verdict (grow up to ``max_np``, never shrink,
never retry a target that could not start), and a first poll that fails ending ``run``
with ``DiscoveryError`` before the function runs.

Under ``mpirun --with-ft ulfm`` (elastic_grow_worker.py, numpy):

- ``numpy-grow`` (one job, to spend little CI time): a job of 2 whose discovery script
  starts reporting 3 slots grows to 3: every rank raises HostsUpdatedInterrupt at the same
  commit, the new rank enters the elastic function with the committed state bitwise (the
  same digest as the commit the old ranks made), every later all-reduce on the grown world
  gives the exact sum for 3 ranks (checked in the worker at every step), and the state
  counts exactly ``g * 2 + (s - g) * 3`` rank-steps (``g``: the commit that grew). Then
  the script prints garbage: after three failed polls every rank, the new one included,
  raises DiscoveryError at the same commit ``s``, with the same state, and the job ends
  (status 4): no hang.

Under this venv's MPICH (no ULFM; its ``MPI_Comm_spawn`` starts processes faster), as well
as ``mpich-grow`` (the numpy growth):

- ``ddp-grow-ddp``, ``ddp-grow-module``: a DDP module over the "mpicoll" process group,
  built once before ``hvd.elastic.run`` with a ``TorchState`` holding it and no
  ``hvd.init()`` (or holding the module it wraps, with ``hvd.init()`` after
  ``init_process_group``: the new process's order, which hung), grows from 2 to 3 at a
  commit (ddp_elastic_worker.py ``grow``): the new process builds its DDP module in the
  program as the first ranks did, every rank ends at size 3 with the same parameters,
  ``dist.all_reduce`` sums over 3, and rank 0's parameters equal a float64 single-process
  reference (2 ranks' mean gradient up to that commit, 3 ranks' after it) within 1e-9,
  while one that kept dividing by 2 is far off.

- ``twice-grow``: a job of 1 that grows to 2, then to 3 (a callable discovery): every
  all-reduce exact at every size, every rank done at 3 with the same step, and the job
  ends with status 0 (the process the first growth started, holding two growths'
  intercommunicators, crashed in ``MPI_Finalize``: status 1);
- ``kill-joiner``: 2 ranks grow to 3 and the new one is SIGKILLed: the survivors shrink
  and finish with exact sums, status 0 (launched with ``state_base_recoverable``, which
  makes the spawned jobs recoverable as ``--with-ft ulfm`` makes the launched one).

Under MPICH, one job each (``_run_script``): hvd growing twice (its engine's shutdown is
immediate), local SGD growing with the job, a parameter server refusing growth on every
rank, a job launched below ``min_np`` waiting for the slots (or ``TooFewRanksError``), and
what a new process names by its rank: its timeline part, the stall inspector's reports, and
the ids of the process sets it registers.

With ``ULFM_ALL_CASES=1`` (slower: a torch job here costs one to two minutes under load):

- ``numpy-shrink-grow``: 3 ranks, one SIGKILLed, the 2 survivors shrink, then grow back
  to 3 (discovery still reports 3 slots); exact sums and totals, identical state;
- ``torch-grow``: ``hvd.elastic`` (TorchState, DistributedOptimizer, ElasticSampler and a
  callable discovery) grows from 2 to 3: the committed parameters, optimizer state and
  sampler state reach the new rank bitwise, the sampler re-splits into 3, an
  ``hvd.allreduce`` on the grown world is exact, training finishes with identical
  parameters on the 3 ranks and an accuracy within 2 points of uninterrupted training.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

import mpicoll.elastic as elastic
import ompi_env
import ulfm_jobs
from mpi_launcher import mpirun_command, run_command
from mpicoll.elastic import discovery
from mpicoll.elastic.grow import split_command_line
from mpicoll.elastic.joiner import run_program

HERE = Path(__file__).parent
NUMPY = HERE / "elastic_grow_worker.py"
TORCH = HERE / "elastic_grow_torch_worker.py"
DDP = HERE / "ddp_elastic_worker.py"
#: What the DDP growth jobs' state holds: the DDP module, or the module it wraps.
HOLDS = ("ddp", "module")
JOB_TIMEOUT_S = 180
STEPS, GROW_STEP, GARBAGE_STEP = 30, 10, 20
EPOCHS, TORCH_GROW_STEP = 2, 10
ALL = os.environ.get("ULFM_ALL_CASES") == "1"


# ----- in one process -------------------------------------------------------------------
def test_a_source_answers_slots_from_a_script_a_number_or_lines(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\nnode1:2\nnode2\n\nnode3:3\n")
    assert discovery.Discovery(f"cat {hosts}").poll() == 6
    assert discovery.Discovery(lambda: 5).poll() == 5
    assert discovery.Discovery(lambda: "a:2\nb:2").poll() == 4
    assert discovery.Discovery(lambda: ["a:1", "b"]).poll() == 2


@pytest.mark.parametrize("answer, match", [
    (lambda: "no such line!", "is not 'hostname'"),
    (lambda: None, "not a number of slots"),
    (lambda: -1, "-1 slots"),
    (lambda: 1 / 0, "raised ZeroDivisionError"),
    ("false", "exited with 1"),
    ("/no/such/discovery-script", "cannot run"),
])
def test_a_failing_source_is_a_discovery_error(answer, match) -> None:
    with pytest.raises(elastic.DiscoveryError, match=match):
        discovery.Discovery(answer).poll()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        discovery.Discovery(3)
    with pytest.raises(ValueError, match="max_np"):
        discovery.Discovery(lambda: 2, max_np=0)
    with pytest.raises(ValueError, match="interval"):
        elastic.run(discovery=lambda: 2, discovery_interval=-1)


def test_rank0_verdict_grows_up_to_max_np_only() -> None:
    slots = {"n": 2}
    source = discovery.Discovery(lambda: slots["n"], max_np=4)
    source.poll_now()
    assert source.verdict(2)[0] == discovery._NOTHING
    slots["n"] = 8
    source.poll_now()
    kind, target, _, _ = source.verdict(2)
    assert (kind, target) == (discovery._GROW, 4)           # capped by max_np
    assert source.verdict(2, first=True)[0] == discovery._NOTHING   # the first only checks
    source.failed_target = 4                                # could not start: not again
    assert source.verdict(2)[0] == discovery._NOTHING
    slots["n"] = 3
    source.poll_now()
    assert source.verdict(2)[:2] == (discovery._GROW, 3)    # a new answer: try again
    source.refuse(3)                                        # failed at 3 slots ...
    assert source.verdict(2)[0] == discovery._NOTHING
    slots["n"] = 9                                          # ... and 9 are offered: the
    source.poll_now()                                       # same target, a new answer
    assert source.verdict(2)[:2] == (discovery._GROW, 4)
    source.refuse(4)
    slots["n"] = 10
    source.poll_now()
    assert source.verdict(2)[:2] == (discovery._GROW, 4)    # (it stopped at 3 before)
    slots["n"] = 1
    source.poll_now()
    assert source.verdict(2)[0] == discovery._NOTHING       # fewer slots: no shrink


def test_a_refused_target_is_asked_again_after_longer_and_longer_waits(monkeypatch) -> None:
    """A target the ranks refused is not grown to again until asked (``_ASK``: every
    rank says whether it still refuses) after ``interval``, then twice as long each time
    (at most ``MAX_ASK_S``); a new answer grows."""
    now = [100.0]
    monkeypatch.setattr(discovery.time, "monotonic", lambda: now[0])
    slots = {"n": 3}
    source = discovery.Discovery(lambda: slots["n"], max_np=4, interval=1.0)
    source.poll_now()
    source.refuse(3, refused=True)
    asked = []
    for _ in range(250):        # 125 s in steps of 0.5 s (the cap: 60 s)
        now[0] += 0.5
        asked += [now[0] - 100] if source.verdict(2)[:2] == (discovery._ASK, 3) else []
    assert asked == [1.0, 3.0, 7.0, 15.0, 31.0, 63.0, 123.0]
    assert source.verdict(3)[0] == discovery._NOTHING      # at the size: nothing to ask
    slots["n"] = 4
    source.poll_now()
    assert source.verdict(2)[:2] == (discovery._GROW, 4)
    assert source.refused_at is None
    source.refuse(4)                                        # could not start: not asked
    now[0] += 100
    assert source.verdict(2)[0] == discovery._NOTHING


def test_later_failures_end_the_job_only_after_several_in_a_row() -> None:
    answers = iter([3, "bad!", "bad!", 3, "bad!", "bad!", "bad!"])
    source = discovery.Discovery(lambda: next(answers), max_np=3)
    verdicts = []
    for _ in range(7):
        source.poll_now()
        verdicts.append(source.verdict(2)[0])
    assert verdicts == [discovery._GROW, discovery._GROW, discovery._GROW, discovery._GROW,
                        discovery._GROW, discovery._GROW, discovery._ERROR]


def test_max_np_defaults_to_the_launch_size_and_the_environment(monkeypatch) -> None:
    from mpi4py import MPI  # noqa: PLC0415

    monkeypatch.delenv(discovery.ENV_DISCOVERY, raising=False)
    monkeypatch.delenv(discovery.ENV_MAX_NP, raising=False)
    assert discovery.configure() is None
    assert discovery.configure(lambda: 2).limit() == MPI.COMM_WORLD.Get_size()
    monkeypatch.setenv(discovery.ENV_DISCOVERY, "echo localhost:4")
    monkeypatch.setenv(discovery.ENV_MAX_NP, "3")
    source = discovery.configure()
    assert source.poll() == 4 and source.limit() == 3
    monkeypatch.setenv(discovery.ENV_MAX_NP, "three")
    with pytest.raises(ValueError, match="MPICOLL_ELASTIC_MAX_NP"):
        discovery.configure()


def test_a_first_poll_that_fails_stops_run_before_the_function() -> None:
    calls = []

    @elastic.run(discovery="false")
    def train(state: elastic.ObjectState) -> None:
        calls.append(1)

    with pytest.raises(elastic.DiscoveryError, match="exited with 1"):
        train(elastic.ObjectState(x=1))
    assert calls == [] and discovery.active() is None


def test_commits_check_only_while_the_function_runs() -> None:
    polls = []

    @elastic.run(discovery=lambda: polls.append(1) or 1, discovery_interval=60)
    def train(state: elastic.ObjectState) -> int:
        assert discovery.active() is not None
        state.x += 1
        state.commit()                       # a check: nothing new (1 slot, 1 rank)
        return state.x

    assert train(elastic.ObjectState(x=1)) == 2
    assert discovery.active() is None and polls == [1]


def test_more_bad_sources_are_refused() -> None:
    """An empty command; a callable answering neither a number nor lines, or raising a
    DiscoveryError of its own (kept as it is)."""
    with pytest.raises(ValueError, match="not an empty string"):
        discovery.Discovery("  ")
    with pytest.raises(elastic.DiscoveryError, match="returned a float, not a number"):
        discovery.Discovery(lambda: 2.5).poll()
    own = elastic.DiscoveryError("the cluster API is down")

    def failing() -> int:
        raise own

    with pytest.raises(elastic.DiscoveryError) as exc:
        discovery.Discovery(failing).poll()
    assert exc.value is own


def test_a_poll_that_ends_after_stop_is_not_recorded() -> None:
    """The poller drops the answer of a poll during which it was stopped."""
    stop = threading.Event()

    def source() -> int:
        stop.set()
        return 5

    poller = discovery.Discovery(source, interval=0)
    poller._loop(stop)
    assert poller._poll.latest()[0] is None


def test_growth_and_joining_refuse_what_cannot_work(monkeypatch) -> None:
    """No program to start (interactive or stdin), a size that does not grow, a joiner
    not spawned by a job, an empty program: each a clear error."""
    from mpicoll.elastic import grow

    monkeypatch.setattr(grow, "_program", ([], ["-"]))
    with pytest.raises(grow.GrowthError, match="runs no script or module"):
        grow.spawn_command()
    with pytest.raises(ValueError, match="new_size 1 must exceed the world's size 1"):
        grow.grow_world(1)
    with pytest.raises(RuntimeError, match="this one has no parent job"):
        grow.join([], ["train.py"])
    with pytest.raises(ValueError, match="no program to run"):
        run_program([])


def test_shrinking_needs_ulfm() -> None:
    """``shrink_world`` without ULFM: RuntimeError naming how to launch with it."""
    from mpicoll.elastic import shrink

    with pytest.raises(RuntimeError, match="needs ULFM.*--with-ft ulfm"):
        shrink.shrink_world(1)


@pytest.mark.parametrize("argv, options, program", [
    (["train.py", "-x", "1"], [], ["train.py", "-x", "1"]),
    (["-u", "-X", "dev", "-W", "error", "t.py"], ["-u", "-X", "dev", "-W", "error"], ["t.py"]),
    (["-uXdev", "t.py", "-m"], ["-uXdev"], ["t.py", "-m"]),
    (["-u", "-m", "pkg.mod", "--a"], ["-u"], ["-m", "pkg.mod", "--a"]),
    (["-um", "pkg", "a"], ["-u"], ["-m", "pkg", "a"]),
    (["-c", "print(1)", "a"], [], ["-c", "print(1)", "a"]),
    (["--check-hash-based-pycs", "never", "-B", "t.py"],
     ["--check-hash-based-pycs", "never", "-B"], ["t.py"]),
    (["-i"], ["-i"], []),
    (["--unknown-long", "t.py"], ["--unknown-long"], ["t.py"]),
])
def test_command_lines_split_into_options_and_program(argv, options, program) -> None:
    assert split_command_line(argv) == (options, program)


def test_the_joiner_runs_a_script_a_module_or_code_as_main(tmp_path, monkeypatch) -> None:
    script = tmp_path / "prog.py"
    script.write_text("import sys\nif __name__ == '__main__':\n"
                      "    sys.modules['grow_probe'].seen.append((sys.argv[1:], sys.path[0]))\n")
    probe = type(sys)("grow_probe")
    probe.seen = []
    monkeypatch.setitem(sys.modules, "grow_probe", probe)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    run_program([str(script), "a", "b"])
    assert probe.seen == [(["a", "b"], str(tmp_path))]
    sys.path.insert(0, str(tmp_path))       # the patched copy: undone with it
    run_program(["-m", "prog", "c"])
    run_program(["-c", "import sys, grow_probe; grow_probe.seen.append((sys.argv, __name__))",
                 "d"])
    assert probe.seen[1][0] == ["c"] and probe.seen[2] == (["-c", "d"], "__main__")
    with pytest.raises(ValueError):
        run_program(["-"])


# ----- under mpirun --with-ft ulfm ------------------------------------------------------
GROW_JOB = """
import os, signal, sys, time, numpy as np, mpicoll, mpicoll.elastic as elastic
kill = sys.argv[1] == "kill"     # 2 ranks grow to 3, the new one dies, again 3; else 1 -> 2 -> 3
if sys.argv[1] == "raise" and elastic.joined():   # 2 ranks grow to 3 (slots stay 3)
    raise RuntimeError("a new process cannot run the program")
ps = None
if sys.argv[1] == "ps" and not elastic.joined():  # 2 ranks, a server closed at step 6
    from mpicoll.ps import ParameterServer
    ps = ParameterServer({"w": np.zeros(3)}, num_servers="colocated", lr=0.1)
state = elastic.ObjectState(step=0, phase=0)
def slots():
    if kill:
        return 3 if 4 <= state.step else 2
    if sys.argv[1] in ("raise", "ps"):
        return 2 if state.step < 4 else 3
    return 1 if state.step < 4 else (2 if state.step < 9 else 3)
@elastic.run(discovery=slots, max_np=3, discovery_interval=0.05)
def train(st):
    global ps
    while st.step < (16 if kill else 14):
        world = elastic.world()
        n, r = world.Get_size(), world.Get_rank()
        if ps is not None:
            ps.push_pull({"w": np.full(3, r + 1.0)})
            if st.step == 6:                # closed: the growth it refused may happen
                ps.close()
                ps.free()
                ps = None
        if kill and st.step == 8 and n == 3 and st.phase == 0 and elastic.joined():
            os.kill(os.getpid(), signal.SIGKILL)
        got = mpicoll.allreduce(np.full(5, r + 1.0))
        if not np.array_equal(got, np.full(5, n * (n + 1) / 2)):
            sys.stdout.write(f"BAD {r} {n} {st.step}\\n")
        if n == 2 and st.step >= 8:
            st.phase = 1
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
world = elastic.world()
sys.stdout.write(f"DONE {world.Get_rank()} {world.Get_size()} {state.step}\\n")
sys.stdout.flush()
"""


def _jobs(tmp: Path) -> dict:
    grow_job = tmp / "grow_job.py"
    grow_job.write_text(GROW_JOB)
    jobs = {
        # name: (script, n, args)
        "numpy-grow": (NUMPY, 2, [1000, GROW_STEP, 3, 3, "2", GARBAGE_STEP]),
        "twice-grow": (grow_job, 1, ["twice"]),
        "kill-joiner": (grow_job, 2, ["kill"]),
        "raise-joiner": (grow_job, 2, ["raise"]),
    }
    if ALL:
        jobs["numpy-shrink-grow"] = (NUMPY, 3, [STEPS, -1, 3, 3, "3", -1, 1, 8])
        jobs["torch-grow"] = (TORCH, 2, [EPOCHS, TORCH_GROW_STEP, 3, 3])
    out = {}
    for name, (script, n, args) in jobs.items():
        args = [str(a) for a in args]
        if script == NUMPY:                  # the host file, with the slots at the start
            hostfile = tmp / f"{name}.hosts"
            hostfile.write_text(f"localhost:{args[4]}\n")
            args[4] = str(hostfile)
        # (docs/elastic.md, Growing, Limits: the spawned jobs are recoverable too)
        extra = ({"PRTE_MCA_state_base_recoverable": "1"}
                 if name in ("kill-joiner", "raise-joiner") else {})
        out[name] = (script, n, args, extra, JOB_TIMEOUT_S)
    return out


def _mpich_job(tmp: Path, script: Path = NUMPY, hold: str = "") -> tuple[int, str, float]:
    """A growth from 2 to 3 under this venv's MPI (the MPICH wheel: no ULFM): the numpy
    worker's, or (``script`` DDP) a DDP module over "mpicoll" in ``hvd.elastic.run``, the
    state holding ``hold`` (``ddp`` or ``module``)."""
    if script == DDP:
        args = ["grow", hold]
    else:
        hostfile = tmp / "mpich.hosts"
        hostfile.write_text("localhost:2\n")
        args = [str(STEPS), str(GROW_STEP), "3", "3", str(hostfile), "-1"]
    cmd = mpirun_command(2) + [sys.executable, "-u", str(script), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPICOLL_")}
    env["PYTHONPATH"] = str(ompi_env.ROOT)
    rc, out, secs = run_command(cmd, env, JOB_TIMEOUT_S)
    return 124 if rc is None else rc, out, secs


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("grow")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        mpich = pool.submit(_mpich_job, tmp)
        ddp = {hold: pool.submit(_mpich_job, tmp, DDP, hold) for hold in HOLDS}
        python = ompi_env.ompi_python(need_torch=ALL)
        results = ulfm_jobs.run_jobs(python, _jobs(tmp), parallel=1)
        results["mpich-grow"] = mpich.result()
        results.update({f"ddp-grow-{hold}": job.result() for hold, job in ddp.items()})
    return results


def _show(name: str, result: tuple[int, str, float]) -> str:
    rc, out, secs = result
    tail = "\n".join(out.splitlines()[-30:])
    print(f"{name}: status {rc}, {secs:.1f} s\n{tail}")
    return tail


def _by_rank(out: str, tag: str) -> dict[int, list[str]]:
    return {int(f[0]): f[1:] for f in ulfm_jobs.lines(out, tag)}


def _check_growth(out: str, tail: str, old: int, new: int) -> int:
    """The growth from ``old`` to ``new`` ranks: one commit on every old rank raised the
    interrupt, and every rank entered the function again with that commit's state.
    Returns the step of that commit."""
    committed = [f for f in ulfm_jobs.lines(out, "COMMITTED") if int(f[1]) == old]
    assert len(committed) == old, f"old ranks interrupted: {committed}\n{tail}"
    assert len({(f[2], f[3]) for f in committed}) == 1, f"commits differ\n{tail}"
    step, digest = committed[0][2], committed[0][3]
    # the function's entries at the new size after that commit (a job launched at the
    # new size also entered at step 0; a growth is at a step > 0)
    entered = [f for f in ulfm_jobs.lines(out, "ENTER") if int(f[1]) == new and f[2] != "0"]
    assert int(step) > 0, tail
    assert sorted(int(f[0]) for f in entered) == list(range(new)), tail
    assert {(f[2], f[3]) for f in entered} == {(step, digest)}, \
        f"a rank's state after growing is not the commit {step} {digest}\n{tail}"
    assert sorted(int(f[0]) for f in entered if f[4] == "1") == list(range(old, new)), tail
    return int(step)


@pytest.mark.timeout(900)
def test_numpy_job_grows_from_2_to_3_then_stops_on_garbage(outputs) -> None:
    rc, out, _ = outputs["numpy-grow"]
    tail = _show("numpy-grow", outputs["numpy-grow"])
    assert "BAD" not in out, f"a wrong all-reduce sum\n{tail}"
    grew_at = _check_growth(out, tail, 2, 3)
    assert len(ulfm_jobs.lines(out, "FIRST")) == 3, f"no step at 3 ranks\n{tail}"
    errors = _by_rank(out, "DISCOVERYERROR")
    assert sorted(errors) == [0, 1, 2], f"not every rank stopped on the error\n{tail}"
    assert len({tuple(f[:4]) for f in errors.values()}) == 1, f"ranks stopped apart\n{tail}"
    size, step, total, _, *words = errors[0]
    assert int(size) == 3 and int(step) > GARBAGE_STEP, tail
    assert int(total) == grew_at * 2 + (int(step) - grew_at) * 3, \
        f"total {total}: steps lost or repeated (grew at {grew_at})\n{tail}"
    assert "3 polls in a row" in " ".join(words) and "is not 'hostname'" in " ".join(words)
    assert rc == 4 and "DONE" not in out, f"status {rc} (124: a hang)\n{tail}"


def _check_finished_grown(name: str, outputs: dict, rank_steps: Callable[[int], int]) -> None:
    """Job ``name`` grew from 2 to 3 ranks and finished: exact sums, every rank done at 3
    ranks with the same state, and ``rank_steps(g)`` rank-steps (``g``: the commit that
    grew)."""
    rc, out, _ = outputs[name]
    tail = _show(name, outputs[name])
    assert rc == 0 and "BAD" not in out, f"status {rc}\n{tail}"
    grew_at = _check_growth(out, tail, 2, 3)
    done = _by_rank(out, "DONE")
    assert sorted(done) == [0, 1, 2], tail
    want = ("3", str(STEPS), str(rank_steps(grew_at)))
    assert {(f[0], f[1], f[2]) for f in done.values()} == {want}, tail
    assert len({f[3] for f in done.values()}) == 1, f"final states differ\n{tail}"


@pytest.mark.timeout(900)
def test_a_job_that_grows_twice_ends_with_status_0(outputs) -> None:
    rc, out, _ = outputs["twice-grow"]
    tail = _show("twice-grow", outputs["twice-grow"])
    assert "BAD" not in out, f"a wrong all-reduce sum\n{tail}"
    assert _by_rank(out, "DONE") == {r: ["3", "14"] for r in range(3)}, tail
    assert rc == 0, f"status {rc} (124: a hang)\n{tail}"


@pytest.mark.timeout(900)
def test_a_joined_rank_lost_under_ulfm_is_survived(outputs) -> None:
    """2 ranks grow to 3; the new one is SIGKILLed a few commits later; the 2 survivors
    shrink, grow back to 3 (discovery still offers 3 slots: a process lost after its
    growth settled is not a growth that could not work, which is not tried again) and
    finish with exact sums, and (launched with state_base_recoverable) the job ends with
    status 0 (without it prterun ends with 137: the spawned job is not recoverable)."""
    rc, out, _ = outputs["kill-joiner"]
    tail = _show("kill-joiner", outputs["kill-joiner"])
    assert "BAD" not in out, f"a wrong all-reduce sum\n{tail}"
    assert _by_rank(out, "DONE") == {r: ["3", "16"] for r in range(3)}, tail
    assert "does not grow to 3 again" not in out, tail
    assert rc == 0, f"status {rc}\n{tail}"


@pytest.mark.timeout(900)
def test_a_new_process_that_raises_before_the_sync_is_not_spawned_again(outputs) -> None:
    """2 ranks grow to 3 (discovery keeps offering 3 slots); the new process raises at the
    top of the program: the 2 survivors shrink back once and finish at 2 with exact
    sums; the job does not spawn it again and again (it did, until its steps ran out)."""
    rc, out, _ = outputs["raise-joiner"]
    tail = _show("raise-joiner", outputs["raise-joiner"])
    assert "BAD" not in out, f"a wrong all-reduce sum\n{tail}"
    assert _by_rank(out, "DONE") == {0: ["2", "14"], 1: ["2", "14"]}, tail
    assert out.count("cannot run the program") in (1, 2), tail   # (its error, once)
    assert out.count("does not grow to 3 again") == 2, tail      # (ranks 0 and 1)
    assert rc == 0, f"status {rc}\n{tail}"


@pytest.mark.timeout(900)
def test_numpy_job_grows_under_mpich_without_ulfm(outputs) -> None:
    _check_finished_grown("mpich-grow", outputs, lambda g: g * 2 + (STEPS - g) * 3)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not ALL, reason="set ULFM_ALL_CASES=1 (about 15 s more)")
def test_numpy_job_shrinks_then_grows_back(outputs) -> None:
    # 3 ranks to step 8, where one is killed; 2 ranks to the growth; then 3
    _check_finished_grown("numpy-shrink-grow", outputs,
                          lambda g: 8 * 3 + (g - 8) * 2 + (STEPS - g) * 3)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not ALL, reason="set ULFM_ALL_CASES=1 (one to two minutes more)")
def test_torch_job_grows_from_2_to_3(outputs) -> None:
    import elastic_torch_worker  # noqa: PLC0415  (imports torch)

    rc, out, _ = outputs["torch-grow"]
    tail = _show("torch-grow", outputs["torch-grow"])
    assert rc == 0, f"status {rc}\n{tail}"
    _check_growth(out, tail, 2, 3)
    entered = [f for f in ulfm_jobs.lines(out, "ENTER")]
    assert all(f[6] == "1" for f in entered), f"an hvd.allreduce was wrong\n{tail}"
    assert {f[5] for f in entered if f[1] == "3"} == {"3"}, f"sampler not re-split\n{tail}"
    done = _by_rank(out, "DONE")
    assert sorted(done) == [0, 1, 2] and {f[0] for f in done.values()} == {"3"}, tail
    assert len({f[3] for f in done.values()}) == 1, f"parameters differ\n{tail}"
    reference = elastic_torch_worker.train_serially(3, EPOCHS)
    got = float(done[0][2])
    assert abs(got - reference) <= 2.0, f"accuracy {got:.2f} %, uninterrupted {reference:.2f} %"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("hold", HOLDS)
def test_ddp_module_grows_from_2_to_3_under_mpich(outputs, hold) -> None:
    name = f"ddp-grow-{hold}"
    rc, out, _ = outputs[name]
    tail = _show(name, outputs[name])
    assert rc == 0, f"status {rc}\n{tail}"
    # hydra may join two ranks' lines: the records are found anywhere in the output
    done = {int(m[0]): m[1:] for m in re.findall(
        r"DONE (\d+) (\d+) ([0-9a-f]+) (\d+) (-?\d+)", out)}
    assert sorted(done) == [0, 1, 2], tail
    assert {f[0] for f in done.values()} == {"3"}, f"a rank is not at size 3\n{tail}"
    assert len({f[1] for f in done.values()}) == 1, f"parameters differ\n{tail}"
    assert {f[2] for f in done.values()} == {"3"}, f"all_reduce did not sum over 3\n{tail}"
    grew = {f[3] for r, f in done.items() if r < 2}
    assert len(grew) == 1 and int(grew.pop()) > 0, f"the old ranks did not grow\n{tail}"
    assert re.findall(r"JOINED (\d+)", out) == ["2"], tail
    (right, wrong), = [(float(a), float(b)) for a, b in re.findall(
        r"GROWREF (\S+) (\S+)", out)]
    assert right <= 1e-9 and wrong > 1e-3, f"reference differences {right}, {wrong}\n{tail}"


def _run_script(tmp_path: Path, text: str, n: int, *args: str,
                **env_extra: str) -> tuple[int | None, str, str]:
    """Run ``text`` as a script at ``n`` ranks under this venv's MPI (no ``MPICOLL_``
    variables but ``env_extra``): its status (``None``: a hang), output and last lines."""
    script = tmp_path / "job.py"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPICOLL_")}
    env.update(PYTHONPATH=str(ompi_env.ROOT), **env_extra)
    rc, out, _ = run_command(mpirun_command(n) + [sys.executable, "-u", str(script), *args],
                             env, JOB_TIMEOUT_S)
    return rc, out, "\n".join(out.splitlines()[-20:])


RESET_LIMIT_JOB = """
import sys, time, numpy as np, mpicoll, mpicoll.elastic as elastic
state = elastic.ObjectState(step=0)
@elastic.run(discovery=lambda: 1 if state.step < 3 else (2 if state.step < 8 else 3),
             max_np=3, reset_limit=1, discovery_interval=0.05)
def train(st):
    while st.step < 40:
        mpicoll.allreduce(np.ones(3)); st.step += 1; time.sleep(0.05); st.commit()
try:
    train(state)
except mpicoll.ResetLimitError:  # (one write: two ranks' lines never run together)
    sys.stdout.write(f"LIMIT {elastic.world().Get_rank()}\\n")
    sys.stdout.flush()
    raise SystemExit(1)
"""


@pytest.mark.timeout(300)
def test_reset_limit_stops_the_ranks_that_joined_too(tmp_path) -> None:
    """``reset_limit=1``, growths from 1 to 2 (the one reset allowed), then to 3: every
    rank, the one that joined included, raises ResetLimitError. Each process counted
    resets from its own start, so the joiner went on into the growth alone: a hang."""
    rc, out, tail = _run_script(tmp_path, RESET_LIMIT_JOB, 1)
    assert rc == 1, f"status {rc} (None: a hang)\n{tail}"
    assert sorted(int(f[0]) for f in ulfm_jobs.lines(out, "LIMIT")) == [0, 1], tail


TWICE_GROW_HVD_JOB = """
import sys, time, torch, mpicoll.torch as hvd
hvd.init()
state = hvd.elastic.ObjectState(step=0)
@hvd.elastic.run(discovery=lambda: 1 if state.step < 4 else (2 if state.step < 9 else 3),
                 max_np=3, discovery_interval=0.05)
def train(st):
    while st.step < 14:
        got = hvd.allreduce(torch.full((5,), hvd.rank() + 1.0), op=hvd.Sum)
        n = hvd.size()
        if not torch.equal(got, torch.full((5,), n * (n + 1) / 2)):
            sys.stdout.write(f"BAD {hvd.rank()} {n} {st.step}\\n")
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
sys.stdout.write(f"DONE {hvd.rank()} {hvd.size()} {state.step}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
def test_hvd_grows_twice_under_mpich_and_shuts_down_at_once(tmp_path) -> None:
    """hvd.elastic from 1 to 2 to 3 ranks under MPICH: exact sums at every size, and the
    engine's shutdown does not wait: its notices were received from MPI_ANY_SOURCE, which
    on a world a growth made never completed (5 s and a warning on every rank)."""
    rc, out, tail = _run_script(tmp_path, TWICE_GROW_HVD_JOB, 1)
    assert rc == 0 and "BAD" not in out, f"status {rc} (None: a hang)\n{tail}"
    assert _by_rank(out, "DONE") == {r: ["3", "14"] for r in range(3)}, tail
    assert "notices incomplete" not in out, tail


LOCAL_UPDATES_GROW_JOB = """
from mpicoll.elastic import world as elastic_world
import hashlib, sys, time, numpy as np, torch, mpicoll, mpicoll.torch as hvd
import torch.distributed as dist, mpicoll.torch.hooks as hooks
kind = sys.argv[1]
if kind == "ddp-hook":
    dist.init_process_group("mpicoll")
else:
    hvd.init()
box = {"comm": mpicoll.Comm()}              # (None: the world in force, also a joiner's)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
if kind == "ddp-hook":
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(hooks.CompressionState(start_iter=6), hooks.int8_hook)
    inner = opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model=ddp, optimizer=opt, step=0)
elif kind == "codec":
    inner = opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.int8.with_momentum(0.9).with_warmup(6))
    state = hvd.elastic.TorchState(model, opt, step=0)
elif kind == "diloco":
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9),
                     sync_every=2)
    state = hvd.elastic.TorchState(model, optimizer=opt, inner=inner, step=0)
else:
    inner = opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           sync_every=2)
    state = hvd.elastic.TorchState(model, opt, step=0)
state.register_reset_callbacks([lambda: box.update(comm=mpicoll.Comm())])  # (docs/elastic.md)
@hvd.elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3,
                 discovery_interval=0.05)
def train(st):
    while True:
        rank = elastic_world().Get_rank()
        got = np.empty(2)
        box["comm"].Allreduce(np.full(2, rank + 1.0), got)
        n = elastic_world().Get_size()
        if got[0] != n * (n + 1) / 2:
            sys.stdout.write(f"BAD {rank} {n} {st.step}\\n")
        inner.zero_grad()
        x = torch.full((2, 4), float(rank + 1), dtype=torch.float64)
        (ddp if kind == "ddp-hook" else model)(x).sum().backward()
        opt.step()
        st.step += 1
        if st.step >= 12 and st.step % 2 == 0:
            return                          # right after an average over the world
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                 for p in model.parameters())).hexdigest()[:16]
sys.stdout.write(f"DONE {elastic_world().Get_rank()} {elastic_world().Get_size()} "
                 f"{digest}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["local-sgd", "diloco", "codec", "ddp-hook"])
def test_local_updates_grow_with_the_job(tmp_path, kind) -> None:
    """Grown from 2 to 3 ranks, the new rank joins the averages (every rank's parameters
    identical bitwise after the last average over the world; an ``mpicoll.Comm()`` made
    at the top sums over the world in force at every step) with:
    DistributedOptimizer(sync_every=2) and DiLoCo (their constructors made collectives
    over the grown world while the running ranks waited in the state's sync: a hang);
    DistributedOptimizer with int8, momentum and a warm-up of 6 steps (the new rank
    started its step count and reduced momentum at zero: MismatchError in the warm-up,
    wrong parameters on it after); DDP with mpicoll's int8 hook, its warm-up
    (``start_iter=6``) across the growth (the new rank alone ran the first call's
    agreement: a hang; then it counted its iterations from 0 and left the warm-up late:
    ``MismatchError``); and ``mpicoll.Comm()`` wrapped the new process's
    own ``MPI.COMM_WORLD`` (its spawn's world of 1: wrong sums, then a hang)."""
    rc, out, tail = _run_script(tmp_path, LOCAL_UPDATES_GROW_JOB, 2, kind)
    assert rc == 0, f"status {rc} (None: a hang)\n{tail}"
    done = _by_rank(out, "DONE")
    assert sorted(done) == [0, 1, 2] and {f[0] for f in done.values()} == {"3"}, tail
    assert len({f[1] for f in done.values()}) == 1, f"parameters differ\n{tail}"


PS_GROW_JOB = """
import sys, time, torch, mpicoll.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), backend="ps",
                               num_servers="colocated")
state = hvd.elastic.TorchState(model, opt, step=0)
@hvd.elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3,
                 discovery_interval=0.05)
def train(st):
    while st.step < 12:
        opt.zero_grad()
        x = torch.full((2, 4), float(hvd.rank() + 1), dtype=torch.float64)
        model(x).sum().backward()
        opt.step()
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
opt.close()
w = torch.cat([p.detach().flatten() for p in model.parameters()])
same = all(torch.equal(w, other) for other in hvd.allgather(w.unsqueeze(0), name="w"))
sys.stdout.write(f"DONE {hvd.rank()} {hvd.size()} {int(same)}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
def test_a_parameter_server_refuses_growth_on_every_rank(tmp_path) -> None:
    """A colocated parameter server under hvd.elastic whose discovery offers a third slot:
    the growth is refused on every rank with a clear message, and the job goes on at 2
    ranks with identical parameters. The new process built a parameter server of its own
    (over its spawn's world of 1) and trained alone: status 0, ranks apart."""
    rc, out, tail = _run_script(tmp_path, PS_GROW_JOB, 2)
    assert rc == 0, f"status {rc} (None: a hang)\n{tail}"
    assert _by_rank(out, "DONE") == {0: ["2", "1"], 1: ["2", "1"]}, tail
    assert out.count("cannot grow while a parameter server (mpicoll.ps) is open") == 2, tail


@pytest.mark.timeout(300)
def test_a_refused_growth_happens_once_nothing_refuses_it(tmp_path) -> None:
    """A parameter server refuses the third slot discovery offers from step 4 (once, on
    both ranks); after it is closed at step 6 a commit asks the ranks again, none
    refuses, and the job grows to 3 with exact sums (it stayed at 2 until discovery's
    answer changed: here never)."""
    rc, out, tail = _run_script(tmp_path, GROW_JOB, 2, "ps")
    assert rc == 0, f"status {rc} (None: a hang)\n{tail}"
    assert "BAD" not in out, tail
    assert _by_rank(out, "DONE") == {r: ["3", "14"] for r in range(3)}, tail
    assert out.count("cannot grow while a parameter server (mpicoll.ps) is open") == 2, tail


MIN_NP_JOB = """
import sys, time, numpy as np, mpicoll, mpicoll.elastic as elastic
start, later = time.time(), int(sys.argv[1])
state = elastic.ObjectState(step=0, sizes=[])
@elastic.run(discovery=lambda: 1 if time.time() - start < 1.0 else later, min_np=3,
             max_np=4, discovery_interval=0.05)
def train(st):
    while st.step < 5:
        size = elastic.world().Get_size()
        got = mpicoll.allreduce(np.full(3, elastic.world().Get_rank() + 1.0))
        st.sizes = st.sizes + [size * (size + 1) // 2 if got[0] == got[2] else -1]
        st.step += 1
        st.commit()
try:
    train(state)
except mpicoll.TooFewRanksError as exc:  # (one write: two ranks' lines never run together)
    sys.stdout.write(f"TOOFEW {elastic.world().Get_rank()} {exc.size} {exc.min_np}\\n")
    sys.stdout.flush()
    raise SystemExit(3)
sys.stdout.write(f"SUMS {elastic.world().Get_rank()} {state.sizes}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("later", [4, 1])
def test_a_job_launched_below_min_np_waits_for_the_slots(tmp_path, later) -> None:
    """``min_np=3``, launched with 2, the discovery offering 1 slot, then after a second
    ``later``: with 4 (``max_np``) the job grows to 4 before its function first runs (every
    step's all-reduce sums over 4: it started at 2 and grew at its first commit);
    with 1 it never gets the slots, and after ``MPICOLL_ELASTIC_TIMEOUT`` (3 s) every rank
    raises TooFewRanksError."""
    rc, out, tail = _run_script(tmp_path, MIN_NP_JOB, 2, str(later),
                                MPICOLL_ELASTIC_TIMEOUT="3")
    if later == 1:
        assert rc == 3, f"status {rc} (None: a hang)\n{tail}"
        assert sorted(ulfm_jobs.lines(out, "TOOFEW")) == [["0", "2", "3"], ["1", "2", "3"]], tail
        return
    assert rc == 0, f"status {rc} (None: a hang)\n{tail}"
    assert {f[0]: " ".join(f[1:]) for f in ulfm_jobs.lines(out, "SUMS")} == \
        {str(r): "[10, 10, 10, 10, 10]" for r in range(4)}, tail


def test_min_np_above_max_np_is_refused() -> None:
    with pytest.raises(ValueError, match="min_np=3 exceeds max_np=2"):
        elastic.run(min_np=3, max_np=2, discovery=lambda: 3)(lambda state: None)


TIMELINE_GROW_JOB = """
import sys, time, numpy as np, mpicoll, mpicoll.elastic as elastic
state = elastic.ObjectState(step=0)
@elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3, discovery_interval=0.05)
def train(st):
    while st.step < 10:
        mpicoll.allreduce(np.full(4, elastic.world().Get_rank() + 1.0))
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
sys.stdout.write(f"DONE {elastic.world().Get_rank()} {elastic.world().Get_size()}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
def test_a_timeline_takes_in_the_ranks_a_growth_started(tmp_path) -> None:
    """``MPICOLL_TIMELINE`` over a growth from 2 to 3: the merged trace has every rank's
    all-reduces under its rank in the grown world (rank 0's ten, rank 1's ten, the new
    rank 2's since it joined), and its communicators named by their ranks in the world.
    The new process numbered its part by its spawn's ``MPI.COMM_WORLD`` (rank 0 of 1):
    it wrote rank 0's part and merged it alone, rank 0 then found no part of its own
    (``FileNotFoundError`` at exit), and rank 1's part was left unmerged."""
    trace = tmp_path / "trace.json"
    rc, out, tail = _run_script(tmp_path, TIMELINE_GROW_JOB, 2, MPICOLL_TIMELINE=str(trace))
    assert rc == 0 and "Traceback" not in out, f"status {rc} (None: a hang)\n{tail}"
    assert sorted(_by_rank(out, "DONE")) == [0, 1, 2], tail
    assert not list(tmp_path.glob("trace.json.rank*")), "parts left unmerged"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(3)}, names
    calls = collections.Counter(e["pid"] for e in events if e["name"] == "allreduce")
    assert calls[0] == calls[1] == 10 and 0 < calls[2] < 10, calls
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(0, "MPI_COMM_WORLD"), (1, "MPI_COMM_WORLD"), (0, "world ranks 0-2"),
                      (1, "world ranks 0-2"), (2, "world ranks 0-2")}, tracks


STALL_GROW_JOB = """
import logging, time, numpy as np, mpicoll, mpicoll.elastic as elastic
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
state = elastic.ObjectState(step=0)
@elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3, discovery_interval=0.05)
def train(st):
    while st.step < 10:
        if st.step == 7 and elastic.world().Get_rank() == 2:   # the others all-reduce
            mpicoll.broadcast(np.zeros(4), root=0)
        else:
            mpicoll.allreduce(np.full(4, elastic.world().Get_rank() + 1.0))
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
"""


@pytest.mark.timeout(300)
def test_the_stall_inspector_names_the_ranks_of_the_grown_world(tmp_path) -> None:
    """After a growth from 2 to 3 the new rank 2 broadcasts where ranks 0 and 1
    all-reduce: the stall inspector's reports (warned after 1 s, the job aborted after 4)
    name every rank by its rank in the grown world, its communicator ``world ranks 0-2``.
    The world ranks were ``MPI.COMM_WORLD``'s, which the new process is not in (and whose
    rank 0 it is in its spawn's): ``rank 2 (world rank -32766)``, ``rank 0 (world rank
    -32766)``, ``rank 2 (world rank 0)``."""
    rc, out, tail = _run_script(tmp_path, STALL_GROW_JOB, 2, MPICOLL_STALL_WARN_SECONDS="1",
                                MPICOLL_STALL_ABORT_SECONDS="4")
    assert rc not in (0, None), f"status {rc} (None: a hang): no abort\n{tail}"
    reports = [line for line in out.splitlines() if "mpicoll stall inspector:" in line]
    assert any(line.startswith("LOG mpicoll stall inspector: rank 2 has waited")
               and " on world ranks 0-2 (3 ranks)" in line for line in reports), tail
    assert "inside a different one: rank 2 in broadcast" in out, tail
    assert "world rank " not in out and "-32766" not in out, \
        "\n".join(line for line in reports if "world rank " in line or "-32766" in line)


PROCESS_SET_GROW_JOB = """
import sys, time, torch, mpicoll.torch as hvd
hvd.init()
ps = hvd.add_process_set([1])              # (the new process: with the others' callback)
state = hvd.elastic.ObjectState(step=0)
state.register_reset_callbacks([lambda: hvd.add_process_set(ps)])   # (docs/elastic.md)
@hvd.elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3,
                 discovery_interval=0.05)
def train(st):
    while st.step < 8:
        hvd.allreduce(torch.ones(3), name="all")
        if ps.included():
            hvd.allreduce(torch.ones(3), name="in.set", process_set=ps)
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
ident = ps.process_set_id
try:
    sys.stdout.write(f"DONE {hvd.rank()} {hvd.size()} {ident} {hvd.remove_process_set(ps)}\\n")
except ValueError as exc:
    sys.stdout.write(f"DONE {hvd.rank()} {hvd.size()} {ident} {exc!r:.60}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
def test_process_set_ids_agree_after_a_growth(tmp_path) -> None:
    """A process set (of rank 1) added again in a reset callback, as docs/elastic.md says,
    over a growth from 2 to 3 (the new process adds it at the top of the program): every
    rank gives it the same id, as Horovod does, and ``hvd.remove_process_set`` removes it
    on every rank. The running ranks kept counting ids from their first registration (id
    2) while the new process started at 1: ``ValueError: ranks disagree on the process
    set: ids [2, 2, 1]``."""
    rc, out, tail = _run_script(tmp_path, PROCESS_SET_GROW_JOB, 2)
    assert rc == 0, f"status {rc} (None: a hang)\n{tail}"
    assert _by_rank(out, "DONE") == {r: ["3", "1", "True"] for r in range(3)}, tail


GROUPS_GROW_JOB = """
import sys, time, torch, torch.distributed as dist, mpicoll.torch as hvd
dist.init_process_group("mpicoll")
def others():                               # ranks 1 .. size-1: rank 0 is not in it
    n = dist.get_world_size()
    if sys.argv[1] == "callback" and n == 3 and dist.get_rank() == 1:
        time.sleep(1.5)                     # (rank 0 reaches the sync first)
    return dist.new_group(list(range(1, n)))
group = others()                            # at the top: the old size
if sys.argv[1] == "between":                # (made before hvd.init(): too early)
    hvd.init()
state = hvd.elastic.ObjectState(step=0)
if sys.argv[1] != "top":                    # made again at the reset (docs/elastic.md)
    def remake():
        global group
        group = others()
    state.register_reset_callbacks([remake])
@hvd.elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3,
                 discovery_interval=0.05)
def train(st):
    while st.step < 8:
        rank, n = dist.get_rank(), dist.get_world_size()
        if rank > 0:
            t = torch.full((3,), rank + 1.0)
            dist.all_reduce(t, group=group)
            if t[0].item() != n * (n + 1) / 2 - 1:
                sys.stdout.write(f"BAD {rank} {st.step} {t[0].item()}\\n")
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
sys.stdout.write(f"DONE {dist.get_rank()} {dist.get_world_size()}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("where", ["top", "callback", "between"])
def test_a_group_over_the_world_size_grows_when_made_again_at_the_reset(tmp_path,
                                                                         where) -> None:
    """``dist.new_group(range(1, world_size))`` made at the top of the program, growing
    from 2 to 3 under MPICH. Made again in a reset callback (rank 1's slow: rank 0 is in
    the state's sync first), it spans the grown world on every rank (exact sums). Made
    only at the top, the new process's group is one the running ranks never make: once
    they have all begun the sync, its ``new_group`` raises, saying what to do, and the
    job ends (MPICH cannot cancel the call; under ULFM the survivors go on:
    ``raise-joiner``). It hung; and before every running rank told the new one, the
    callback's group raised too, when rank 0 alone had begun the sync. Made between
    ``init_process_group`` and ``hvd.init()`` (and again in the callback), the new
    process's group is refused at once, saying to make it after both: the running ranks
    remake the engine before their callbacks, and each side waited for the other."""
    rc, out, tail = _run_script(tmp_path, GROUPS_GROW_JOB, 2, where)
    if where == "between":
        assert rc not in (0, None), f"status {rc} (None: a hang)\n{tail}"
        assert "new_group: this process joined a running job, whose ranks remake " \
               "hvd.init() before their reset callbacks" in out, tail
        assert "DONE" not in out, tail
        return
    if where == "callback":
        assert rc == 0 and "BAD" not in out, f"status {rc} (None: a hang)\n{tail}"
        assert _by_rank(out, "DONE") == {r: ["3"] for r in range(3)}, tail
        return
    assert rc not in (0, None), f"status {rc} (None: a hang)\n{tail}"
    assert "running ranks began the elastic state's first sync without making this " \
           "group" in out and "register_reset_callbacks" in out, tail
    assert "DONE" not in out, tail


@pytest.mark.timeout(300)
def test_a_new_process_that_raises_ends_the_job_under_mpich(tmp_path) -> None:
    """Under MPICH (no ULFM), a process a growth started raises at the top of the
    program: the job ends with its status and says why. Hydra does not end the running
    ranks' job for a spawned process's failure, and they waited for it forever."""
    rc, out, tail = _run_script(tmp_path, GROW_JOB, 2, "raise")
    assert rc not in (0, None), f"status {rc} (None: a hang)\n{tail}"
    assert "a process that joined the job failed: the job ends" in out, tail


REFUSED_GROW_JOB = """
import sys, time, torch, torch.distributed as dist, mpicoll.torch as hvd
dist.init_process_group("mpicoll")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
if sys.argv[1] == "mesh":                      # (FSDP2 takes one)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
ddp = torch.nn.parallel.DistributedDataParallel(model, static_graph=sys.argv[1] == "static")
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
state = hvd.elastic.TorchState(model=ddp, optimizer=opt, step=0)
@hvd.elastic.run(discovery=lambda: 2 if state.step < 4 else 3, max_np=3,
                 discovery_interval=0.05)
def train(st):
    while st.step < 10:
        opt.zero_grad()
        ddp(torch.full((2, 4), dist.get_rank() + 1.0, dtype=torch.float64)).sum().backward()
        opt.step()
        st.step += 1
        time.sleep(0.05)                    # (discovery polls every 0.05 s)
        st.commit()
train(state)
sys.stdout.write(f"DONE {dist.get_rank()} {dist.get_world_size()} {state.step}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, what", [
    ("static", "a DistributedDataParallel(static_graph=True) module is in use"),
    ("mesh", "a DeviceMesh (FSDP2's) is in use")])
def test_a_static_graph_or_a_device_mesh_refuses_growth_on_every_rank(tmp_path, kind,
                                                                      what) -> None:
    """DDP with ``static_graph=True``, or a ``DeviceMesh`` (FSDP2's) over "mpicoll", and a
    discovery that offers a third slot: every rank refuses the growth, saying why, and the
    job finishes at 2 ranks. The new process's first iteration of a static graph made
    collectives the running ranks were past, and a mesh's ranks followed the world's size
    (``MismatchError``: the job ended)."""
    rc, out, tail = _run_script(tmp_path, REFUSED_GROW_JOB, 2, kind)
    assert rc == 0, f"status {rc} (None: a hang)\n{tail}"
    assert _by_rank(out, "DONE") == {0: ["2", "10"], 1: ["2", "10"]}, tail
    assert out.count(f"cannot grow while {what} on rank(s) [0, 1]") == 2, tail
