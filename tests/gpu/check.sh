#!/usr/bin/env bash
# The GPU check: every GPU test and a GPU benchmark sweep, on one machine with one GPU,
# CuPy and PyTorch, and no network. Writes to OUTDIR: JUnit XML (junit-*.xml), the
# benchmark's JSON (bench-gpu.json), `python -m mpicoll.info --json` (info.json), one log
# per step, and summary.md. Exits non-zero if anything failed OR the GPU tests were
# skipped (no GPU, no CuPy): a check that did not run its point must not pass.
#
#   tests/gpu/check.sh OUTDIR            the full check (about 3-5 minutes)
#   tests/gpu/check.sh --smoke OUTDIR    only the GPU test files at 1 and 2 ranks and a
#                                        tiny simulated benchmark; on a CPU machine it
#                                        must fail, because the GPU tests are skipped
#
# What the machine lacks (the MPICH wheel, mpi4py, pytest and plugins) is installed from
# wheel files in .whl/ (ignored by git), downloaded beforehand on a machine with network,
# from the repository root (Python 3.12, x86-64; about 20 MiB):
#
#   python3 -m pip download --dest .whl --only-binary=:all: --python-version 3.12 \
#       --implementation cp --abi cp312 --abi abi3 --abi none \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform any \
#       mpich mpi4py pytest pytest-timeout pytest-mpi
#
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS (default .whl),
# GPU_CHECK_VENV (default /tmp/mpicoll-gpu-venv: a venv with the system's packages).
set -u -o pipefail

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
if [ $# -ne 1 ]; then
    echo "usage: tests/gpu/check.sh [--smoke] OUTDIR" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
: > "$OUT/steps.tsv"
rm -f "$OUT"/junit-*.xml "$OUT/bench-gpu.json" "$OUT/summary.md"
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
VENV=${GPU_CHECK_VENV:-/tmp/mpicoll-gpu-venv}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# step NAME TIMEOUT COMMAND...: run, log to OUTDIR/NAME.log, record status and seconds
step() {
    local name=$1 limit=$2
    shift 2
    local t0 t1 rc
    t0=$(date +%s.%N)
    echo "=== $name: $*" | tee "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    [ "$rc" = 124 ] && echo "*** $name: timed out after $limit s ***" | tee -a "$OUT/$name.log"
    printf '%s\t%d\t%s\n' "$name" "$rc" "$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")" \
        >> "$OUT/steps.tsv"
    return "$rc"
}

install_missing() {
    # mpi4py with a working MPI library and mpirun, pytest and its plugins
    if "$PY" -c "from mpi4py import MPI; import pytest, pytest_timeout, pytest_mpi" \
            >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
        echo "mpi4py, MPI, mpirun and pytest are already there: nothing to install"
        return 0
    fi
    if [ ! -d "$WHEELS" ]; then
        echo "missing $WHEELS: download the wheels first (see the top of tests/gpu/check.sh)"
        return 1
    fi
    "$PY" -m venv --system-site-packages "$VENV" || return 1
    # A venv made from a venv's python sees the base interpreter's packages only: lend the
    # running python's own (numpy, CuPy, torch) after the venv's (mpi4py, MPICH).
    "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        > "$(echo "$VENV"/lib/python3*/site-packages)/zz_mpicoll_lend_packages.pth" || return 1
    "$VENV/bin/python" -m pip install --no-index --find-links "$WHEELS" --ignore-installed \
        --no-deps mpich mpi4py || return 1
    "$VENV/bin/python" -m pip install --no-index --find-links "$WHEELS" \
        pytest pytest-timeout pytest-mpi || return 1
}

if [ "$SMOKE" = 0 ]; then
    export PY WHEELS VENV
    step install 180 bash -c "$(declare -f install_missing); install_missing"
    if [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/mpirun" ]; then
        PY="$VENV/bin/python"
        export PATH="$VENV/bin:$PATH"
        export LD_LIBRARY_PATH="$VENV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi
MPIRUN=$(dirname "$(command -v "$PY")")/mpirun
[ -x "$MPIRUN" ] || MPIRUN=$(command -v mpirun || echo mpirun)
MPIRUN_ARGS=()
if "$MPIRUN" --version 2>/dev/null | grep -q "Open MPI\|OpenRTE"; then
    MPIRUN_ARGS=(--oversubscribe)
fi

environment() {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)" \
         "($(git status --porcelain 2>/dev/null | wc -l) changed files)"
    echo "host: $(uname -srm), $(nproc) cores"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])')"
    echo "mpirun: $MPIRUN"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    else
        echo "nvidia-smi: not found"
    fi
    echo "mode: $([ "$SMOKE" = 1 ] && echo smoke || echo full)"
}
environment > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

step info 120 "$PY" -m mpicoll.info
"$PY" -m mpicoll.info --json > "$OUT/info.json" 2>/dev/null

if [ "$SMOKE" = 1 ]; then
    SERIAL=(tests/gpu/test_gpu_cuda.py)
    SIZES=(1 2)
    MPI_SUITE=tests/gpu/mpi/test_gpu_cupy.py
    BENCH=(--device sim -m 4K:64K -i 3 -x 1)
else
    SERIAL=(tests/gpu tests/torch/test_torch_dist_cuda.py
            --ignore=tests/gpu/test_gpu_check_script.py)
    SIZES=(1 2 4)
    MPI_SUITE=tests/gpu/mpi
    BENCH=(-m 4K:256M -i 10 -x 2 --iterations-large 5)
fi

step serial 240 "$PY" -m pytest -q -rs -p no:cacheprovider "${SERIAL[@]}" \
    --junitxml="$OUT/junit-serial.xml"

for n in "${SIZES[@]}"; do
    # rank 0 writes the JUnit XML (the verdict plugin gives every rank every outcome)
    step "mpi-n$n" 150 "$MPIRUN" "${MPIRUN_ARGS[@]}" -n "$n" sh -c '
        r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
        if [ "$r" = 0 ]; then j="$3"; else j=/dev/null; fi
        exec "$0" tests/mpi_rank_entry.py "$1" "$2" --with-mpi -q -rs \
            -p no:cacheprovider --junitxml="$j"' \
        "$PY" "$MPI_SUITE" --timeout=120 "$OUT/junit-mpi-n$n.xml"
done

step bench 150 "$MPIRUN" "${MPIRUN_ARGS[@]}" -n 2 "$PY" -m bench.gpu "${BENCH[@]}" -c \
    --format json --output "$OUT/bench-gpu.json"

"$PY" tests/gpu/check_summary.py "$OUT"
status=$?
echo "summary: $OUT/summary.md"
exit "$status"
