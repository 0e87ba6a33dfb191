#!/usr/bin/env bash
# .ci/slurm/stop.sh - cancel this cluster's jobs, then stop the slurmd and slurmctld that
# .ci/slurm/start.sh started, by the PIDs in their pid files only (never by name).
set -uo pipefail
BASE=${MPICOLL_SLURM_DIR:-/tmp/mpicoll-slurm}
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"
export SLURM_CONF=$BASE/slurm.conf
log() { echo "[ci-slurm-stop] $*" >&2; }

stop_pid() { # name pidfile
  local name=$1 pf=$2 p
  [ -s "$pf" ] || { log "$name: no pid file"; return 0; }
  p=$(cat "$pf")
  if ! kill -0 "$p" 2>/dev/null; then log "$name: not running"; rm -f "$pf"; return 0; fi
  if [ "$(cat /proc/"$p"/comm 2>/dev/null)" != "$name" ]; then log "$name: pid $p is not $name, leaving it"; return 0; fi
  kill -TERM "$p"
  for _ in $(seq 80); do kill -0 "$p" 2>/dev/null || break; sleep 0.25; done
  if kill -0 "$p" 2>/dev/null; then log "$name: pid $p ignored SIGTERM, SIGKILL"; kill -KILL "$p"; fi
  rm -f "$pf"; log "$name (pid $p) stopped"
}

# 1. cancel jobs so that no slurmstepd (and no MPI rank) is left behind
if [ -f "$SLURM_CONF" ] && [ -s "$BASE/slurmctld.pid" ] && kill -0 "$(cat "$BASE/slurmctld.pid")" 2>/dev/null; then
  ids=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
  if [ -n "$ids" ]; then
    log "cancelling jobs: $(echo $ids)"; timeout 10 scancel $ids 2>/dev/null || true
    for _ in $(seq 60); do [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi
# 2. daemons: node daemon first, then controller (and munged only if start.sh started it)
stop_pid slurmd "$BASE/slurmd.pid"
stop_pid slurmctld "$BASE/slurmctld.pid"
stop_pid munged "$BASE/munged.pid"
rm -f "$BASE/knobs"
