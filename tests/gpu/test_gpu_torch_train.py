"""GPU: ``examples/train.py --device cuda`` trains at 2 ranks sharing the GPU (skipped,
with the reason, without CUDA)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import torch_cuda_skip_reason

_REASON = torch_cuda_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"GPU tests: {_REASON}")

ROOT = Path(__file__).resolve().parents[2]


def test_train_example_on_cuda() -> None:
    mpirun = Path(sys.executable).with_name("mpirun")
    launcher = str(mpirun) if mpirun.exists() else shutil.which("mpirun") or "mpirun"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        ["timeout", "150", launcher, "-n", "2", sys.executable, "examples/train.py",
         "--device", "cuda", "--epochs", "4", "--min-accuracy", "0.8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
