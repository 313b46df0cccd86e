#!/usr/bin/env bash
# The pip-only install, tested: a machine WITHOUT system PETSc and WITHOUT system MPI.
#
#   bash scripts/test_pip_only.sh            # build (or reuse) the venv, then run the checks
#
# 1. a virtual environment at $SLASOLVE_PIP_VENV (default .venv-pip, git-ignored) made
#    WITHOUT system site packages, so the system's petsc4py / mpi4py / numpy are invisible;
# 2. `pip install torch==2.13.0` (the CPU build; $SLASOLVE_TORCH_INDEX, e.g.
#    https://download.pytorch.org/whl/cpu, picks the index on a machine without it), then
#    `pip install .[mpi,test,examples]`: mpi4py>=4 wheels and the `mpich` wheel that they load;
# 3. checks, in that venv: `python -m slasolve` (the install is consistent, no PETSc; a
#    missing MPI library makes it exit 1), the test files with no-PETSc code paths (those marked
#    `petsc` skip; the list below says which and why), the notebook, every example, and under `mpiexec -n 2` (the mpich wheel's
#    launcher) a distributed solve + gradient against SciPy, an example, an exception on
#    one rank ending the job, `python -m slasolve`, and the MPI tests of the torch backend.
#
# Idempotent: the venv is rebuilt only when pyproject.toml or the install recipe changed (a
# stamp holds their hash); slasolve itself is reinstalled (no dependencies, a few seconds) on
# every run so the checks see the working tree. Install time and venv size are printed.
# Environment: SLASOLVE_PIP_PYTHON (the python3.11 to make the venv with), SLASOLVE_PIP_REBUILD=1.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${SLASOLVE_PIP_VENV:-$here/.venv-pip}
torch_spec=${SLASOLVE_TORCH:-torch==2.13.0}
extras=${SLASOLVE_PIP_EXTRAS:-mpi,test,examples}
say() { printf '== pip-only: %s\n' "$*"; }
# pip on some machines lists configured local indexes that lack a package: noise, not errors
quiet_pip() { "$py" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; return "${PIPESTATUS[0]}"; }

# ---------------------------------------------------------------- a python with venv
pick_python() {
  local c
  for c in ${SLASOLVE_PIP_PYTHON:-} python3.11 /usr/bin/python3.11 python3 /usr/bin/python3; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}
if ! base_py=$(pick_python); then
  # Debian/Ubuntu: python3 without ensurepip needs python3-venv
  if command -v apt-get >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  base_py=$(pick_python) || { echo "no python3 (>= 3.9) with venv/ensurepip found" >&2; exit 2; }
fi

# ---------------------------------------------------------------- install (when needed)
recipe=1   # bump when the install commands below change
hash=$( { cat "$here/pyproject.toml"; echo "$recipe $torch_spec $extras $base_py"; } | sha256sum | cut -c1-16)
stamp="$venv/.slasolve-pip-only"
py="$venv/bin/python"
if [ "${SLASOLVE_PIP_REBUILD:-0}" != "0" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$hash" ]; then
  say "building $venv with $base_py ($("$base_py" --version 2>&1))"
  rm -rf "$venv"
  t0=$(date +%s)
  "$base_py" -m venv "$venv"            # no --system-site-packages: system PETSc/MPI/numpy invisible
  index=()
  [ -z "${SLASOLVE_TORCH_INDEX:-}" ] || index=(--index-url "$SLASOLVE_TORCH_INDEX")
  quiet_pip install -q ${index[@]+"${index[@]}"} "$torch_spec"
  quiet_pip install -q "$here[$extras]"
  t1=$(date +%s)
  size=$(du -sm "$venv" | cut -f1)
  torch_size=$(du -sm "$venv"/lib/python3*/site-packages/torch | cut -f1)
  echo "$hash" > "$stamp"
  printf 'install %s s, venv %s MB (torch %s MB)\n' "$((t1 - t0))" "$size" "$torch_size" > "$venv/.install-figures"
else
  say "reusing $venv (delete it or set SLASOLVE_PIP_REBUILD=1 to rebuild)"
  quiet_pip install -q --no-deps --no-build-isolation --force-reinstall "$here"
fi
say "$(cat "$venv/.install-figures") [measured when built]"

# ---------------------------------------------------------------- checks
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPLBACKEND=Agg PYTHONUNBUFFERED=1
export PATH="$venv/bin:$PATH"              # mpiexec = the mpich wheel's (hydra)
unset PYTHONPATH
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"                                 # import the installed slasolve, not the checkout
status=0
step() { local what=$1; shift; say "$what"; if ! "$@"; then echo "FAILED: $what" >&2; status=1; fi; }

step "python -m slasolve" "$py" -m slasolve
broken_mpi() {  # mpi4py>=4 told to load a libmpi that is not there: python -m slasolve must fail
  local out rc=0
  out=$(MPI4PY_LIBMPI=/nonexistent/libmpi.so.12 "$py" -m slasolve 2>&1) || rc=$?
  [ "$rc" = 1 ] && grep -q "MPI:      BROKEN" <<<"$out" || { echo "$out"; echo "exit status $rc"; return 1; }
}
step "python -m slasolve with an MPI library that does not load exits 1" broken_mpi
step "no petsc4py, no system site packages" "$py" -c '
import sys, importlib.util as u, slasolve
assert u.find_spec("petsc4py") is None and u.find_spec("slepc4py") is None, "petsc4py is visible"
assert "site-packages" in slasolve.__file__ and sys.prefix != sys.base_prefix, slasolve.__file__
print("slasolve from", slasolve.__file__)'
# the files whose code paths differ without PETSc (the torch backend chosen by default, no
# PETSc options, the configuration report) or whose checks need the pip-resolved NumPy/SciPy/
# mpi4py; test_examples_optim (60 % of this step's time: its examples on the torch backend),
# test_partition and test_fem_elements (NumPy/pymetis/torch only: the same code in both installs)
# run in the main suite, and the examples run below as scripts
tests=(test_no_petsc.py test_config.py test_notebook.py test_sparse.py test_torch_krylov.py
       test_torch_eigen.py test_fem_mesh.py test_fem_assembly.py test_fem_solve.py
       test_dsparse.py test_halo.py test_errors.py test_dtensor.py
       test_taylor.py test_timestepping.py test_heat_inverse.py)
paths=()
for t in "${tests[@]}"; do [ ! -f "$here/tests/$t" ] || paths+=("$here/tests/$t"); done
# test_config's fresh interpreters that hide petsc4py (absent here anyway) or load fake mpi4py /
# petsc4py packages test the same code with the same inputs in both installs: the main suite runs
# them (5 interpreters, ~17 CPU s); the checks above run the real mpi4py without its MPI library
same=()
for t in test_without_petsc4py test_mpi4py_that_cannot_load_mpi test_petsc4py_that_fails_to_import; do
  same+=(--deselect "tests/test_config.py::$t")   # node ids are relative to the checkout (rootdir)
done
step "pytest (tests that need no PETSc; the others skip)" \
  timeout 900 "$py" -m pytest -q --color=no -p no:cacheprovider --with-mpi -rs "${paths[@]}" "${same[@]}"
ex="$here/examples"
step "examples/fem_solve.py" timeout 300 "$py" "$ex/fem_solve.py" --n 16
step "examples/fem_solve.py --check (elasticity)" timeout 300 "$py" "$ex/fem_solve.py" --check --problem elasticity --n 4
step "examples/inverse_conductivity.py" timeout 300 "$py" "$ex/inverse_conductivity.py" --n 12 --iters 5
step "examples/topology_optimisation.py" timeout 300 "$py" "$ex/topology_optimisation.py" --nelx 24 --nely 8 --iters 5
step "examples/heat_inverse.py --check" timeout 300 "$py" "$ex/heat_inverse.py" --check
cat > "$work/mpi_check.py" <<'EOF'
# A distributed solve on every rank, checked against SciPy on the whole matrix.
import numpy as np, scipy.sparse as sp, scipy.sparse.linalg as spla, torch
from mpi4py import MPI
import slasolve
comm = MPI.COMM_WORLD
n = 20
D = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], (n, n))
A = (sp.kron(sp.identity(n), D) + sp.kron(D, sp.identity(n))).tocsr()
b_glob = np.arange(1.0, n * n + 1)
dA = slasolve.DSparseTensor.from_global(A, comm)          # contiguous rows: global order
lo, hi = dA.row_range
b = torch.as_tensor(b_glob[lo:hi]).requires_grad_()
x, info = slasolve.solve(dA, b, "cg", rtol=1e-12, return_info=True)
ref = spla.spsolve(A.tocsc(), b_glob)[lo:hi]
err = comm.allreduce(float(np.abs(x.detach().numpy() - ref).max()), op=MPI.MAX)
slasolve.global_sum(x.sum()).backward()                  # adjoint solve, distributed
gref = spla.spsolve(A.T.tocsc(), np.ones(n * n))[lo:hi]
gerr = comm.allreduce(float(np.abs(b.grad.numpy() - gref).max()), op=MPI.MAX)
assert comm.Get_size() == 2 and info.backend == "torch" and err < 1e-8 and gerr < 1e-8, (err, gerr, info)
if comm.Get_rank() == 0:
    print(f"mpiexec -n 2: {' '.join(MPI.Get_library_version().split()[:3])}; backend {info.backend}, "
          f"{info.iterations} its, max error {err:.1e}, grad error {gerr:.1e}: OK")
EOF
step "mpiexec -n 2 (the mpich wheel)" timeout 300 "$venv/bin/mpiexec" -n 2 "$py" "$work/mpi_check.py"
step "mpiexec -n 2 examples/fem_solve.py" timeout 300 "$venv/bin/mpiexec" -n 2 "$py" "$ex/fem_solve.py" --n 16
cat > "$work/abort_check.py" <<'EOF'
# An exception on one rank must end the whole job (slasolve's excepthook calls MPI_Abort).
from mpi4py import MPI
import slasolve  # noqa: F401
if MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("boom on rank 1")
MPI.COMM_WORLD.Barrier()
EOF
abort_check() {
  local out rc=0
  out=$(timeout 60 "$venv/bin/mpiexec" -n 2 "$py" "$work/abort_check.py" 2>&1) || rc=$?
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -q "boom on rank 1" <<<"$out" \
    || { echo "$out"; echo "exit status $rc (124: hung)"; return 1; }
}
step "mpiexec -n 2: an exception on one rank aborts the job" abort_check
step "mpiexec -n 2 python -m slasolve" timeout 120 "$venv/bin/mpiexec" -n 2 "$py" -m slasolve
mpi_tests=()
for t in test_config.py test_torch_krylov.py test_torch_eigen.py test_dsparse.py test_halo.py test_errors.py \
         test_fem_solve.py test_dtensor.py; do [ ! -f "$here/tests/$t" ] || mpi_tests+=("$here/tests/$t"); done
step "mpiexec -n 2 pytest -m mpi (torch backend; other ranks log to .pytest-mpi/ in a temporary folder)" \
  env PYTHON="$py" timeout 900 "$venv/bin/mpiexec" -n 2 "$here/scripts/mpi_pytest.sh" -q --color=no \
  -p no:cacheprovider --with-mpi -m mpi "${mpi_tests[@]}"

if [ $status -eq 0 ]; then say "all checks passed"; else say "some checks FAILED"; fi
exit $status
