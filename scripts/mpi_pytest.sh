#!/usr/bin/env bash
# Run pytest on every MPI rank; rank 0 prints, the others log to .pytest-mpi/rank-N.log.
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
if [ "$rank" = "0" ]; then
  exec "$PYTHON" -m pytest "$@"
else
  mkdir -p .pytest-mpi
  exec "$PYTHON" -m pytest "$@" > ".pytest-mpi/rank-$rank.log" 2>&1
fi
