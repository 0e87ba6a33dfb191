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


def test_premul_sum_and_options():
    import torch.distributed as dist

    from mpicoll.torch.distributed import Options
    from mpicoll.torch.distributed.tensors import op_label, op_name, premul_factor

    op = dist._make_nccl_premul_sum(2.5)
    assert op_label(op) == "premul_sum" and premul_factor(dist.ReduceOp.SUM) is None
    if premul_factor(op) is None:        # torch 2.11 does not expose the factor
        with pytest.raises(ValueError, match="without its factor"):
            op_name(op)
    else:
        assert op_name(op) == "sum" and premul_factor(op) == 2.5
    assert Options().check == "every"
    with pytest.raises(ValueError, match="check="):
        Options(check="sometimes")


def test_work_completes_with_result_or_error():
    """torch's Work over the runtime's: result, error, future; a closed lane refuses."""
    from mpicoll.runtime import Lane
    from mpicoll.torch.distributed.work import MPIWork, completed

    lane = Lane("test-lane", inline=False)
    ok = MPIWork(lane.submit("ok", lambda: [1]))
    bad = MPIWork(lane.submit("bad", lambda: 1 / 0))
    assert ok.wait() and ok.result() == [1] and ok.get_future().wait() == [1]
    with pytest.raises(ZeroDivisionError):
        bad.wait()
    with pytest.raises(ZeroDivisionError):
        bad.get_future().wait()
    assert bad.is_completed() and not bad.is_success()
    assert isinstance(bad.exception(), ZeroDivisionError)
    assert completed("done", [2]).result() == [2]
    assert lane.close(5.0)
    with pytest.raises(RuntimeError, match="shut down"):
        lane.submit("late", lambda: None)


def test_wait_timeout_raises_at_once_and_breaks_the_lane():
    """An expired wait(timeout) raises CollectiveTimeoutError (a RuntimeError) naming the
    operation within the timeout; the work queued behind fails with the same error."""
    import threading
    import time
    from datetime import timedelta

    from mpicoll.errors import CollectiveTimeoutError
    from mpicoll.runtime import Lane
    from mpicoll.torch.distributed.work import MPIWork

    release = threading.Event()
    lane = Lane("test-timeout", inline=False)
    stuck = MPIWork(lane.submit("allreduce", lambda: release.wait(30)))
    queued = MPIWork(lane.submit("broadcast", lambda: None))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="allreduce.*timed out") as info:
        stuck.wait(timedelta(seconds=0.3))
    assert time.monotonic() - start < 1.5 and isinstance(info.value, RuntimeError)
    with pytest.raises(CollectiveTimeoutError):
        queued.wait()
    with pytest.raises(CollectiveTimeoutError):
        stuck.get_future().wait()
    release.set()          # the operation ends: closing the broken lane then is fine
    for _ in range(500):
        if lane.completed:
            break
        time.sleep(0.01)
    assert lane.close(5.0)


def test_import_builds_nothing():
    """``import mpicoll.torch`` registers the backend without building or loading the C++
    extension (that happens when the first group is made)."""
    import subprocess
    import sys

    code = ("import sys, mpicoll.torch; "
            "assert 'mpicoll.torch.distributed.process_group' not in sys.modules; "
            "from mpicoll.torch.distributed import extension; "
            "assert extension._module is None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _backend_class():
    """A Python c10d backend with two operations, over the extension's ``Backend``."""
    import torch.distributed as dist
    from torch.futures import Future

    from mpicoll.torch.distributed import extension

    class Work(dist.Work):
        def __init__(self, value, error=None):
            super().__init__()
            self.future = Future()
            self.error = error
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)
            self.marker = "python work"

        def wait(self, timeout=None):
            if self.error is not None:
                raise self.error
            return True

        def is_completed(self):
            return True

        def is_success(self):
            return self.error is None

        def exception(self):
            return self.error

        def get_future(self):
            return self.future

        def _source_rank(self):
            return 5

    class Backend(extension.load().Backend):
        def __init__(self):
            super().__init__(0, 1, "test-backend")
            self.calls = []
            self.timeout = None

        def allreduce(self, tensors, opts):
            self.calls.append(("allreduce", opts.reduceOp == dist.ReduceOp.SUM))
            tensors[0].mul_(2)
            return Work(tensors)

        def broadcast(self, tensors, opts):
            return Work(None, ValueError("bad root, says python"))

        def recv_anysource(self, tensors, tag):
            tensors[0].fill_(tag)
            return Work(tensors)

        def set_timeout(self, timeout):
            self.timeout = timeout

        def supportsSplitting(self):  # noqa: N802
            return True

    return Backend


def test_extension_backend_is_a_c10d_backend():
    """torch's ProcessGroup holds a Python subclass of the extension's Backend for a
    device, calls its methods through c10d's dispatcher, and hands back the Python work
    behind a c10d Work; what Python does not implement raises c10d's own error."""
    import datetime

    import torch.distributed as dist

    backend = _backend_class()()
    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
    kind = dist.ProcessGroup.BackendType.CUSTOM
    pg._set_default_backend(kind)
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), kind, backend)
    # (torch's group keeps the C++ object only: the Python object must live as long;
    # MPIProcessGroup keeps its groups until shutdown)
    assert pg._get_backend(torch.device("cpu")) is backend
    assert backend.name() == "test-backend"
    assert pg._get_backend(torch.device("cuda")) is backend
    x = torch.ones(3)
    work = pg.allreduce([x])
    assert work.wait() and torch.equal(x, torch.full((3,), 2.0))
    assert backend.calls == [("allreduce", True)]
    assert work.py_work.marker == "python work" and work.marker == "python work"
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert torch.equal(work.get_future().wait()[0], x)
    assert work.source_rank() == 5                       # C++ sourceRank -> Python
    failed = pg.broadcast([x])
    with pytest.raises(ValueError, match="says python"):  # the Python error, as raised
        failed.wait()
    assert not failed.is_success()
    got = torch.zeros(1)
    assert pg.recv_anysource([got], 7).wait() and got.item() == 7
    with pytest.raises(RuntimeError, match="test-backend does not support reduce"):
        pg.reduce([x])
    pg.set_timeout(datetime.timedelta(seconds=3))         # C++ setTimeout -> Python
    assert backend.timeout == datetime.timedelta(seconds=3)
    assert backend.supports_splitting and not backend.supports_coalescing


def test_get_future_result_reports_the_outcome():
    from mpicoll.errors import CollectiveTimeoutError
    from mpicoll.torch.distributed.work import completed, outcome

    assert completed("ok", [1]).get_future_result().wait() == 0
    assert completed("bad", None, ValueError("x")).get_future_result().wait() == 2
    late = completed("late", None, CollectiveTimeoutError("late", "allreduce"))
    assert late.get_future_result().wait() == 1
    assert outcome(None) == 0


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    """Where the extension must be built and cannot be, the error says what is missing."""
    from mpicoll.torch.distributed import extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    monkeypatch.setattr(extension, "_module", None)
    missing = r"C\+\+ compiler.*no-such-c\+\+-compiler.*set CXX"
    with pytest.raises(extension.ExtensionBuildError, match=missing):
        extension.load()


def test_options_are_c10d_backend_options():
    import copy
    import datetime

    from torch._C._distributed_c10d import Backend

    from mpicoll.torch.distributed import Options

    opts = Options(algorithm="ring", check="first")
    assert isinstance(opts, Backend.Options) and opts.backend == "mpicoll"
    assert opts._timeout == datetime.timedelta(minutes=30)
    mine = opts.for_group(datetime.timedelta(seconds=9), "7", [2, 3])
    assert (mine.algorithm, mine.check, mine._timeout, mine.group_name,
            mine.global_ranks_in_group) == ("ring", "first", datetime.timedelta(seconds=9),
                                            "7", [2, 3])
    twin = copy.deepcopy(mine)
    assert twin is not mine and twin.check == "first" and twin.group_name == "7"


@pytest.mark.parametrize("backend", ["gloo", "mpicoll"])
def test_device_id_on_a_cpu_only_torch(backend):
    """On a torch built without CUDA, ``init_process_group`` refuses every ``device_id``
    the same way for gloo and "mpicoll": an accelerator index or device torch was not
    built for, and a CPU device (``device_id`` names an accelerator). (With CUDA:
    tests/torch/test_torch_dist_startup_exit.py's device test.)"""
    import torch.distributed as dist

    import mpicoll.torch  # noqa: F401

    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("torch has an accelerator here")
    for device_id, message in [(0, "no accelerator support"),
                               (torch.device("cuda", 0), "does not match the current"),
                               (torch.device("cpu"), "must be an accelerator")]:
        with pytest.raises(ValueError, match=message):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=device_id)
        assert not dist.is_initialized()


def test_mpicoll_hook_on_a_gloo_group_is_refused_without_loading_the_backend():
    """An mpicoll DDP hook given a gloo group raises TypeError (use torch's own hooks), and
    finding that out does not import the backend's module (which loads, or builds, its C++
    extension); groups.backend_of says the same of a gloo group. A fresh process: others
    in this session may have imported it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        import torch.distributed as dist
        import mpicoll.torch.hooks as hooks
        from mpicoll.torch.distributed import backend_of
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            hooks._mpicoll_group(dist.group.WORLD)
        except TypeError as exc:
            print("hook:", exc)
        try:
            backend_of(dist.group.WORLD, "split_group")
        except ValueError as exc:
            print("backend_of:", exc)
        print("imported:", "mpicoll.torch.distributed.process_group" in sys.modules)
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert ("hook: the mpicoll DDP hooks average over an 'mpicoll' process group, not "
            "'gloo'") in proc.stdout, proc.stdout
    assert "backend_of: split_group takes an mpicoll process group, not" in proc.stdout
    assert "imported: False" in proc.stdout, proc.stdout


@pytest.mark.parametrize("rank,size,refused", [
    ("0", "1", False), (None, "1", False), (None, None, False),
    ("1", "1", True), ("0", "4", True), (None, "4", True)])
def test_rank_and_world_size_in_the_environment_must_be_mpis(monkeypatch, rank, size,
                                                              refused):
    """Under an MPI launcher (here a 1-process MPI world, the launcher's variable set), a
    ``RANK`` or ``WORLD_SIZE`` that is set and differs from MPI's is refused before any
    rendezvous, ``WORLD_SIZE`` also without ``RANK`` (it was ignored: the job ran at
    MPI's size); matching or unset ones pass the check."""
    from mpicoll.torch.distributed import startup

    monkeypatch.setenv("PMI_RANK", "0")
    for name, value in (("RANK", rank), ("WORLD_SIZE", size)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    if refused:
        with pytest.raises(RuntimeError, match="but MPI says rank 0 of 1"):
            next(startup._env_handler("env://"))
    else:
        startup._check_env_matches_mpi()


def test_a_users_store_giving_another_rank_than_mpis_is_refused():
    """``init_process_group("mpicoll", store=..., rank=1, world_size=2)`` in a one-process
    MPI world: the backend refuses the rendezvous' rank and size, naming both and MPI's
    (a fresh process: the failed default group is not left behind in this session)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch.distributed as dist
        import mpicoll.torch  # noqa: F401
        try:
            dist.init_process_group("mpicoll", store=dist.HashStore(), rank=1, world_size=2)
        except RuntimeError as exc:
            print("refused:", exc)
        print("initialized:", dist.is_initialized())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert ("the mpicoll backend got rank 1 of 2 from torch's rendezvous, but MPI says rank 0 "
            "of 1") in proc.stdout, proc.stdout + proc.stderr
    assert "initialized: False" in proc.stdout, proc.stdout
