#!/usr/bin/env bash
# Open MPI as the launcher. flatshard::init() reads OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
# LOCAL_SIZE. Across nodes pass the master:
#   MASTER_ADDR=node0 examples/launch/mpirun.sh -np 8 -H node0:4,node1:4 PROGRAM [ARGS...]
set -euo pipefail
export MASTER_PORT="${MASTER_PORT:-29500}"
# The job's secret (docs/launching.md#the-jobs-secret-no-one-joins-who-does-not-belong).
export FLATSHARD_JOB_SECRET="${FLATSHARD_JOB_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
if [[ -n "${MASTER_ADDR:-}" ]]; then
  exec mpirun -x MASTER_ADDR -x MASTER_PORT -x FLATSHARD_JOB_SECRET -x OMP_NUM_THREADS=1 "$@"
fi
exec mpirun -x MASTER_PORT -x FLATSHARD_JOB_SECRET -x OMP_NUM_THREADS=1 "$@"
