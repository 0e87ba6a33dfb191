"""torch's own distributed tests on the "mpicoll" backend, under ``mpirun`` (MPI suite).

torch ships ``DistributedTest._DistTestBase`` (torch/testing/_internal/distributed/
distributed_test.py): 285 tests of collectives, point-to-point, groups, DDP and the object
collectives. torch ran them on its own MPI backend in one MPI world, one
``init_process_group`` per process (``TestMPIWithFork``); test_torch_dist_test_base.py
does the same with "mpicoll". torch's multi-process harness (``MultiProcessTestCase``,
``FSDPTest``) runs on the MPI world's ranks through torch_bridge.py (test_torch_bridge.py
checks it with torch's FSDP2 helpers). This conftest makes torch's harness report as
pytest does:

- torch's multi-process tests skip by ``sys.exit(code)`` (``TEST_SKIPS``): those codes
  are pytest skips here, with torch's message;
- every test is marked ``mpi``, so the verdict plugin (tests/mpi_verdict.py) fails a test
  on every rank when one rank failed it (ranks never drift into different tests);
- :data:`KNOWN_FAILURES`: what no third-party c10d backend can pass, as strict xfails
  (one that starts passing fails the suite, so the list stays true).

Settings are made before torch's test module is imported (it reads them at import):
``BACKEND`` (``"mpicoll"``: tests gated on gloo/nccl names skip), ``TEMP_DIR`` and
``WORLD_SIZE``. torch runs some CPU tests (the all-to-alls, ``get_future``) only when
``BACKEND`` is ``"mpi"`` at import: with ``TORCH_SUITE_BACKEND=mpi`` (a second run of the
suite, tests/test_mpi_suites.py) it is, and only those tests run. Others it runs only
when ``BACKEND`` is ``"gloo"`` (``require_backend_is_available({"gloo"})``: the coalesced
all-reduces, ``scatter_object_list``, DDP's ``no_sync``): with
``TORCH_SUITE_BACKEND=gloo`` (a third run) only those run, still on "mpicoll" (not the
``monitored_barrier`` ones: torch's ``monitored_barrier`` refuses every backend but gloo).
"""
from __future__ import annotations

import importlib.util
import os
import re
import tempfile

import pytest
import torch_bridge
from mpi4py import MPI

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py"]

#: test name -> why it fails on any backend that is not built into torch.
KNOWN_FAILURES = {
    "test_ddp_logging_data_cpu":
        "DDP's logging data names the backend from torch's ProcessGroup, which says "
        "'custom' for every backend registered from outside torch "
        "(ProcessGroup::getBackendName); the test expects dist.get_backend()'s name",
}

_tmp = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mpicoll-torch-suite-")
                            if MPI.COMM_WORLD.Get_rank() == 0 else None)
#: ``BACKEND`` when torch's test module is imported: "mpicoll", or "mpi" or "gloo" for
#: the tests torch gates on that name (:data:`GATED`, the only ones that run then).
IMPORT_BACKEND = os.environ.get("TORCH_SUITE_BACKEND", "mpicoll")
#: The CPU tests torch runs only when ``BACKEND`` is this name at import: patterns
#: searched in the test's name.
GATED = {"mpi": ("all_to_all", "get_future"),
         "gloo": (r"all_reduce_coalesced_(full_group_|group_)?(sum|product|min|max)$",
                  "scatter_object_list", "grads_same_across_ranks_with_no_sync",
                  "batch_isend_irecv_gloo")}
os.environ["BACKEND"] = IMPORT_BACKEND
os.environ["TEMP_DIR"] = _tmp
os.environ["WORLD_SIZE"] = str(MPI.COMM_WORLD.Get_size())
for _sub in ("barrier", "test_dir", "init_dir"):
    os.makedirs(os.path.join(_tmp, _sub), exist_ok=True)


def pytest_configure(config: pytest.Config) -> None:
    if not collect_ignore_glob:
        torch_bridge.pytest_configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IMPORT_BACKEND in GATED:
        keep = [i for i in items
                if any(re.search(part, i.name) for part in GATED[IMPORT_BACKEND])]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    for item in items:
        item.add_marker(pytest.mark.mpi)
        why = KNOWN_FAILURES.get(item.name)
        if why is not None:
            item.add_marker(pytest.mark.xfail(reason=why, strict=True))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201
    """A ``SystemExit`` with one of torch's skip codes is that skip."""
    report = yield
    if call.excinfo is not None and call.excinfo.type is SystemExit:
        messages = torch_bridge.skip_messages()
        code = call.excinfo.value.code
        if code in messages:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), 0, f"Skipped: {messages[code]}")
    return report
