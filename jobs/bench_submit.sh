#!/usr/bin/env bash
# Submit the benchmark sweep (a job array over collectives x world sizes) and the job that
# collects its results, which starts only when every array task succeeded.
#
#     jobs/bench_submit.sh [extra sbatch options for the sweep, e.g. --ntasks=16 -p short]
#
# Reads BENCH_COLLECTIVES, BENCH_WORLD_SIZES, BENCH_ARGS, BENCH_RESULTS (see
# jobs/bench_sweep.sbatch); run it from the checkout's root (or set MPICOLL_ROOT).
# Prints "sweep <array job id>" and "collect <job id>" and the results directory.
set -euo pipefail
root=${MPICOLL_ROOT:-$PWD}
read -r -a collectives <<< "${BENCH_COLLECTIVES:-allreduce reduce_scatter allgather broadcast}"
read -r -a sizes <<< "${BENCH_WORLD_SIZES:-8}"
n=$(( ${#collectives[@]} * ${#sizes[@]} ))
max=0; for s in "${sizes[@]}"; do [ "$s" -gt "$max" ] && max=$s; done
export BENCH_COLLECTIVES="${collectives[*]}" BENCH_WORLD_SIZES="${sizes[*]}"
# --ntasks from the largest world size (later options given on the command line win)
sweep=$(sbatch --parsable --array="0-$((n - 1))" --ntasks="$max" "$@" "$root/jobs/bench_sweep.sbatch")
sweep=${sweep%%;*}
results=${BENCH_RESULTS:-$root/bench-results/$sweep}
collect=$(BENCH_RESULTS=$results sbatch --parsable --dependency="afterok:$sweep" \
          --kill-on-invalid-dep=yes "$root/jobs/bench_collect.sbatch")
collect=${collect%%;*}
echo "sweep $sweep"
echo "collect $collect"
echo "results $results"
