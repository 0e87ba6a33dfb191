#!/usr/bin/env bash
# Submit the benchmark sweep (a job array over collectives x world sizes) and the job that
# collects its results, which starts only when every array task succeeded.
#
#     jobs/bench_submit.sh [extra sbatch options for the sweep, e.g. --ntasks=16 -p short]
#
# Reads BENCH_COLLECTIVES, BENCH_WORLD_SIZES, BENCH_ARGS, BENCH_RESULTS (see
# jobs/bench_sweep.sbatch) and BENCH_LOG_DIR (where the jobs' logs go [the current
# directory]); run it from the checkout's root (or set MPICOLL_ROOT).
# Prints "sweep <array job id>" and "collect <job id>" and the results directory.
set -euo pipefail
root=${MPICOLL_ROOT:-$PWD}
read -r -a collectives <<< "${BENCH_COLLECTIVES:-allreduce reduce_scatter allgather broadcast}"
ntasks=()
if [ -n "${BENCH_WORLD_SIZES:-}" ]; then
  read -r -a sizes <<< "$BENCH_WORLD_SIZES"
  max=0; for s in "${sizes[@]}"; do [ "$s" -gt "$max" ] && max=$s; done
  ntasks=(--ntasks="$max")   # enough for the largest size; a later --ntasks in "$@" wins
  export BENCH_WORLD_SIZES="${sizes[*]}"
else
  sizes=(all)                # one size: the job's --ntasks (8 in its header, or yours)
fi
n=$(( ${#collectives[@]} * ${#sizes[@]} ))
export BENCH_COLLECTIVES="${collectives[*]}"
logs=${BENCH_LOG_DIR:-$PWD}
mkdir -p "$logs"
sweep=$(sbatch --parsable --array="0-$((n - 1))" "${ntasks[@]}" -o "$logs/%x-%A_%a.out" "$@" \
        "$root/jobs/bench_sweep.sbatch")
sweep=${sweep%%;*}
results=${BENCH_RESULTS:-$root/bench-results/$sweep}
collect=$(BENCH_RESULTS=$results sbatch --parsable --dependency="afterok:$sweep" \
          --kill-on-invalid-dep=yes -o "$logs/%x-%j.out" "$root/jobs/bench_collect.sbatch")
collect=${collect%%;*}
echo "sweep $sweep"
echo "collect $collect"
echo "results $results"
