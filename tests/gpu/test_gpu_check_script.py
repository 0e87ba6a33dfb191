"""tests/gpu/check.sh: its smoke mode runs on this CPU machine and FAILS because the GPU
tests were skipped; the verdict logic on made-up results."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_summary import main as summarise
from gpu_helpers import gpu_skip_reason

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.skipif(gpu_skip_reason() is None, reason="a GPU is present: the smoke run "
                                                     "would pass, not fail")
def test_smoke_mode_fails_loudly_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "check.sh"), "--smoke",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "GPU CHECK FAILED" in proc.stderr
    assert "GPU TESTS WERE SKIPPED" in proc.stderr
    summary = (out / "summary.md").read_text()
    assert "## Verdict: FAIL" in summary and "NO GPU TEST PASSED" in summary
    for name in ("junit-serial.xml", "junit-mpi-n1.xml", "junit-mpi-n2.xml",
                 "bench-gpu.json", "info.json", "environment.txt"):
        assert (out / name).exists(), name
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    assert steps == {"info": "0", "serial": "0", "mpi-n1": "0", "mpi-n2": "0", "bench": "0"}


def _junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    body = []
    for name, outcome, message in cases:
        module, test = name.split("::")
        inner = {"passed": "", "failed": f'<failure message="{message}"/>',
                 "skipped": f'<skipped type="pytest.skip" message="{message}"/>'}[outcome]
        body.append(f'<testcase classname="{module}" name="{test}">{inner}</testcase>')
    path.write_text('<testsuites><testsuite name="pytest">' + "".join(body)
                    + "</testsuite></testsuites>")


def test_verdict(tmp_path: Path) -> None:
    (tmp_path / "steps.tsv").write_text("serial\t0\t1.0\n")
    _junit(tmp_path / "junit-serial.xml", [
        ("tests.gpu.test_gpu_cuda::test_a", "passed", ""),
        ("tests.gpu.mpi.test_gpu_cupy::test_b", "skipped", "MPI is not CUDA-aware here"),
        ("tests.gpu.test_gpu_staging::test_c", "passed", "")])
    assert summarise(str(tmp_path)) == 0
    assert "## Verdict: PASS" in (tmp_path / "summary.md").read_text()
    _junit(tmp_path / "junit-mpi-n2.xml", [
        ("tests.gpu.mpi.test_gpu_cupy::test_d", "skipped", "GPU tests: no CUDA device")])
    assert summarise(str(tmp_path)) == 1
    _junit(tmp_path / "junit-mpi-n2.xml", [
        ("tests.gpu.mpi.test_gpu_cupy::test_d", "failed", "boom")])
    assert summarise(str(tmp_path)) == 1
    (tmp_path / "junit-mpi-n2.xml").unlink()
    (tmp_path / "steps.tsv").write_text("serial\t0\t1.0\nbench\t1\t2.0\n")
    assert summarise(str(tmp_path)) == 1
    assert "step bench exited with status 1" in (tmp_path / "summary.md").read_text()
