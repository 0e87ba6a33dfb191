"""Make the repository's ``bench`` package importable (it is not installed with mpicoll)."""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
    if not hasattr(sys.modules[name], "__file__") or sys.modules[name].__file__ is None:
        del sys.modules[name]  # a namespace package made of tests/bench: drop it
