#!/usr/bin/env bash
# Install slasolve and everything it needs on a fresh Debian/Ubuntu machine.
# Idempotent: a second run skips what is already there.
#   system: PETSc/SLEPc (real, with hypre/MUMPS/GAMG), petsc4py, slepc4py, mpi4py, OpenMPI,
#           h5py built with MPI (parallel XDMF/HDF5 mesh writes)
#   python: a venv at $SLASOLVE_VENV (default .venv) that sees the system petsc4py,
#           with torch, numpy pinned to the system's 1.x (petsc4py is built against it),
#           and the test / example / benchmark extras.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${SLASOLVE_VENV:-$here/.venv}
sysdeps="python3-petsc4py python3-petsc4py-real python3-slepc4py python3-slepc4py-real
python3-mpi4py python3-numpy python3-scipy libpetsc-real-dev libslepc-real-dev openmpi-bin
libopenmpi-dev python3-venv python3-dev python3-h5py-mpi"

missing=()
for p in $sysdeps; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
# numpy stays at the system's 1.x: petsc4py is compiled against it.
npver=$(/usr/bin/python3 -c 'import numpy; print(numpy.__version__)')
cons="$venv/constraints.txt"
printf 'numpy==%s\n' "$npver" > "$cons"
if [ -f /etc/xdg/pip/constraints.txt ]; then cat /etc/xdg/pip/constraints.txt >> "$cons"; fi
stamp="$venv/.slasolve-installed"
if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
  "$py" -m pip install -q --upgrade pip >/dev/null
  "$py" -m pip install -q -c "$cons" "torch==2.13.0"
  "$py" -m pip install -q -c "$cons" -e "$here[test,examples,bench,docs]"
  touch "$stamp"
fi
"$py" -c "import slasolve, petsc4py, slepc4py, mpi4py, torch; print('slasolve', slasolve.__version__, '| torch', torch.__version__, '| petsc4py', petsc4py.__version__)"
