# jobs/common.sh - sourced by every mpicoll job script (not submitted on its own).
#
# Finds the checkout and the venv, activates the venv, and defines:
#   mpicoll_launch PROGRAM [ARGS...]   run a Python program (a path, or "-m module") on every
#                                      task of the job (or of a step: MPICOLL_STEP_NTASKS)
#   mpicoll_check_world [N]            launch jobs/check_world.py: fail unless the MPI world
#                                      size equals N (default SLURM_NTASKS)
#
# Environment (all optional):
#   MPICOLL_ROOT      the mpicoll checkout            (default: $SLURM_SUBMIT_DIR, i.e.
#                                                      submit from the checkout's root)
#   MPICOLL_VENV      venv to activate                (default: $MPICOLL_ROOT/.venv;
#                                                      "none": use the Python on PATH, e.g.
#                                                      after `module load`)
#   MPICOLL_LAUNCHER  srun | mpirun                   (default srun)
#   MPICOLL_SRUN_MPI  srun's --mpi plugin             (default pmi2: what the MPICH wheel
#                                                      speaks; pmix for an Open MPI built
#                                                      with PMIx, or your site's default)
#   MPICOLL_MPIRUN    mpirun executable               (default: mpirun on PATH after
#                                                      activating the venv)
#   MPICOLL_PYTHON    Python executable               (default: python on PATH)

set -euo pipefail

MPICOLL_ROOT=${MPICOLL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
MPICOLL_VENV=${MPICOLL_VENV:-$MPICOLL_ROOT/.venv}
MPICOLL_LAUNCHER=${MPICOLL_LAUNCHER:-srun}
MPICOLL_SRUN_MPI=${MPICOLL_SRUN_MPI:-pmi2}
export MPICOLL_ROOT MPICOLL_VENV MPICOLL_LAUNCHER

if [ ! -f "$MPICOLL_ROOT/mpicoll/__init__.py" ]; then
  echo "ERROR: MPICOLL_ROOT=$MPICOLL_ROOT is not an mpicoll checkout; submit from the" \
       "checkout's root or set MPICOLL_ROOT" >&2
  exit 2
fi
if [ "$MPICOLL_VENV" != none ]; then
  if [ ! -f "$MPICOLL_VENV/bin/activate" ]; then
    echo "ERROR: no venv at MPICOLL_VENV=$MPICOLL_VENV (create it as README.md says, or set" \
         "MPICOLL_VENV, or MPICOLL_VENV=none to use the Python on PATH)" >&2
    exit 2
  fi
  # shellcheck disable=SC1091
  . "$MPICOLL_VENV/bin/activate"
fi
MPICOLL_PYTHON=${MPICOLL_PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$MPICOLL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$MPICOLL_ROOT"

echo "== ${SLURM_JOB_NAME:-job} ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}" \
     "restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
     "nodes=${SLURM_JOB_NUM_NODES:-1} ntasks=${SLURM_NTASKS:-?}" \
     "tasks-per-node=${SLURM_TASKS_PER_NODE:-?} at $(date -u +%FT%TZ)"
echo "== python $MPICOLL_PYTHON, venv $MPICOLL_VENV, launcher $MPICOLL_LAUNCHER" \
     "$([ "$MPICOLL_LAUNCHER" = srun ] && echo "--mpi=$MPICOLL_SRUN_MPI")"

# MPICH names its node-local shared-memory segments after the PMI job id, which under
# `srun --mpi=pmi2` is "<job id>.<step id>": /dev/shm/mpich_shm_<FNV-1a hash>_<node>.  A
# rank killed by a requeue (or preemption) leaves its segment behind, and after the requeue
# the same job id numbers its steps from 0 again, so the new step with the same id attaches
# to the stale segment and MPI_Init fails ("Message truncated", UCX "failed to unpack
# address").  mpicoll_clean_stale_shm removes this job's own leftover segments (and only
# those) on every node of the allocation; it runs by itself when the job is a restart.
_mpicoll_fnv1a() {  # FNV-1a 32-bit of $1 in hex, as MPICH's HASH_FNV and "%x"
  local s=$1 h=2166136261 i c
  for (( i = 0; i < ${#s}; i++ )); do
    printf -v c '%d' "'${s:i:1}"
    h=$(( ((h ^ c) * 16777619) & 0xffffffff ))
  done
  printf '%x' "$h"
}
mpicoll_clean_stale_shm() {
  local steps=${1:-100} s names=()
  for (( s = 0; s < steps; s++ )); do
    names+=("$(_mpicoll_fnv1a "$SLURM_JOB_ID.$s")")
  done
  # one task per node, not an MPI program
  srun --mpi=none --ntasks="${SLURM_JOB_NUM_NODES:-1}" --ntasks-per-node=1 \
    bash -c 'n=0; for h in "$@"; do for f in /dev/shm/mpich_shm_${h}_* /dev/shm/mpich_vci_${h}_*; do
               [ -e "$f" ] && rm -f "$f" && n=$((n + 1)); done; done
             [ "$n" = 0 ] || echo "== $(hostname): removed $n stale MPICH segment(s) of job '"$SLURM_JOB_ID"'"' \
    _ "${names[@]}"
}
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ "$MPICOLL_LAUNCHER" = srun ]; then
  mpicoll_clean_stale_shm
fi

mpicoll_launch() {
  local n=${MPICOLL_STEP_NTASKS:-${SLURM_NTASKS:?not inside a Slurm job (no SLURM_NTASKS)}}
  case "$MPICOLL_LAUNCHER" in
    srun)
      # --kill-on-bad-exit: one failing rank ends the step; python -m mpi4py aborts the
      # whole MPI job on an uncaught exception instead of leaving the others waiting
      srun --mpi="$MPICOLL_SRUN_MPI" --kill-on-bad-exit=1 --ntasks="$n" \
        "$MPICOLL_PYTHON" -m mpi4py "$@" ;;
    mpirun)
      # MPICH's mpirun (hydra) reads the allocation's nodes from Slurm and starts its
      # proxies with srun; Open MPI's mpirun does the same
      "${MPICOLL_MPIRUN:-mpirun}" -n "$n" "$MPICOLL_PYTHON" -m mpi4py "$@" ;;
    *)
      echo "ERROR: MPICOLL_LAUNCHER must be srun or mpirun, not '$MPICOLL_LAUNCHER'" >&2
      return 2 ;;
  esac
}

mpicoll_check_world() {
  local n=${1:-${MPICOLL_STEP_NTASKS:-$SLURM_NTASKS}}
  MPICOLL_STEP_NTASKS=$n mpicoll_launch "$MPICOLL_ROOT/jobs/check_world.py" --expect "$n"
}
