"""Nothing GPU-related is imported unless a device array reaches the staged path."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys, time
t = time.perf_counter()
import mpicoll, mpicoll.gpu, mpicoll.gpu.detect, mpicoll.gpu.arrays, mpicoll.gpu.staging
import mpicoll.gpu.route, mpicoll.gpu.device, mpicoll.gpu.backends, mpicoll.gpu.array_modules
heavy = sorted(m for m in ("cupy", "torch", "numba", "cupy_backends") if m in sys.modules)
print(heavy)
"""


def test_gpu_modules_import_nothing_gpu_related() -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_package_layers() -> None:
    """mpicoll.gpu sits below the collectives: it never imports them (no cycle when the
    core's dispatch calls into it) nor the adapters."""
    import ast

    for path in (ROOT / "mpicoll" / "gpu").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                name = ("." * node.level) + node.module
                assert "collectives" not in name and "comm" != name.rsplit(".", 1)[-1], \
                    f"{path.name} imports {name}"
                assert "torch" not in name.split(".")[:2] or node.level == 0, name
