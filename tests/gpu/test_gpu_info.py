"""python -m mpicoll.info and mpicoll.info(): what the report lists (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mpicoll.info as info_module

ROOT = Path(__file__).resolve().parents[2]

# misspelt names, built so that the repository's check of the variables the code reads
# (tests/test_repository.py) does not take them for variables
CHEK = "MPICOLL_" + "CHEK"
WHATEVER = "MPICOLL_" + "WHATEVER"
SEGMNT = "MPICOLL_" + "SEGMNT_BYTES"


def test_the_module_is_callable() -> None:
    data = info_module({"MPICOLL_CHECK": "1"})
    assert data["variables"]["set"] == {"MPICOLL_CHECK": "1"}
    assert set(data) == {"mpicoll", "mpi", "cuda_aware", "cupy", "torch",
                         "cuda_visible_devices", "tuning", "variables"}


def test_sections() -> None:
    data = info_module.info({})
    mpi = data["mpi"]
    assert "error" not in mpi, mpi
    assert mpi["library"] and mpi["mpi4py"] and mpi["standard"].startswith("MPI ")
    assert mpi["thread_level"].startswith("MPI_THREAD_") and mpi["world_size"] == 1
    assert isinstance(data["cuda_aware"]["aware"], bool) and data["cuda_aware"]["decided_by"]
    assert data["cupy"].get("installed") in (True, False)
    assert data["torch"].get("installed") in (True, False)
    tuning = data["tuning"]
    assert "error" not in tuning and ("table" in tuning)
    json.dumps(data)  # serialisable


def test_unknown_variables_are_flagged_as_typos() -> None:
    var = info_module.info({CHEK: "1", "MPICOLL_SEGMENT_BYTES": "64",
                            "MPICOLL_STAGING_BYTES": "1000", WHATEVER: "x",
                            "OTHER": "y"})["variables"]
    assert set(var["set"]) == {CHEK, "MPICOLL_SEGMENT_BYTES", "MPICOLL_STAGING_BYTES",
                               WHATEVER}
    assert var["unknown"] == {CHEK: "probable typo of MPICOLL_CHECK",
                              WHATEVER: "not a variable mpicoll reads"}


def test_every_config_variable_is_known() -> None:
    from mpicoll import config
    assert {v.name for v in config.VARIABLES} <= info_module.known_variables()


def test_a_failing_section_does_not_fail_the_report(monkeypatch) -> None:
    def boom() -> dict:
        raise RuntimeError("broken torch")
    monkeypatch.setattr(info_module, "_torch", boom)
    data = info_module.info({})
    assert data["torch"] == {"error": "RuntimeError: broken torch"}
    assert "torch                    error: RuntimeError: broken torch" in \
        info_module.report(data)


def test_text_report_lists_everything() -> None:
    text = info_module.report(info_module.info({CHEK: "1"}))
    for needle in ("mpicoll ", "MPI\n", "library", "mpi4py", "thread level", "world size",
                   "CUDA-aware MPI", "decided by", "cupy", "torch", "CUDA_VISIBLE_DEVICES",
                   "Tuning", "table", "Variables (MPICOLL_*)",
                   f"{CHEK}=1    <-- unknown: probable typo of MPICOLL_CHECK"):
        assert needle in text, needle


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPICOLL_")}
    env[SEGMNT] = "4096"
    return subprocess.run([sys.executable, "-m", "mpicoll.info", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_line() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert "CUDA-aware MPI" in proc.stdout
    assert "probable typo of MPICOLL_SEGMENT_BYTES" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr, proc.stderr  # not imported by mpicoll
    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["variables"]["unknown"] == {
        SEGMNT: "probable typo of MPICOLL_SEGMENT_BYTES"}
