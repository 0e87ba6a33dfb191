"""GPU: ``examples/train.py --device cuda`` trains at 2 ranks sharing the GPU (skipped,
with the reason, without CUDA)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import torch_cuda_skip_reason

_REASON = torch_cuda_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"GPU tests: {_REASON}")

ROOT = Path(__file__).resolve().parents[2]


def _train(launcher: str, device: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        ["timeout", "150", launcher, "-n", "2", sys.executable, "examples/train.py",
         "--device", device, "--epochs", "6", "--min-accuracy", "0.85"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = re.search(r"final test accuracy: ([0-9.]+)", proc.stdout)
    assert final, proc.stdout[-3000:]
    return float(final.group(1))


def test_train_example_on_cuda() -> None:
    """Trains to the threshold on the GPU, and to the CPU run's accuracy (the same data,
    seeds and schedule: the H200 run's epochs matched the CPU's to two decimals; 4 epochs
    reach 0.77 on either, below the 0.8 an earlier version of this test asked for)."""
    mpirun = Path(sys.executable).with_name("mpirun")
    launcher = str(mpirun) if mpirun.exists() else shutil.which("mpirun") or "mpirun"
    on_gpu = _train(launcher, "cuda")
    on_cpu = _train(launcher, "cpu")
    assert abs(on_gpu - on_cpu) <= 0.03, (on_gpu, on_cpu)
