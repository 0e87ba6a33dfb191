"""examples/hybrid_parallel.py at 8 ranks: the 4 x 2 grid trains like the single-process
model (loss, every gradient and weight to 1e-5, three steps). Every grid of 1-4 ranks runs
in tests/torch/mpi (test_torch_hybrid.py); one grid here keeps the 8-rank launch short
(CI is kept under 15 minutes on 2 cores): `--grids 4x2,2x4` runs both by hand."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mpi_launcher import ROOT, mpirun_command

pytest.importorskip("torch")

#: Grids checked at 8 ranks (data parallel x tensor parallel).
GRIDS = ("4x2",)

#: Seconds the launch may take (eight ranks importing torch on a loaded 2-core machine).
TIMEOUT = 240


def test_hybrid_example_at_8_ranks_matches_single_process_model():
    cmd = ["timeout", "-k", "10", str(TIMEOUT), *mpirun_command(8), sys.executable,
           str(ROOT / "examples" / "hybrid_parallel.py"), "--check", "--grids", ",".join(GRIDS),
           "--steps", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT + 30, env=env,
                          cwd=ROOT, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for grid in GRIDS:
        verdict = re.search(rf"grid {grid}: largest difference to the single-process model "
                            rf"over 3 steps \(loss, gradients, weights\): (\S+) "
                            rf"\(tolerance 1e-05\): OK", out)
        assert verdict and float(verdict.group(1)) <= 1e-5, out
        assert len(re.findall(rf"grid {grid} step \d/3: loss", out)) == 3, out
