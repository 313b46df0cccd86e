#!/usr/bin/env bash
# The whole test suite: serial, then under mpirun -n 2 and -n 4, each under a timeout.
# Usage: bash scripts/test.sh [extra pytest args]
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export PYTHON=${PYTHON:-$here/.venv/bin/python}
if [ ! -x "$PYTHON" ]; then echo "no $PYTHON: run scripts/install.sh first" >&2; exit 2; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# more ranks than cores: let idle ranks yield instead of spinning in MPI waits
export OMPI_MCA_mpi_yield_when_idle=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPLBACKEND=Agg PYTHONUNBUFFERED=1
status=0
echo "== serial (1 process, MPI tests at size 1)"
timeout 900 "$PYTHON" -m pytest -q --color=no --with-mpi -p no:cacheprovider "$@" || status=1
for n in 2 4; do
  echo "== mpirun -n $n (MPI tests)"
  timeout 900 mpirun -n "$n" --oversubscribe --bind-to none \
    "$here/scripts/mpi_pytest.sh" -q --color=no --with-mpi -m mpi -p no:cacheprovider "$@" || {
      status=1; echo "mpirun -n $n failed; other ranks' logs:"; tail -n 30 .pytest-mpi/*.log 2>/dev/null; }
done
if [ $status -eq 0 ]; then echo "all test runs passed"; else echo "some test runs FAILED"; fi
exit $status
