"""CUDA-awareness detection: override, info key parsing, library queries (all injected)."""
from __future__ import annotations

import ctypes

import pytest

from mpicoll.gpu import detect

QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
CUDA_QUERY = ctypes.CFUNCTYPE(ctypes.c_int)


def gpu_query(flag: int, err: int = 0) -> object:
    def fn(kind: int, out) -> int:  # noqa: ANN001
        assert kind == detect.MPIX_GPU_SUPPORT_CUDA
        out[0] = flag
        return err
    return QUERY(fn)


def symbols(**table: object):
    return lambda name: table.get(name)


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("true", True),
                                      ("off", False), (" YES ", True), ("auto", None),
                                      ("", None), (None, None)])
def test_override_values(raw, want) -> None:
    assert detect.parse_override(raw) is want if want is None else \
        detect.parse_override(raw) == want


@pytest.mark.parametrize("raw", ["2", "maybe", "cuda", "-1"])
def test_bad_override_names_the_variable(raw) -> None:
    with pytest.raises(ValueError, match=f"MPICOLL_CUDA_AWARE={raw!r} is not valid"):
        detect.parse_override(raw)
    with pytest.raises(ValueError, match="MPICOLL_CUDA_AWARE"):
        detect.decide(raw, "mpi,system,cuda", symbols())


def test_override_wins_over_everything() -> None:
    def never() -> str:
        raise AssertionError("the info key must not be read when overridden")
    assert detect.decide("0", never, symbols(MPIX_Query_cuda_support=CUDA_QUERY(lambda: 1))) \
        == (False, "MPICOLL_CUDA_AWARE=0 (override)")
    aware, why = detect.decide("1", never, None)
    assert aware and "override" in why


@pytest.mark.parametrize("value,want", [
    ("mpi,system", None), ("mpi,system,cuda", True), ("mpi, system, CUDA:device", True),
    ("mpi,cuda:host", None), ("mpi,cuda:host,cuda:device", True), ("cuda:managed", True),
    ("mpi,system,rocm", None), ("", None), (None, None), ("mpi,cudax", None)])
def test_alloc_kinds_parsing(value, want) -> None:
    verdict, why = detect.parse_alloc_kinds(value)
    assert verdict is want
    assert why


def test_info_key_decides_yes() -> None:
    aware, why = detect.decide(None, "mpi,system,cuda", None)
    assert aware and "mpi_memory_alloc_kinds='mpi,system,cuda'" in why


def test_info_without_cuda_falls_through_to_the_library() -> None:
    aware, why = detect.decide(None, "mpi,system", symbols(MPIX_GPU_query_support=gpu_query(1)))
    assert aware and "MPIX_GPU_query_support(CUDA) says supported" in why
    aware, why = detect.decide(None, "mpi,system",
                               symbols(MPIX_Query_cuda_support=CUDA_QUERY(lambda: 1)))
    assert aware and "MPIX_Query_cuda_support() says supported" in why


def test_library_says_no() -> None:
    aware, why = detect.decide(None, "mpi,system", symbols(
        MPIX_GPU_query_support=gpu_query(0), MPIX_Query_cuda_support=CUDA_QUERY(lambda: 0)))
    assert not aware
    assert "MPIX_GPU_query_support(CUDA) = 0" in why and "MPIX_Query_cuda_support() = 0" in why
    assert why.endswith("not CUDA-aware")


def test_either_query_saying_yes_is_enough() -> None:
    aware, _ = detect.decide(None, None, symbols(
        MPIX_GPU_query_support=gpu_query(0), MPIX_Query_cuda_support=CUDA_QUERY(lambda: 1)))
    assert aware


def test_a_failing_query_is_not_a_yes() -> None:
    aware, why = detect.decide(None, None, symbols(MPIX_GPU_query_support=gpu_query(1, err=7)))
    assert not aware and "error 7" in why


def test_symbols_absent_means_unknown_means_not_aware() -> None:
    aware, why = detect.decide(None, None, symbols())
    assert not aware
    assert "neither MPIX_GPU_query_support nor MPIX_Query_cuda_support" in why
    assert "unknown, so assumed not CUDA-aware" in why
    aware, why = detect.decide(None, None, None)
    assert not aware and "no MPI library to query" in why


def test_library_paths_from_maps(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 00:00 1   /opt/mpich/lib/libmpi.so.12.5.0\n"
        "7f01-7f02 r-xp 00000000 00:00 1   /opt/mpich/lib/libmpi.so.12.5.0\n"
        "7f02-7f03 r-xp 00000000 00:00 1   /usr/lib/libmpi_cxx.so.40\n"
        "7f03-7f04 r-xp 00000000 00:00 1   /usr/lib/libmpitrampoline.so\n"
        "7f04-7f05 r-xp 00000000 00:00 1   /usr/lib/libm.so.6\n"
        "7f05-7f06 rw-p 00000000 00:00 0   [heap]\n")
    assert detect.mpi_library_paths(str(maps)) == ["/opt/mpich/lib/libmpi.so.12.5.0",
                                                  "/usr/lib/libmpi_cxx.so.40"]
    assert detect.mpi_library_paths(str(tmp_path / "missing")) == []


def test_this_machine_is_not_cuda_aware(monkeypatch) -> None:
    """The MPICH/Open MPI wheels are not CUDA-aware (docs/gpu.md); decided once."""
    monkeypatch.delenv("MPICOLL_CUDA_AWARE", raising=False)
    detect.reset()
    try:
        aware, why = detect.cuda_aware()
        assert detect.cuda_aware() is detect.cuda_aware()  # cached
        if "cuda" not in (detect.info_alloc_kinds() or ""):
            assert not aware, why
        monkeypatch.setenv("MPICOLL_CUDA_AWARE", "1")
        assert detect.cuda_aware() == (aware, why)  # once per process ...
        detect.reset()
        assert detect.cuda_aware()[0] is True  # ... until reset
        monkeypatch.setenv("MPICOLL_CUDA_AWARE", "bogus")
        detect.reset()
        with pytest.raises(ValueError, match="MPICOLL_CUDA_AWARE='bogus'"):
            detect.cuda_aware()
    finally:
        detect.reset()


def test_real_library_lookup_finds_the_loaded_mpi() -> None:
    from mpi4py import MPI  # noqa: F401  (loads the library)

    lookup = detect.library_lookup()
    verdict, why = detect.query_library(lookup)
    assert verdict in (True, False, None) and why
