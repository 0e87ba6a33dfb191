# cluster/slurm.sh - Slurm on the namespace cluster (sourced by cluster/cluster; not run alone).
#
#   cluster/cluster slurm-up          slurmctld on head, one slurmd per node n1..nN
#   cluster/cluster slurm CMD...      a Slurm client (sbatch, squeue, sinfo, scontrol, srun)
#                                     on head, with this cluster's SLURM_CONF
#   cluster/cluster slurm-down        cancel jobs, stop the daemons (cluster down does it too)
#
# Config: $STATE/slurm/slurm.conf from cluster/slurm.conf.template (@...@ replaced).
# auth/none (no munge), SlurmUser=root, proctrack/linuxproc, task/none, MpiDefault=pmi2 (the
# MPICH wheel speaks PMI-2), %n in the slurmd spool/pid/log paths so several slurmd share one
# host.  Each daemon runs in its node's namespaces (entered with nsenter, not `ip netns
# exec`, which remounts /sys and hides the cgroup mounts), so every node has its own
# hostname, address, /etc/hosts, /dev/shm, IPC and (slurmd, and so the job's tasks) PID
# namespace.  The ports are in the namespaces' own network stacks: no clash with another
# Slurm on the host.  A slurmd's pid file holds its PID inside its node (host_pid maps it).

SLURM_DIR="$STATE/slurm"

slurm_client() {  # slurm_client CMD...: run a client on head with this cluster's config
  SLURM_CONF="$SLURM_DIR/slurm.conf" enter_node head "$@"
}

slurm_up() {
  [ -e "$STATE/nodes" ] || die "the cluster is not up (cluster up first)"
  local t
  for t in slurmctld slurmd sbatch scontrol sinfo; do
    command -v "$t" >/dev/null || cannot "Slurm is not installed ('$t' not found; apt-get install slurm-wlm, or .ci/slurm/start.sh installs it)"
  done
  local plugdir
  plugdir=$(dirname "$(ls /usr/lib/*/slurm-wlm/auth_none.so /usr/lib*/slurm/auth_none.so 2>/dev/null | head -1)")
  [ -e "$plugdir/auth_none.so" ] && [ -e "$plugdir/cred_none.so" ] ||
    cannot "this Slurm has no auth/none and cred/none plugins"
  if [ -e "$SLURM_DIR/slurmctld.pid" ] && kill -0 "$(cat "$SLURM_DIR/slurmctld.pid")" 2>/dev/null; then
    log "slurm: already up"; return 0
  fi
  mkdir -p "$SLURM_DIR"/{state,log,spool}
  local nodes slots names
  nodes=$(grep -c '^n[0-9]' "$STATE/nodes")
  slots=$(sed -n 's/^slots=//p' "$STATE/config")
  names="n[1-$nodes]"; [ "$nodes" = 1 ] && names=n1
  {
    sed -e "s|@BASE@|$SLURM_DIR|g" -e "s|@HEADADDR@|$NET.254|g" "$HERE/slurm.conf.template"
    local i
    for i in $(seq 1 "$nodes"); do
      echo "NodeName=n$i NodeAddr=$NET.$i CPUs=$slots State=UNKNOWN"
    done
    echo "PartitionName=main Nodes=$names Default=YES MaxTime=INFINITE State=UP"
  } > "$SLURM_DIR/slurm.conf"
  # -c: start clean (no jobs or node state from an earlier run)
  enter_node head slurmctld -c -f "$SLURM_DIR/slurm.conf" \
    </dev/null >>"$SLURM_DIR/log/slurmctld.stdout" 2>&1 || die "slurmctld failed to start"
  local end=$((SECONDS + 30))
  until slurm_client timeout 5 scontrol ping 2>/dev/null | grep -q UP; do
    [ $SECONDS -lt $end ] || die "slurmctld does not answer: $(tail -5 "$SLURM_DIR/log/slurmctld.log" 2>/dev/null)"
    sleep 0.3
  done
  for i in $(seq 1 "$nodes"); do
    enter_node "n$i" slurmd -f "$SLURM_DIR/slurm.conf" -N "n$i" \
      </dev/null >>"$SLURM_DIR/log/slurmd-n$i.stdout" 2>&1 || die "slurmd on n$i failed to start"
  done
  end=$((SECONDS + 60))
  local st=""
  while [ $SECONDS -lt $end ]; do
    st=$(slurm_client timeout 10 sinfo -h -o %T 2>/dev/null | sort -u | tr '\n' ' ')
    [ "$st" = "idle " ] && break
    case $st in *drain*|*down*|*inval*) slurm_client timeout 10 scontrol update nodename="$names" state=resume >/dev/null 2>&1 || true ;; esac
    sleep 0.5
  done
  [ "$st" = "idle " ] || die "slurm nodes not idle after 60 s (states: $st); logs in $SLURM_DIR/log"
  local hosts
  hosts=$(slurm_client timeout 60 srun -N "$nodes" --ntasks-per-node 1 -t 1 hostname | sort | tr '\n' ' ') ||
    die "'srun -N $nodes hostname' failed"
  log "slurm up: slurmctld on head, slurmd on $names; srun -N $nodes hostname -> $hosts; clients: cluster/cluster slurm sbatch|squeue|sinfo ..."
}

slurm_down() {
  [ -e "$SLURM_DIR/slurm.conf" ] || return 0
  local pf p ids
  if [ -s "$SLURM_DIR/slurmctld.pid" ] && kill -0 "$(cat "$SLURM_DIR/slurmctld.pid")" 2>/dev/null; then
    ids=$(slurm_client timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086
      slurm_client timeout 10 scancel $ids 2>/dev/null || true
      local end=$((SECONDS + 20))
      while [ $SECONDS -lt $end ] && [ -n "$(slurm_client timeout 10 squeue -h -o %i 2>/dev/null)" ]; do sleep 0.5; done
    fi
  fi
  # node daemons first, then the controller; by their pid files (a slurmd's holds its PID
  # inside its node), checked by name; a node whose holder is gone has lost them already
  local node
  for pf in "$SLURM_DIR"/slurmd-*.pid "$SLURM_DIR/slurmctld.pid"; do
    [ -s "$pf" ] || continue
    node=$(basename "$pf" .pid); node=${node#slurmd-}; [ "$node" != slurmctld ] || node=head
    if p=$(host_pid "$node" "$(cat "$pf")"); then
      case $(cat "/proc/$p/comm" 2>/dev/null) in
        slurmd|slurmctld) kill_pids "$p" ;;
      esac
    fi
    rm -f "$pf"
  done
  log "slurm down"
}
