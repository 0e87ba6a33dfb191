#!/usr/bin/env bash
# .ci/slurm/wait.sh JOBID [TIMEOUT_S] - wait for a job (and all its array tasks) to leave
# the queue, polling squeue every 0.5 s (`sbatch --wait` backs off to 10 s polls).
# Exit status: the job's exit code (the largest over array tasks; 128+signal for a job
# killed by a signal), 124 on timeout (the job is then cancelled), 2 on bad usage.
# Needs SLURM_CONF (. /tmp/mpicoll-slurm/env) for the CI cluster.
[ -n "${1:-}" ] || { echo "usage: $0 JOBID [TIMEOUT_S]" >&2; exit 2; }
id=$1; to=${2:-600}; end=$(( $(date +%s) + to ))
while timeout 10 squeue -h -j "$id" -o %i 2>/dev/null | grep -q .; do
  [ "$(date +%s)" -ge "$end" ] && { timeout 10 scancel "$id"; echo "job $id timed out after ${to}s" >&2; exit 124; }
  sleep 0.5
done
rc=0
for ec in $(timeout 10 scontrol -o show job "$id" 2>/dev/null | grep -o ' ExitCode=[0-9]*:[0-9]*' | cut -d= -f2); do
  c=${ec%%:*}; s=${ec##*:}; [ "$s" != 0 ] && c=$((128 + s)); [ "$c" -gt "$rc" ] && rc=$c
done
exit $rc
