"""Serial tests of ``python -m mpicoll.info``'s sections: failed sections, missing and
present optional packages, ULFM's three states, and the text report of each."""
from __future__ import annotations

import sys
import types

import pytest

from mpicoll import info as mpicoll_info
from mpicoll import tuning
from mpicoll.runtime import failures


def base(**sections) -> dict:
    """An info() dict with every section minimal, then ``sections`` over it."""
    data = {"mpicoll": {"version": "9.9", "python": "3.x", "numpy": "2.x", "platform": "p"},
            "mpi": {"library": "lib"},
            "cuda_aware": {"aware": False, "decided_by": "test"},
            "cupy": {"installed": False}, "torch": {"installed": False},
            "cuda_visible_devices": None,
            "tuning": {"table": None, "rules": "built-in (no tuning table)"},
            "variables": {"set": {}, "unknown": {}}}
    data.update(sections)
    return data


def test_failed_sections_are_reported_as_errors():
    """Each section that failed prints its error under its heading."""
    text = mpicoll_info.report(base(
        mpi={"error": "E-mpi"}, cuda_aware={"error": "E-aware"}, cupy={"error": "E-cupy"},
        tuning={"error": "E-tuning", "compression_auto": {"error": "E-auto"}},
        variables={"error": "E-vars"}))
    for line in ("  error                    E-mpi",
                 "  CUDA-aware MPI           error: E-aware",
                 "  cupy                     error: E-cupy",
                 "  error                    E-tuning",
                 "  error                    E-auto",
                 "  error                    E-vars"):
        assert line in text.splitlines(), (line, text)


def test_built_in_rules_unset_variables_and_installed_packages_are_shown():
    """No table: the built-in rules; no variable set: "none set"; CuPy with its CUDA
    versions, devices and a device error."""
    cupy = {"installed": True, "version": "13.0", "cuda_runtime": 12040, "cuda_driver": 12050,
            "devices": ["GPU-A"], "device_error": "RuntimeError: half visible"}
    text = mpicoll_info.report(base(cupy=cupy)).splitlines()
    assert "  table                    built-in (no tuning table)" in text
    assert "  none set" in text
    assert ("  cupy                     13.0, CUDA runtime 12040, driver 12050; "
            "1 visible device(s): GPU-A") in text
    assert "                           RuntimeError: half visible" in text
    assert "  cupy                     not installed" not in text


@pytest.mark.parametrize("available, on, words", [
    (False, False, "not available"), (True, False, "available, off"),
    (True, True, "available, on")])
def test_ulfm_state(monkeypatch, available, on, words):
    """The ULFM line says whether it is available and whether it is on."""
    monkeypatch.setattr(failures, "available", lambda: available)
    monkeypatch.setattr(failures, "turned_on", lambda: on)
    assert mpicoll_info._ulfm().startswith(words)


def test_missing_packages_are_not_installed(monkeypatch):
    """CuPy or torch that cannot be found are reported as not installed (a find_spec error
    included)."""
    def find_spec(name):
        raise ValueError(name)

    monkeypatch.setattr(mpicoll_info.importlib.util, "find_spec", find_spec)
    assert mpicoll_info._cupy() == {"installed": False}
    assert mpicoll_info._torch() == {"installed": False}


def test_cupy_section_with_and_without_a_device(monkeypatch):
    """An importable CuPy gives its version and devices; a runtime without a driver gives
    no device and the error."""
    props = {0: {"name": b"Fake GPU"}}
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 12,
                                    driverGetVersion=lambda: 13,
                                    getDeviceProperties=props.__getitem__)
    fake = types.SimpleNamespace(__version__="0.fake", cuda=types.SimpleNamespace(
        runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(mpicoll_info, "_importable", lambda name: True)
    assert mpicoll_info._cupy() == {"installed": True, "version": "0.fake",
                                    "cuda_runtime": 12, "cuda_driver": 13,
                                    "devices": ["Fake GPU"]}

    def no_driver():
        raise RuntimeError("no CUDA driver")

    runtime.getDeviceCount = no_driver
    out = mpicoll_info._cupy()
    assert out["devices"] == [] and out["device_error"] == "RuntimeError: no CUDA driver"


def test_tuning_section_without_a_table(monkeypatch):
    """No active table: the section says the built-in rules decide."""
    monkeypatch.setattr(tuning, "active_table", lambda: None)
    assert mpicoll_info._tuning() == {"table": None,
                                      "rules": "built-in (no tuning table)"}


def test_the_checkouts_tool_variables_are_not_called_typos():
    """MPICOLL_ROOT, MPICOLL_LAUNCHER (jobs/), MPICOLL_CLUSTER_DIR (cluster/): read by the
    checkout's tools (.ci/variables.py), shown as such, not as typos of library
    variables; a real typo still is one."""
    typo = "MPICOLL_" + "CHEK"        # (spelt apart: not a variable the tests read)
    var = mpicoll_info._variables({"MPICOLL_ROOT": "/x", "MPICOLL_LAUNCHER": "srun",
                                   "MPICOLL_CLUSTER_DIR": "/y", typo: "1"})
    assert var["tools"] == {"MPICOLL_ROOT": "jobs/", "MPICOLL_LAUNCHER": "jobs/",
                            "MPICOLL_CLUSTER_DIR": "cluster/"}
    assert var["unknown"] == {typo: "probable typo of MPICOLL_CHECK"}


def test_node_wait_takes_kernel_or_mpi_only(monkeypatch):
    """MPICOLL_NODE_WAIT=banana was read as kernel, silently."""
    from mpicoll import config, node_window

    for value, ok in (("kernel", True), ("mpi", True), ("banana", False)):
        monkeypatch.setenv("MPICOLL_NODE_WAIT", value)
        config.refresh()
        if ok:
            node_window.kernel_waits()
        else:
            with pytest.raises(ValueError, match="MPICOLL_NODE_WAIT='banana'"):
                node_window.kernel_waits()
    monkeypatch.undo()
    config.refresh()
