"""Run mpi4py's own test modules with COMM_WORLD / COMM_SELF replaced by mpicoll.Comm
(mpi4py's suite ships in its sdist, not its wheel: fetch it, nothing of it is committed;
results and commands in docs/results/mpi4py_tests.md).

Usage (one rank per process, under mpirun):

    pip download mpi4py==4.1.2 --no-deps --no-binary :all: -d mpi4py-src
    tar -C mpi4py-src -xzf mpi4py-src/mpi4py-4.1.2.tar.gz
    mpirun -n N python tests/mpi/mpi4py_suite.py --mode {plain,mpicoll} \
        --tests mpi4py-src/mpi4py-4.1.2/test --out OUTDIR test_cco_buf test_comm ...

--mode plain    runs the modules unchanged (the baseline).
--mode mpicoll  installs, before the test modules are imported, a stand-in for the
                ``mpi4py.MPI`` attribute of the ``mpi4py`` package whose ``COMM_WORLD`` and
                ``COMM_SELF`` are ``mpicoll.Comm(MPI.COMM_WORLD)`` / ``mpicoll.Comm(MPI.COMM_SELF)``
                and which delegates every other name to the real module.  So every place
                the tests name COMM_WORLD / COMM_SELF -- class attributes (``COMM =
                MPI.COMM_WORLD``), ``setUp`` (``MPI.COMM_WORLD.Dup()``, i.e. mpicoll's Dup),
                module-level helpers -- gets the mpicoll communicator.  ``sys.modules
                ['mpi4py.MPI']`` stays the real module (mpicoll itself and
                ``importlib.import_module('mpi4py.MPI')`` see the real one).

Each rank writes OUTDIR/rank<R>.json (per test: outcome, seconds, traceback) and appends
the test id to OUTDIR/rank<R>.log before running it (to locate a hang).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types
import unittest


def install_proxy(algorithm: str = "auto", check: bool | None = None) -> None:
    import mpi4py
    from mpi4py import MPI as REAL

    import mpicoll

    class _MPIProxy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(REAL, name)

    proxy = _MPIProxy("mpi4py.MPI")
    proxy.__file__ = REAL.__file__
    proxy.COMM_WORLD = mpicoll.Comm(REAL.COMM_WORLD, algorithm=algorithm, check=check)
    proxy.COMM_SELF = mpicoll.Comm(REAL.COMM_SELF, algorithm=algorithm, check=check)
    mpi4py.MPI = proxy   # what `from mpi4py import MPI` returns from now on


class Result(unittest.TestResult):
    def __init__(self, logpath: str):
        super().__init__()
        self.records: list[dict] = []
        self._log = open(logpath, "a", buffering=1)  # noqa: SIM115  (open for the run)
        self._t0 = 0.0

    def startTest(self, test):
        super().startTest(test)
        self._log.write(f"START {test.id()}\n")
        self._t0 = time.perf_counter()

    def _rec(self, test, outcome, detail=""):
        dt = time.perf_counter() - self._t0
        self.records.append({"id": test.id(), "outcome": outcome,
                             "seconds": round(dt, 4), "detail": detail})
        self._log.write(f"{outcome.upper()} {test.id()} {dt:.3f}s\n")

    def addSuccess(self, test):
        super().addSuccess(test)
        self._rec(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._rec(test, "fail", "".join(traceback.format_exception(*err))[-4000:])

    def addError(self, test, err):
        super().addError(test, err)
        self._rec(test, "error", "".join(traceback.format_exception(*err))[-4000:])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._rec(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._rec(test, "xfail")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._rec(test, "xpass")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            self._rec(subtest, kind, "".join(traceback.format_exception(*err))[-4000:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("plain", "mpicoll"), required=True)
    ap.add_argument("--tests", required=True, help="mpi4py's test/ directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("-k", action="append", default=[],
                    help="only test ids containing this string (repeatable: any of them)")
    ap.add_argument("--exclude-backend", action="append", default=[],
                    help="drop arrayimpl backends whose class name contains this "
                         "(e.g. FakeGPU: host memory exposing __cuda_array_interface__)")
    ap.add_argument("--algorithm", default="auto",
                    help="mpicoll.Comm(..., algorithm=NAME) (a name a collective lacks: auto)")
    ap.add_argument("--check", action="store_true", help="mpicoll.Comm(..., check=True)")
    ap.add_argument("modules", nargs="+")
    ns = ap.parse_args()

    sys.path.insert(0, ns.tests)
    if ns.mode == "mpicoll":
        install_proxy(ns.algorithm, True if ns.check else None)
    from mpi4py import MPI  # (the proxy in mpicoll mode)

    rank = MPI.COMM_WORLD.Get_rank()
    if ns.exclude_backend:
        import arrayimpl
        arrayimpl.ArrayBackends[:] = [
            a for a in arrayimpl.ArrayBackends
            if not any(x in a.__name__ for x in ns.exclude_backend)]
    os.makedirs(ns.out, exist_ok=True)
    result = Result(os.path.join(ns.out, f"rank{rank}.log"))
    loader = unittest.TestLoader()
    if ns.k:
        loader.testNamePatterns = [f"*{k}*" for k in ns.k]
    t_all = time.perf_counter()
    times = {}
    for name in ns.modules:
        t0 = time.perf_counter()
        module = __import__(name)
        suite = loader.loadTestsFromModule(module)
        suite.run(result)
        times[name] = round(time.perf_counter() - t0, 3)
    total = round(time.perf_counter() - t_all, 3)
    with open(os.path.join(ns.out, f"rank{rank}.json"), "w") as fh:
        json.dump({"mode": ns.mode, "size": MPI.COMM_WORLD.Get_size(), "rank": rank,
                   "module_seconds": times, "total_seconds": total,
                   "records": result.records}, fh, indent=1)
    bad = sum(r["outcome"] in ("fail", "error") for r in result.records)
    print(f"[rank {rank}] {ns.mode}: {len(result.records)} records, {bad} failing, "
          f"{total:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
