#!/usr/bin/env bash
# mpirun with the project's venv python: scripts/mpirun.sh -n 4 examples/fem_solve.py [args]
# Adds what this kind of machine needs: running as root, more ranks than cores.
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
n=1
if [ "${1:-}" = "-n" ] || [ "${1:-}" = "-np" ]; then n=$2; shift 2; fi
extra=()
if [ "$(id -u)" -eq 0 ]; then extra+=(--allow-run-as-root); fi
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec timeout "${SLASOLVE_MPI_TIMEOUT:-1800}" mpirun "${extra[@]}" --oversubscribe --bind-to none -n "$n" "$py" "$@"
