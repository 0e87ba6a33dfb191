"""mpi4py's own tests of collectives against ``mpicoll.Comm`` (drop-in means drop-in).

mpi4py's suite ships in its sdist, not its wheel: the module fixture downloads the sdist of
the installed mpi4py from the package index (nothing of it is committed), then
tests/mpi/mpi4py_suite.py runs the modules at 3 ranks with ``COMM_WORLD``/``COMM_SELF``
(and their ``Dup``s) replaced by ``mpicoll.Comm``, with ``check`` off and on. Host arrays
only: mpi4py's "FakeGPU" arrays (host memory exposing ``__cuda_array_interface__``) take
mpicoll's device path, which needs CuPy, by design (docs/gpu.md). The whole suite, every
module and world size, with the failures that remain and why:
docs/results/mpi4py_tests.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import mpi4py
import pytest

from mpi_launcher import mpirun_command, run_command

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "mpi" / "mpi4py_suite.py"
MODULES = ["test_cco_buf", "test_cco_obj", "test_msgspec", "test_msgzero", "test_op"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mpi4py's test/ directory, from the installed version's sdist."""
    where = tmp_path_factory.mktemp("mpi4py_sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", f"mpi4py=={mpi4py.__version__}",
                    "--no-deps", "--no-binary", ":all:", "-q", "-d", str(where)],
                   check=True, timeout=600, capture_output=True)
    with tarfile.open(next(where.glob("mpi4py-*.tar.gz"))) as tar:
        tar.extractall(where)
    return where / f"mpi4py-{mpi4py.__version__}" / "test"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("check", [False, True])
def test_mpi4py_own_collective_tests_pass_on_mpicoll_comm(suite, tmp_path, check) -> None:
    out = tmp_path / "out"
    cmd = mpirun_command(3) + [sys.executable, str(RUNNER), "--mode", "mpicoll",
                               "--exclude-backend", "FakeGPU", "--tests", str(suite),
                               "--out", str(out), *MODULES] + (["--check"] if check else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPICOLL_")}
    env["PYTHONPATH"] = str(ROOT)
    rc, text, _ = run_command(cmd, env, 500)
    assert rc == 0, f"status {rc} (None: a hang)\n{text[-3000:]}"
    records = [rec for rank in range(3)
               for rec in json.loads((out / f"rank{rank}.json").read_text())["records"]]
    failing = sorted({r["id"] for r in records if r["outcome"] in ("fail", "error")})
    assert not failing, f"{failing}\n" + next(r["detail"] for r in records
                                              if r["id"] == failing[0])
    passed = {m: len({r["id"] for r in records if r["outcome"] == "pass"
                      and r["id"].startswith(m + ".")}) for m in MODULES}
    assert all(passed.values()) and passed["test_cco_buf"] == 72, passed
