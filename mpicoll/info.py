"""What mpicoll runs on: the report to paste into a bug report.

``python -m mpicoll.info`` prints it (``--json`` for JSON); ``mpicoll.info()`` returns it
as a dict (this module is callable). It lists the MPI library and version, mpi4py, the
thread level and world size, whether MPI is CUDA-aware and how that was decided, CuPy and
torch with their visible devices (only when importable; nothing here fails because they
are missing or broken), the tuning table in use, the inputs of ``compression="auto"`` (this process's codec
speeds, measured here; the link from the tuning table, else example links) with what it
would choose for a few sizes, and every ``MPICOLL_*`` variable set in
the environment, flagging names mpicoll does not know as probable typos.

Every section is gathered on its own: an error in one becomes an ``"error"`` entry of
that section instead of an exception.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import platform
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable

__all__ = ["info", "report", "main"]

_THREAD_LEVELS = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED",
                  2: "MPI_THREAD_SERIALIZED", 3: "MPI_THREAD_MULTIPLE"}


def _guard(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (a report never fails)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _mpi() -> dict:
    import mpi4py  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    out: dict[str, Any] = {
        "library": MPI.Get_library_version().strip().splitlines()[0].strip(),
        "standard": "MPI {}.{}".format(*MPI.Get_version()),
        "vendor": "{} {}".format(MPI.get_vendor()[0],
                                 ".".join(map(str, MPI.get_vendor()[1]))),
        "mpi4py": mpi4py.__version__,
        "initialized": bool(MPI.Is_initialized()),
        "ulfm": _ulfm(),
    }
    if MPI.Is_initialized() and not MPI.Is_finalized():
        level = MPI.Query_thread()
        out["thread_level"] = _THREAD_LEVELS.get(level, str(level))
        out["world_size"] = MPI.COMM_WORLD.Get_size()
        out["rank"] = MPI.COMM_WORLD.Get_rank()
        try:
            winfo = MPI.COMM_WORLD.Get_info()
            out["mpi_memory_alloc_kinds"] = winfo.Get("mpi_memory_alloc_kinds")
            winfo.Free()
        except Exception:  # noqa: BLE001
            out["mpi_memory_alloc_kinds"] = None
    return out


def _ulfm() -> str:
    """ULFM (process failures as errors, :mod:`mpicoll.runtime.failures`): available, and on?"""
    from .runtime import failures  # noqa: PLC0415

    if not failures.available():
        return "not available (needs Open MPI; the MPICH wheel ends the job on a failure)"
    if not failures.turned_on():
        return "available, off (mpirun --with-ft ulfm turns it on)"
    return "available, on (a failed rank raises mpicoll.ProcessFailedError)"


def _cuda_aware() -> dict:
    from .gpu import detect  # noqa: PLC0415

    aware, reason = detect.cuda_aware()
    return {"aware": aware, "decided_by": reason,
            "override": os.environ.get(detect.VARIABLE)}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cupy() -> dict:
    if not _importable("cupy"):
        return {"installed": False}
    import cupy  # noqa: PLC0415

    out: dict[str, Any] = {"installed": True, "version": cupy.__version__}
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        out["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        out["devices"] = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode()
                          for i in range(count)]
    except Exception as exc:  # noqa: BLE001  (no driver, no device)
        out["devices"] = []
        out["device_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _torch() -> dict:
    if not _importable("torch"):
        return {"installed": False}
    import torch  # noqa: PLC0415

    out: dict[str, Any] = {"installed": True, "version": torch.__version__,
                           "cuda_build": torch.version.cuda,
                           "cuda_available": bool(torch.cuda.is_available())}
    count = torch.cuda.device_count() if out["cuda_available"] else 0
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
    return out


def _summarise_meta(meta: dict) -> dict:
    out = {k: v for k, v in meta.items() if k not in ("runs", "timings_us", "derivation")}
    runs = meta.get("runs")
    if isinstance(runs, list):
        out["runs"] = [{k: r.get(k) for k in ("world_size", "ranks_per_node",
                                              "mpi_library", "thread_level", "date")
                        if k in r} for r in runs if isinstance(r, dict)]
    deriv = meta.get("derivation")
    if isinstance(deriv, dict):
        out["derivation"] = {k: deriv.get(k) for k in ("command", "date") if k in deriv}
    return out


def _tuning() -> dict:
    from . import tuning  # noqa: PLC0415

    table = tuning.active_table()
    if table is None:
        return {"table": None, "rules": "built-in (no tuning table)"}
    return {"table": str(table.source), "collectives": table.collectives(),
            "world_sizes": {c: table.world_sizes(c) for c in table.collectives()},
            "meta": _summarise_meta(table.meta)}


#: Sizes (bytes of float32) and example links of the ``compression_auto`` section.
AUTO_SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)
AUTO_EXAMPLE_LINKS = (("1 Gb/s, 50 us (example)", 50e-6, 1.25e8),
                      ("10 Gb/s, 20 us (example)", 20e-6, 1.25e9),
                      ("100 Gb/s, 5 us (example)", 5e-6, 1.25e10))


def _compression_auto() -> dict:
    """``compression="auto"``'s model inputs here and its choices (no communication:
    the link is the tuning table's, else example links; collectives measure their own)."""
    import numpy as np  # noqa: PLC0415

    from .compression import auto, cost_model, probe  # noqa: PLC0415

    cands = cost_model.DEFAULT_CANDIDATES
    enc, dec, add = probe.codec_speeds(cands)
    try:
        from mpi4py import MPI  # noqa: PLC0415
        n = MPI.COMM_WORLD.Get_size() if MPI.Is_initialized() else 1
    except Exception:  # noqa: BLE001
        n = 1
    n = max(n, 2)
    table = auto._table_link()  # noqa: SLF001  (the same lookup the collectives make)
    links = [(table[2], table[0], table[1])] if table else list(AUTO_EXAMPLE_LINKS)
    out: dict[str, Any] = {
        "candidates": list(cands), "world_size": n,
        "codec_speeds": {c: {"encode_bytes_per_s": enc[c].rate, "encode_overhead_s":
                             enc[c].overhead, "decode_bytes_per_s": dec[c].rate,
                             "decode_overhead_s": dec[c].overhead} for c in enc},
        "add_bytes_per_s": add.rate, "cpu_share": probe.cpu_share(), "links": []}
    for label, latency, bandwidth in links:
        inputs = cost_model.ModelInputs(latency, bandwidth, enc, dec, add, label)
        rows = []
        for size in AUTO_SIZES:
            choice = cost_model.choose(inputs, cands, size // 4, np.float32,
                                       cost_model.Layout(n))
            rows.append({"bytes": size, "choice": choice.codec,
                         "predicted_s": choice.predicted})
        out["links"].append({"link": label, "latency_s": latency,
                             "bandwidth_bytes_per_s": bandwidth, "choices": rows})
    return out


def known_variables() -> set[str]:
    """Every ``MPICOLL_*`` name mpicoll knows (``config.VARIABLES``)."""
    from . import config  # noqa: PLC0415

    return {v.name for v in config.VARIABLES}


def tool_variables() -> dict[str, str]:
    """The variables of a checkout's tools (``.ci/variables.py``'s ``TOOL_VARIABLES``:
    jobs/, cluster/, bench/, the tests), name -> who reads them, when this mpicoll runs
    from a checkout; empty for an installed package (they do not ship)."""
    path = Path(__file__).resolve().parents[1] / ".ci" / "variables.py"
    if not path.is_file():
        return {}
    names = re.findall(r'Variable\("(MPICOLL_\w+)", "([^"]*)"', path.read_text())
    return dict(names)


def _variables(environ: dict[str, str] | None = None) -> dict:
    env = os.environ if environ is None else environ
    known = known_variables()
    tools = tool_variables()
    out: dict[str, Any] = {"set": {}, "unknown": {}, "tools": {}}
    for name in sorted(n for n in env if n.startswith("MPICOLL_")):
        out["set"][name] = env[name]
        if name in tools:
            out["tools"][name] = tools[name]
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
            out["unknown"][name] = (f"probable typo of {close[0]}" if close
                                    else "not a variable mpicoll reads")
    return out


def info(environ: dict[str, str] | None = None) -> dict:
    """The report as a dict (sections ``mpicoll``, ``mpi``, ``cuda_aware``, ``cupy``,
    ``torch``, ``cuda_visible_devices``, ``tuning`` (with ``compression_auto``: the
    inputs and choices of ``compression="auto"``), ``variables``).

    Args:
        environ: the environment to list ``MPICOLL_*`` variables from (default
            ``os.environ``).
    Returns:
        A JSON-serialisable dict; a section that failed holds ``{"error": ...}``.
    """
    from . import __version__  # noqa: PLC0415

    return {
        "mpicoll": {"version": __version__, "python": platform.python_version(),
                    "platform": platform.platform(),
                    "numpy": _guard(lambda: {"version": __import__("numpy").__version__}
                                    ).get("version")},
        "mpi": _guard(_mpi),
        "cuda_aware": _guard(_cuda_aware),
        "cupy": _guard(_cupy),
        "torch": _guard(_torch),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "tuning": {**_guard(_tuning), "compression_auto": _guard(_compression_auto)},
        "variables": _guard(lambda: _variables(environ)),
    }


def _line(key: str, value: Any) -> str:
    return f"  {key:<24} {value}"


def report(data: dict | None = None) -> str:
    """The report as text (what ``python -m mpicoll.info`` prints)."""
    d = info() if data is None else data
    m = d["mpicoll"]
    lines = [f"mpicoll {m['version']} (Python {m['python']}, numpy {m['numpy']}, "
             f"{m['platform']})", "MPI"]
    mpi = d["mpi"]
    for key in ("error", "library", "standard", "vendor", "mpi4py", "thread_level",
                "world_size", "mpi_memory_alloc_kinds", "ulfm"):  # a failed one: "error" only
        if key in mpi:
            lines.append(_line(key.replace("_", " "), mpi[key]))
    lines.append("CUDA")
    ca = d["cuda_aware"]
    if "error" in ca:
        lines.append(_line("CUDA-aware MPI", f"error: {ca['error']}"))
    else:
        lines.append(_line("CUDA-aware MPI", "yes" if ca["aware"] else "no (staged path)"))
        lines.append(_line("decided by", ca["decided_by"]))
    for name in ("cupy", "torch"):
        sec = d[name]
        if "error" in sec:
            lines.append(_line(name, f"error: {sec['error']}"))
        elif not sec.get("installed"):
            lines.append(_line(name, "not installed"))
        else:
            extra = ""
            if name == "torch":
                extra = f", CUDA build {sec['cuda_build']}"
            elif "cuda_runtime" in sec:
                extra = f", CUDA runtime {sec['cuda_runtime']}, driver {sec['cuda_driver']}"
            devices = sec.get("devices") or []
            lines.append(_line(name, f"{sec['version']}{extra}; "
                                     f"{len(devices)} visible device(s)"
                                     + (f": {', '.join(devices)}" if devices else "")))
            if sec.get("device_error"):
                lines.append(_line("", sec["device_error"]))
    lines.append(_line("CUDA_VISIBLE_DEVICES", d["cuda_visible_devices"] or "unset"))
    lines.append("Tuning")
    tun = d["tuning"]
    if "error" in tun:
        lines.append(_line("error", tun["error"]))
    elif tun.get("table") is None:
        lines.append(_line("table", tun["rules"]))
    else:
        lines.append(_line("table", tun["table"]))
        sizes = "; ".join(f"{c}: {tun['world_sizes'][c]}" for c in tun["collectives"])
        lines.append(_line("world sizes", sizes))
        for run in tun["meta"].get("runs", [])[:8]:
            lines.append(_line("measured", ", ".join(f"{k}={v}" for k, v in run.items())))
        if "derivation" in tun["meta"]:
            lines.append(_line("derived", tun["meta"]["derivation"].get("date")))
    lines.extend(_auto_lines(tun.get("compression_auto", {"error": "not gathered"})))
    lines.append("Variables (MPICOLL_*)")
    var = d["variables"]
    if "error" in var:
        lines.append(_line("error", var["error"]))
    elif not var["set"]:
        lines.append("  none set")
    else:
        for name, value in var["set"].items():
            note = var["unknown"].get(name)
            tool = var["tools"].get(name)
            lines.append(f"  {name}={value}" + (f"    <-- unknown: {note}" if note else "")
                         + (f"    <-- read by the checkout's tools ({tool}), not the "
                            f"library" if tool else ""))
    return "\n".join(lines) + "\n"


def _auto_lines(sec: dict) -> list[str]:
    """The ``compression_auto`` section as text."""
    lines = ['Compression "auto" (model inputs; predicted ms per candidate)']
    if "error" in sec:
        return lines + [_line("error", sec["error"])]
    for c, sp in sec["codec_speeds"].items():
        lines.append(_line(f"{c} GB/s", f"encode {sp['encode_bytes_per_s'] / 1e9:.2f} "
                                        f"(+{sp['encode_overhead_s'] * 1e6:.0f} us/call), "
                                        f"decode {sp['decode_bytes_per_s'] / 1e9:.2f} "
                                        f"(+{sp['decode_overhead_s'] * 1e6:.0f} us/call)"))
    lines.append(_line("add GB/s", f"{sec['add_bytes_per_s'] / 1e9:.2f}"))
    if sec.get("cpu_share") is not None:
        lines.append(_line("CPU share", f"{sec['cpu_share']:.2f} (CPU over wall time while "
                                        f"measuring; applied to the speeds above)"))
    for link in sec["links"]:
        lines.append(_line(f"n={sec['world_size']}, link", link["link"]))
        for row in link["choices"]:
            times = ", ".join(f"{c} {t * 1e3:.3g}" for c, t in row["predicted_s"].items())
            lines.append(_line(f"  {row['bytes'] >> 10} KiB", f"{row['choice']:<10} ({times})"))
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m mpicoll.info [--json]``; under ``mpirun``, rank 0 prints (one report, one
    JSON document)."""
    parser = argparse.ArgumentParser(prog="python -m mpicoll.info",
                                     description="Report what mpicoll runs on (under mpirun: "
                                                 "rank 0's report).")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    data = info()
    if (data.get("mpi") or {}).get("rank", 0):
        return 0
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        print(report(data), end="")
    return 0


class _CallableModule(types.ModuleType):
    """This module's type: ``mpicoll.info()`` returns :func:`info`'s dict."""

    def __call__(self, environ: dict[str, str] | None = None) -> dict:
        return info(environ)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
