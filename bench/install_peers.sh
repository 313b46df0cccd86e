#!/usr/bin/env bash
# Optional peers for bench/transient.py --compare: legacy DOLFIN 2019.2 (Debian's python3-dolfin)
# and dolfin-adjoint 2023.0.0 from PyPI (pyadjoint comes inside it) in a venv of their own,
# .venv-dolfin-adjoint (git-ignored), made from the system python that python3-dolfin is built for
# (--system-site-packages: it sees DOLFIN, PETSc 3.18 / petsc4py, NumPy and SciPy from Debian;
# nothing of slasolve's venv). slasolve never imports it; bench/ skips the peer without it.
#
#   bash bench/install_peers.sh            # apt-get (as root) when DOLFIN is missing, then the venv
#
# Why 2023.0.0: dolfin-adjoint 2023.3.0 and later require fenics-ufl-legacy (the module ufl_legacy)
# and pyadjoint-ad, while Debian's DOLFIN 2019.2 is built on the module ufl 2019.2.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${PEER_VENV:-$here/.venv-dolfin-adjoint}
py=/usr/bin/python3

if ! "$py" -c "import dolfin" 2>/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "legacy DOLFIN is missing: run as root (or: sudo apt-get install -y python3-dolfin)" >&2
    exit 1
  fi
  if ! apt-cache show python3-dolfin >/dev/null 2>&1; then apt-get update; fi
  # another apt-get may hold the dpkg lock: wait for it (up to 10 minutes)
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y python3-dolfin
fi
"$py" -c "import dolfin; print('DOLFIN', dolfin.__version__)"

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install -q "dolfin-adjoint==2023.0.0"
(cd /tmp && OMP_NUM_THREADS=1 "$venv/bin/python" -c "
import dolfin, dolfin_adjoint, pyadjoint
print('dolfin-adjoint', dolfin_adjoint.__version__ if hasattr(dolfin_adjoint, '__version__') else '2023.0.0',
      'in', '$venv')")
