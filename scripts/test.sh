#!/usr/bin/env bash
# The whole test suite: serial (every test once in one process, on pytest-xdist workers, one per
# core, when it is installed; SLASOLVE_XDIST=0: one process), then under mpirun -n 2 (tests marked
# mpi but not property), the eigen and SciPy-suite tests again under other BLAS kernels
# (SLASOLVE_SKIP_KERNELS=1 skips it), -n 3 (the property tests) and -n 4 (the files whose logic depends on the
# rank count beyond 2: RANKS4_FILES below; docs/testing.md says which and why), so every test runs
# at 1 rank, every MPI test at 2 ranks but the property tests, which run at 1, 3 and 8; then the
# property tests and the tests marked scale at 8 ranks oversubscribed
# (SLASOLVE_SKIP_SCALE=1 skips it; SLASOLVE_SCALE_RANKS="16 32" adds more rank counts), each
# under a timeout.
# The HTML docs with warnings as errors (SLASOLVE_SKIP_DOCS=1 skips them) and the pip-only
# install check, scripts/test_pip_only.sh (SLASOLVE_SKIP_PIP_ONLY=1 skips it), run in the
# background during the serial runs; their output is printed when they end. Every step prints
# its wall time and its CPU time (user + sys of the step's processes).
# Python's bytecode (and pytest's rewritten test modules) are cached in .pycache/ of the checkout
# even where the environment sets PYTHONDONTWRITEBYTECODE (SLASOLVE_PYCACHE=0: as the environment says).
# Usage: bash scripts/test.sh [--property-full] [extra pytest args]
#   --property-full (or SLASOLVE_PROPERTY_FULL=1): the full property set, many hypothesis
#   examples per property with shrinking, instead of the CI slice (docs/testing.md);
#   the runs' timeouts grow to SLASOLVE_TEST_TIMEOUT (default 7200 s).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export PYTHON=${PYTHON:-$here/.venv/bin/python}
if [ ! -x "$PYTHON" ]; then echo "no $PYTHON: run scripts/install.sh first" >&2; exit 2; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# more ranks than cores: let idle ranks yield instead of spinning in MPI waits
export OMPI_MCA_mpi_yield_when_idle=1
# the cores (GNU nproc reports OMP_NUM_THREADS where it is set)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPLBACKEND=Agg PYTHONUNBUFFERED=1
# Without a bytecode cache (PYTHONDONTWRITEBYTECODE=1 in some CI images) every pytest process, one
# per rank and step, compiles slasolve and rewrites every test module's asserts again: collecting
# the suite took 13.7 CPU s instead of 7.1. The cache lives in the checkout (git-ignored), so
# nothing is written beside the sources or into the venv.
if [ "${SLASOLVE_PYCACHE:-1}" != "0" ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$here/.pycache}
fi
args=()
full=${SLASOLVE_PROPERTY_FULL:-0}
for a in "$@"; do
  if [ "$a" = "--property-full" ]; then full=1; else args+=("$a"); fi
done
run_timeout=${SLASOLVE_TEST_TIMEOUT:-900}
if [ "$full" != "0" ]; then
  export SLASOLVE_PROPERTY_FULL=1
  run_timeout=${SLASOLVE_TEST_TIMEOUT:-7200}
  args+=("-o" "timeout=$run_timeout")   # pytest-timeout's per-test limit (pyproject: 300 s)
fi
# test paths given on the command line replace the steps' own (the property files, ...)
user_paths=0
for a in ${args[@]+"${args[@]}"}; do [ -e "${a%%::*}" ] && user_paths=1; done
status=0
# the slowest tests of every run, for the next look at the suite's time (SLASOLVE_DURATIONS=0: none)
durations="--durations=${SLASOLVE_DURATIONS:-12} --durations-min=1"
bg_log=$(mktemp -d)   # the background checks' log; the CPU counters below
# cpu_mark: cpu = the CPU seconds (user + sys) of this shell's finished children so far (bash's
# `times`, called in this process: a subshell would count its own children only)
cpu_mark() {
  local f="$bg_log/times.$BASHPID"   # this shell's pid: $(...) below runs in a subshell
  times > "$f" 2>/dev/null || { cpu=0; return; }
  cpu=$(awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); sub("s", "", a[2]); t += a[1] * 60 + a[2] }
             printf "%.0f", t }' "$f")
  rm -f "$f"
}
# took WHAT T0 C0: one line with the step's wall time (SECONDS since T0) and CPU time (since cpu_mark gave C0)
took() { cpu_mark; echo "   -- $1: $((SECONDS - $2)) s wall, $((cpu - $3)) s CPU"; }
# The docs build and the pip-only check in the background, one after the other, while the
# serial runs below use the cores; their logs are printed at the end
background_checks() {
  if [ "${SLASOLVE_SKIP_DOCS:-0}" = "0" ]; then
    # the API reference and guides, warnings as errors (docs/conf.py); SLASOLVE_SKIP_DOCS=1 skips
    local t0=$SECONDS rc=0 cpu; cpu_mark; local c0=$cpu
    echo "== docs (sphinx-build -W, docs/_build/html)"
    if "$PYTHON" -c "import sphinx, numpydoc, myst_parser" 2>/dev/null; then
      timeout "$run_timeout" "$PYTHON" -m sphinx -E -W --keep-going -q -b html docs docs/_build/html \
        || { rc=1; echo "docs build failed (warnings are errors)"; }
    else
      rc=1; echo "docs: sphinx, numpydoc or myst-parser missing: pip install -e '.[docs]' (or SLASOLVE_SKIP_DOCS=1)"
    fi
    took docs "$t0" "$c0"
    [ $rc -eq 0 ] || echo 1 > "$bg_log/failed"
  fi
  if [ "${SLASOLVE_SKIP_PIP_ONLY:-0}" = "0" ]; then
    # a venv without system packages: pip install .[mpi,test,examples] (mpich wheel, no PETSc),
    # tests that need no PETSc, examples, notebook, mpiexec -n 2 (README "pip-only install")
    local t0=$SECONDS cpu; cpu_mark; local c0=$cpu
    echo "== pip-only install (scripts/test_pip_only.sh; SLASOLVE_SKIP_PIP_ONLY=1 skips it)"
    timeout "${SLASOLVE_PIP_ONLY_TIMEOUT:-2400}" bash "$here/scripts/test_pip_only.sh" || {
      echo 1 > "$bg_log/failed"; echo "pip-only install checks failed"; }
    took pip-only "$t0" "$c0"
  fi
}
background_checks > "$bg_log/out" 2>&1 &
bg_pid=$!
t_all=$SECONDS; cpu_mark; c_all=$cpu
# The serial step on pytest-xdist workers, one per core (at most SLASOLVE_XDIST workers;
# SLASOLVE_XDIST=0 or no xdist installed: one process), whole files per worker (--dist loadfile:
# a module's fixtures and caches are built once, tests that start mpirun jobs run one after the
# other as before). One process kept one core busy (417 CPU s for 402 s on a quiet machine)
# while the other did the background checks' ~300 CPU s and then idled.
workers=$cores
[ -z "${SLASOLVE_XDIST:-}" ] || [ "$SLASOLVE_XDIST" -ge "$workers" ] 2>/dev/null || workers=${SLASOLVE_XDIST}
xdist=()
if [ "$workers" -ge 2 ] 2>/dev/null && "$PYTHON" -c "import xdist" 2>/dev/null; then
  xdist=(-n "$workers" --dist loadfile)
  echo "== serial (MPI tests at size 1; $workers pytest-xdist workers, whole files each)"
else
  echo "== serial (1 process, MPI tests at size 1)"
fi
t0=$SECONDS; cpu_mark; c0=$cpu
# the kernels step's files: their MPI tests run there at one rank (other kernels) and at 2 ranks
# (this machine's kernels), not here; their other tests run here and there
kernel_files="tests/scipy_suite tests/test_eigsh.py tests/test_torch_eigen.py tests/test_property_eigsh.py
tests/test_linalg_scipy.py tests/test_eigsh_refine.py tests/test_scipy_defaults.py"
deselect_mpi=""
[ "${SLASOLVE_SKIP_KERNELS:-0}" != "0" ] || deselect_mpi=$kernel_files
serial_only=()
# the 8-rank Poisson check launches its own 8-rank job; the scale step runs it in its ranks instead
if [ "${SLASOLVE_SKIP_SCALE:-0}" = "0" ]; then
  serial_only=(--deselect tests/test_scale.py::test_poisson_solve_8_ranks_matches_1_rank)
fi
SLASOLVE_DESELECT_MPI_IN=$deselect_mpi timeout "$run_timeout" "$PYTHON" -m pytest -q --color=no --with-mpi -p no:cacheprovider $durations \
  ${xdist[@]+"${xdist[@]}"} ${serial_only[@]+"${serial_only[@]}"} ${args[@]+"${args[@]}"} || status=1
took serial "$t0" "$c0"
# run_mpi N MARKS WHAT [scale] [PATHS...]: the marked tests (of PATHS, default the testpaths) on N
# ranks under the timeout; a failure dumps the other ranks' logs
run_mpi() {
  local t0=$SECONDS c0 cpu threads=$OMP_NUM_THREADS per_rank=$(( cores / $1 )) examples=${SLASOLVE_PROPERTY_EXAMPLES:-}
  # threads beyond the cores spin against the other ranks: at most cores/ranks per rank (>= 1)
  [ "$per_rank" -ge 1 ] || per_rank=1
  [ "$threads" -le "$per_rank" ] || threads=$per_rank
  cpu_mark; c0=$cpu
  echo "== mpirun -n $1 ($3; $threads thread(s) per rank)"
  rm -f .pytest-mpi/rank-*.log   # the failure dump below shows this run's ranks only
  # past the cores (scale evidence: answers and no hangs) fewer examples per property than the CI
  # slice, unless given (SLASOLVE_SCALE_EXAMPLES, default 2, and every explicit example: each
  # property and parametrisation runs at 8 ranks; the 3-rank step draws the CI slice; 4 examples
  # took the 8-rank step's torch eigsh properties 13-20 s each, quiet; the full set keeps its own)
  if [ "${4:-}" = "scale" ] && [ -z "$examples" ] && [ "$full" = "0" ]; then examples=${SLASOLVE_SCALE_EXAMPLES:-2}; fi
  # every rank imports and collects what it is given (the whole suite: ~7 CPU s a rank, cached
  # bytecode; the property files alone: ~4.5), so a step that runs a few files names them
  local paths=()
  [ "$user_paths" = 1 ] || paths=("${@:5}")
  SLASOLVE_PROPERTY_EXAMPLES=$examples OMP_NUM_THREADS=$threads timeout "$run_timeout" mpirun -n "$1" --oversubscribe --bind-to none \
    "$here/scripts/mpi_pytest.sh" -q --color=no --with-mpi -m "$2" -p no:cacheprovider $durations \
    ${paths[@]+"${paths[@]}"} ${args[@]+"${args[@]}"} || {
      status=1; echo "mpirun -n $1 failed; other ranks' logs:"; tail -n 30 .pytest-mpi/*.log 2>/dev/null; }
  took "mpirun -n $1" "$t0" "$c0"
}
# 4 ranks on 2 cores cost ~2.5x the 2-rank run of the same tests: at 4 ranks only the files whose
# logic depends on the rank count beyond 2 (layouts, halos, partitions, collective errors, mesh
# distribution, I/O and assembly: docs/testing.md says which and why); the solvers on top of them
# run at 3 and 8 ranks in the property tests, which run at 1, 3 and 8 ranks (not 2: the same
# checks, and an odd count is the harder case), every other MPI test at 1 and 2. A new file runs
# at 1 and 2 ranks (the steps collect tests/, so it is picked up without being named anywhere);
# one that belongs here is added to this list by name (a test of such a file that adds nothing past
# 2 ranks is marked two_ranks).
ranks4_files=(test_dsparse.py test_halo.py test_partition.py test_dtensor.py test_errors.py
              test_spmd_user_code.py test_adjoint_safety.py test_petsc_bridge.py test_observability.py
              test_fem_mesh.py test_fem_meshio.py test_fem_mixed_cells.py test_fem_collapsed_cells.py
              test_fem_facets.py test_fem_assembly.py test_fem_hyperelastic_kernels.py test_fem_solve.py test_nullspace.py
              test_nlx_tangent_memo.py test_nlfix_bound_halo.py
              # the cases issues 19 and 22 name at 1, 2 and 4 ranks: top88 at rtol 1e-12, SciPy's
              # default-success cases (recirc_flow, local_disc, PyAMG's), Taylor tests, time
              # stepping (~66 s wall at 4 ranks here, quiet)
              test_tight_tolerance.py test_scipy_defaults.py test_taylor.py test_timestepping.py)
ranks4_paths=()
for f in "${ranks4_files[@]}"; do
  # a renamed or removed file fails the run instead of silently leaving the 4-rank step
  if [ -f "tests/$f" ]; then ranks4_paths+=("tests/$f"); else echo "ranks4_files: no tests/$f (update scripts/test.sh)"; status=1; fi
done
run_mpi 2 "mpi and not property and not once" "MPI tests but the property ones and those marked once"
# the eigensolver and SciPy-suite tests again under other BLAS/LAPACK kernels and thread counts
# than the machine's own, so a result that holds only on this CPU's kernels fails here, not on the
# next machine (SLASOLVE_SKIP_KERNELS=1 skips it): OpenBLAS (NumPy, SciPy, PETSc) forced to the
# Sandybridge kernels (no FMA; Nehalem where the machine is a Sandybridge), torch's MKL to its
# SSE2 "compatible" code path (MKL_CBWR, which MKL_VERBOSE shows honoured as CNR:COMPATIBLE),
# ATen's vectorised kernels (torch reductions' summation order) to the scalar build
# It runs after the 2-rank step: its 2 OpenBLAS threads spin-wait when another process holds a core,
# and the background checks run on into the step after the serial one: 171 s wall / 502 CPU s
# beside them against ~85 s alone.
if [ "${SLASOLVE_SKIP_KERNELS:-0}" = "0" ]; then
  core=$(OPENBLAS_VERBOSE=2 "$PYTHON" -c "import numpy" 2>&1 | sed -n 's/^Core: //p')
  alt=Sandybridge; [ "$core" = "Sandybridge" ] && alt=Nehalem
  t0=$SECONDS; cpu_mark; c0=$cpu
  echo "== eigen and SciPy-suite tests, other kernels (OpenBLAS $alt, machine's ${core:-unknown}; MKL compatible; ATen default; 2 threads)"
  OPENBLAS_CORETYPE=$alt MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=2 \
    timeout "$run_timeout" "$PYTHON" -m pytest -q --color=no --with-mpi -p no:cacheprovider $durations \
    -m "not once" $kernel_files ${args[@]+"${args[@]}"} || status=1
  took kernels "$t0" "$c0"
fi
run_mpi 3 "mpi and property" "property tests" "" tests/test_property_*.py
run_mpi 4 "mpi and not property and not two_ranks and not once" "the MPI tests of the files whose logic depends on the rank count beyond 2" \
  "" "${ranks4_paths[@]}"
# scale evidence past the machine's cores: the property tests (differential against SciPy/LAPACK:
# the same answers as one rank; SPMD hangs) oversubscribed at 8 ranks by default (SLASOLVE_SKIP_SCALE=1
# skips it) and at the rank counts in SLASOLVE_SCALE_RANKS (opt-in, e.g. "16 32"; docs/testing.md)
scale_ranks=${SLASOLVE_SCALE_RANKS:-}
if [ "${SLASOLVE_SKIP_SCALE:-0}" = "0" ]; then scale_ranks="8 $scale_ranks"; fi
seen=" "
for n in $scale_ranks; do
  case "$seen" in *" $n "*) continue;; esac   # "8" given twice runs once
  seen="$seen$n "
  run_mpi "$n" "mpi and (property or scale)" "property and scale tests, oversubscribed, ${SLASOLVE_SCALE_EXAMPLES:-2} examples each; SLASOLVE_SKIP_SCALE / SLASOLVE_SCALE_RANKS" \
    scale tests/test_property_*.py tests/test_scale.py
done
wait "$bg_pid"
cat "$bg_log/out"
[ ! -f "$bg_log/failed" ] || status=1
took "command (2), the background checks included" "$t_all" "$c_all"
rm -rf "$bg_log"
if [ $status -eq 0 ]; then echo "all test runs passed"; else echo "some test runs FAILED"; fi
exit $status
