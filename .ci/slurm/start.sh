#!/usr/bin/env bash
# .ci/slurm/start.sh - install (if missing) and start a real one-node Slurm for CI on this
# machine, then wait until the node is idle and `srun true` works.  Idempotent: if our
# cluster is already up with the same settings it only re-checks it.
#
# Debian/Ubuntu with apt, run as root, no systemd needed.  The cluster is private to this
# project: its own config file, state directory and ports, so it never touches
# /etc/slurm/slurm.conf or another Slurm on the machine.  Clients find it through
# SLURM_CONF, which this script writes to $MPICOLL_SLURM_DIR/env:
#
#     .ci/slurm/start.sh && . /tmp/mpicoll-slurm/env && sbatch jobs/train.sbatch
#
# Exit status: 0 ready; 77 Slurm cannot be installed or run here (not root, no apt-get,
# or apt failed) - callers skip; anything else: installed but failed to start (a real
# failure).
#
# Env knobs:
#   MPICOLL_SLURM_DIR      config/state/log/pid directory  (default /tmp/mpicoll-slurm)
#   MPICOLL_SLURM_CPUS     CPUs declared for the node      (default max(8, nproc): 8-task
#                          jobs run even on 2 cores)
#   MPICOLL_SLURM_PORT     slurmctld port; slurmd uses PORT+1 (default 6837)
#   MPICOLL_SLURM_TIMEOUT  seconds to wait for an idle node (default 120)
set -euo pipefail

BASE=${MPICOLL_SLURM_DIR:-/tmp/mpicoll-slurm}
NPROC=$(nproc)
CPUS=${MPICOLL_SLURM_CPUS:-$(( NPROC > 8 ? NPROC : 8 ))}
PORT=${MPICOLL_SLURM_PORT:-6837}
TIMEOUT=${MPICOLL_SLURM_TIMEOUT:-120}
CONF=$BASE/slurm.conf
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"
export SLURM_CONF=$CONF
T0=$(date +%s.%N)
log() { echo "[ci-slurm +$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s] $*" >&2; }
die() { log "ERROR: $*"; for f in "$BASE"/log/*.log; do [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 25 "$f" >&2; }; done; exit 1; }
cannot() { log "SKIP: $*"; exit 77; }
# alive PIDFILE: the pid in it runs and is the daemon the file is named after (pid reuse guard)
alive() { local p; p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] && kill -0 "$p" 2>/dev/null &&
          [ "$(cat /proc/"$p"/comm 2>/dev/null)" = "$(basename "$1" .pid)" ]; }
H=$(hostname -s)

# ------------------------------------------------------------ 0. already up?
KNOBS="host=$H cpus=$CPUS port=$PORT"
if alive "$BASE/slurmctld.pid" && alive "$BASE/slurmd.pid" &&
   [ "$(cat "$BASE/knobs" 2>/dev/null)" = "$KNOBS" ] &&
   [[ "$(timeout 10 sinfo -h -n "$H" -o %T 2>/dev/null)" =~ ^(idle|mixed|allocated)$ ]]; then
  log "already running (slurmctld $(cat "$BASE/slurmctld.pid"), slurmd $(cat "$BASE/slurmd.pid"))"
  exit 0
fi

# ------------------------------------------------------------ 1. packages
# the daemons run as root (SlurmUser=root) and the install needs apt
[ "$(id -u)" = 0 ] || cannot "not root: cannot install slurm-wlm or run slurmctld/slurmd here"
if ! { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null; }; then
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get"
  log "installing slurm-wlm"
  # keep package postinst scripts from starting munge/slurmd through init.d
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1; fi
  export DEBIAN_FRONTEND=noninteractive
  ok=0
  for try in 1 2 3; do
    if timeout 300 apt-get update -q >/dev/null &&
       timeout 600 apt-get install -y -q --no-install-recommends slurm-wlm >/dev/null; then ok=1; break; fi
    log "apt attempt $try failed"; [ "$try" -lt 3 ] && sleep $((try * 5))
  done
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$ok" = 1 ] || cannot "apt-get install slurm-wlm failed (no package mirror reachable?)"
  log "installed slurm-wlm $(dpkg-query -W -f '${Version}' slurm-wlm 2>/dev/null)"
fi

# ------------------------------------------------------------ 2. auth
mkdir -p "$BASE"/{ctld,d,log}
plugdir=$(dirname "$(ls /usr/lib/*/slurm-wlm/select_linear.so /usr/lib*/slurm/select_linear.so 2>/dev/null | head -1)")
if [ -e "$plugdir/auth_none.so" ] && [ -e "$plugdir/cred_none.so" ]; then
  AUTH=none
  AUTHLINES=$'AuthType=auth/none\nCredType=cred/none'
else
  AUTH=munge
  AUTHLINES=$'AuthType=auth/munge\nCredType=cred/munge'
  if ! (munge -n | unmunge) >/dev/null 2>&1; then
    log "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none; }
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do (munge -n | unmunge) >/dev/null 2>&1 && break; sleep 0.2; done
    (munge -n | unmunge) >/dev/null 2>&1 || die "munged does not work"
    cp /run/munge/munged.pid "$BASE/munged.pid" 2>/dev/null || true
  fi
fi

# ------------------------------------------------------------ 3. config
getent hosts "$H" >/dev/null || { log "adding $H to /etc/hosts"; echo "127.0.0.1 $H" >> /etc/hosts; }
MEM=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p'); MEM=$(( ${MEM:-2048} * 9 / 10 ))
NEWCONF=$(cat <<CONF
# generated by mpicoll .ci/slurm/start.sh -- one-node CI cluster
ClusterName=mpicollci
SlurmctldHost=${H}(127.0.0.1)
${AUTHLINES}
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${PORT}
SlurmdPort=$((PORT + 1))
StateSaveLocation=${BASE}/ctld
SlurmdSpoolDir=${BASE}/d
SlurmctldPidFile=${BASE}/slurmctld.pid
SlurmdPidFile=${BASE}/slurmd.pid
SlurmctldLogFile=${BASE}/log/slurmctld.log
SlurmdLogFile=${BASE}/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# accept the declared CPUs even though the hardware has fewer cores
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# the MPICH wheel speaks PMI-2 (srun --mpi=pmix does not work with it)
MpiDefault=pmi2
ReturnToService=2
# reject impossible jobs at submit time instead of leaving them PENDING forever
EnforcePartLimits=ALL
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
JobRequeue=1
NodeName=${H} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEWCONF" ]; then
  printf '%s\n' "$NEWCONF" > "$CONF"
  log "wrote $CONF (node $H, CPUs=$CPUS on $NPROC cores, auth/$AUTH, port $PORT)"
  for d in slurmd slurmctld; do   # a config change needs a restart of what still runs
    if alive "$BASE/$d.pid"; then p=$(cat "$BASE/$d.pid"); kill -TERM "$p"
      for _ in $(seq 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.25; done
      kill -0 "$p" 2>/dev/null && kill -KILL "$p"; fi
  done
fi
printf 'export SLURM_CONF=%s\n' "$CONF" > "$BASE/env"

# ------------------------------------------------------------ 4. daemons
for d in slurmctld slurmd; do alive "$BASE/$d.pid" || rm -f "$BASE/$d.pid"; done
if ! alive "$BASE/slurmctld.pid"; then
  # -c: start clean (no jobs or node state left from an earlier run)
  slurmctld -c -f "$CONF" </dev/null >>"$BASE/log/slurmctld.stdout" 2>&1 || die "slurmctld failed to start"
fi
for _ in $(seq 100); do timeout 5 scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
timeout 5 scontrol ping 2>/dev/null | grep -q UP || die "slurmctld does not answer"
if ! alive "$BASE/slurmd.pid"; then
  slurmd -f "$CONF" </dev/null >>"$BASE/log/slurmd.stdout" 2>&1 || die "slurmd failed to start"
fi

# ------------------------------------------------------------ 5. wait for idle
end=$(( $(date +%s) + TIMEOUT )); st=""
while [ "$(date +%s)" -lt "$end" ]; do
  st=$(timeout 10 sinfo -h -n "$H" -o %T 2>/dev/null || true)
  case "$st" in
    idle) break ;;
    drain*|drng*|down*|inval*|fail*)
      timeout 10 scontrol update nodename="$H" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 0.5
done
[ "$st" = idle ] || die "node $H not idle after ${TIMEOUT}s (state '$st')"
timeout 60 srun -N1 -n1 -t 1 true || die "smoke test 'srun true' failed"
echo "$KNOBS" > "$BASE/knobs"
log "ready: node $H idle, CPUs=$CPUS, auth/$AUTH, SLURM_CONF=$CONF (slurmctld $(cat "$BASE/slurmctld.pid"), slurmd $(cat "$BASE/slurmd.pid"))"
