"""Faults under mpirun: a job must end (non-zero), never hang (README "MPI", docs/decisions.md).

These tests run serially (not marked mpi): each launches its own small
``mpirun -n 2`` / ``-n 3`` job under ``timeout`` and checks how it ends. Exit
status 124 (or 137) means the job hung until the timeout: always a failure. The
limit (90 s) is far above a job's run time on a quiet machine (2-5 s) because under load its
ranks can spend 20-30 s importing torch and PETSc before the fault happens (a 25 s limit failed
at load ~11): it tells a hang from a slow start, not fast from slow.

Each job costs its ranks' start-up (importing torch, PETSc and slasolve: ~3.5 CPU s a
process), so scenarios that end neither the job nor need an environment or command line of
their own share one: the PETSc-on-one-rank and bad-vector scenarios run one after the other in
one 2-rank job (``shared_job``), the one-process hooks and PETSc command-line checks in one
interpreter (``one_process``); each test still asserts its own scenario's output. The jobs that
end in an abort, an exit status or a killed rank, or that need their own environment, have one
job each.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

MPIRUN = shutil.which("mpirun")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="needs mpirun")


def _env(**extra):
    # drop the MPI job variables of this (possibly singleton-MPI) pytest process: the
    # child mpirun must start a job of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLASOLVE_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mpirun(n, script, *args, timeout=90, tmp_path=None, **env):
    """Run ``script`` (source text) on ``n`` ranks; returns (returncode, output, hung)."""
    path = os.path.join(tmp_path, "job.py")
    with open(path, "w") as fh:
        fh.write(textwrap.dedent(script))
    cmd = ["timeout", "-k", "5", str(timeout), MPIRUN, "--oversubscribe", "--bind-to", "none", "-n", str(n),
           sys.executable, path, *args]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), cwd=tmp_path,
                         timeout=timeout + 30)
    hung = out.returncode == 124 or time.monotonic() - t0 >= timeout
    return out.returncode, out.stdout + out.stderr, hung


def assert_ended(rc, out, hung, nonzero=True):
    assert not hung, f"the job hung (killed by timeout):\n{out[-3000:]}"
    if nonzero:
        assert rc != 0, f"the job exited 0:\n{out[-3000:]}"


# ------------------------------------------------------------------ abort on unhandled exception
@needs_mpirun
def test_exception_on_one_rank_aborts_the_job(tmp_path):
    rc, out, hung = mpirun(2, """
        import slasolve
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        comm.allreduce(1)
        if comm.rank == 1:
            raise RuntimeError("boom on rank 1")
        comm.allreduce(1)          # rank 0 would wait here forever
    """, tmp_path=tmp_path)
    assert_ended(rc, out, hung)
    assert "RuntimeError: boom on rank 1" in out        # the traceback is printed first
    assert "unhandled RuntimeError on rank 1" in out


@needs_mpirun
def test_sys_exit_nonzero_on_one_rank_aborts_the_job(tmp_path):
    rc, out, hung = mpirun(2, """
        import sys, slasolve
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            sys.exit(3)
        comm.allreduce(1)
    """, tmp_path=tmp_path)
    assert_ended(rc, out, hung)
    assert "called sys.exit(3)" in out and "rank(s) 0 did not reach" in out


@needs_mpirun
def test_rank_killed_mid_solve_ends_the_job(tmp_path):
    rc, out, hung = mpirun(2, """
        import os, signal, torch, slasolve
        from mpi4py import MPI
        from slasolve.testing import poisson_matrix
        comm = MPI.COMM_WORLD
        A = slasolve.DSparseTensor.from_global(poisson_matrix((20, 20)), comm)
        b = torch.ones(A.n_local, dtype=torch.float64)
        for it in range(1000):
            if it == 3 and comm.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            x = slasolve.solve(A, b, "cg", rtol=1e-8)
    """, tmp_path=tmp_path)
    assert_ended(rc, out, hung)


# ------------------------------------------------------------------ exit watchdog
@needs_mpirun
def test_backward_on_some_ranks_only_is_reported_and_aborted(tmp_path):
    """Ranks 0 and 1 call backward() (collective); rank 2 ends instead: its exit
    watchdog names the missing ranks and aborts the job."""
    rc, out, hung = mpirun(3, """
        import torch, slasolve
        from mpi4py import MPI
        from slasolve.testing import poisson_matrix
        comm = MPI.COMM_WORLD
        A = slasolve.DSparseTensor.from_global(poisson_matrix((12, 12)), comm)
        b = torch.ones(A.n_local, dtype=torch.float64, requires_grad=True)
        x = slasolve.solve(A, b, "cg", rtol=1e-10)
        loss = slasolve.global_sum((x * x).sum())
        if comm.rank != 2:
            loss.backward()
    """, tmp_path=tmp_path, SLASOLVE_EXIT_TIMEOUT=3)
    assert_ended(rc, out, hung)
    assert "rank 2 of 3 ended normally, but rank(s) 0-1 did not reach the end" in out
    assert "SLASOLVE_EXIT_TIMEOUT" in out


# Two scenarios in one 2-rank job; their lines carry the scenario's name (the launcher may
# interleave the ranks' lines), and rank 0 prints "END name" once every rank has finished it.
# The PETSc one runs first: it needs the first PETSc use of a fresh process. The bad-vector one
# runs last: it may end the job (an abort), which the other must not depend on.
SHARED_JOB = """
    import torch, slasolve
    from mpi4py import MPI
    from slasolve.testing import poisson_matrix
    comm = MPI.COMM_WORLD
    try:
        import petsc4py
    except ImportError:
        petsc4py = None

    def end(name):
        comm.Barrier()
        if comm.rank == 0:
            print(f"END {name}", flush=True)

    # --- petsc_use_on_one_rank: rank 0 alone makes the process's first PETSc use
    if petsc4py is not None:
        ok = 1
        if comm.rank == 0:
            S = slasolve.SparseTensor.from_scipy(poisson_matrix((6, 6)))
            x, info = slasolve.cg(S, torch.ones(36, dtype=torch.float64), pc="ilu", backend="torch", rtol=1e-10)
            ok = int(info.converged)
        every = comm.allreduce(ok) == comm.size
        if comm.rank == 0:   # one write: the ranks' output may interleave within a line
            print(f"petsc_use_on_one_rank: converged on every rank: {every}", flush=True)
        end("petsc_use_on_one_rank")

    # --- bad_vector_on_one_rank: a wrong-length x on rank 1 in A @ x
    A = slasolve.DSparseTensor.from_global(poisson_matrix((8, 8)), comm)
    x = torch.ones(A.n_local + (1 if comm.rank == 1 else 0), dtype=torch.float64)
    try:
        y = A @ x
    except ValueError as e:
        print(f"bad_vector_on_one_rank: rank {comm.rank}: ValueError: {e}", flush=True)
    end("bad_vector_on_one_rank")
"""


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    """The 2-rank job of ``SHARED_JOB``: (returncode, output, hung)."""
    if MPIRUN is None:
        pytest.skip("needs mpirun")
    return mpirun(2, SHARED_JOB, tmp_path=tmp_path_factory.mktemp("shared_job"), SLASOLVE_EXIT_TIMEOUT=3)


@needs_mpirun
def test_bad_vector_on_one_rank_never_hangs(shared_job):
    """A wrong-length x on one rank in A @ x: either every rank raises ValueError, or the
    job ends non-zero (the rank that raised alone exits, its watchdog aborts). The last
    scenario of ``shared_job``."""
    rc, out, hung = shared_job
    assert_ended(rc, out, hung, nonzero=False)
    assert rc != 0 or ("bad_vector_on_one_rank: rank 0: ValueError" in out and
                       "bad_vector_on_one_rank: rank 1: ValueError" in out and
                       "END bad_vector_on_one_rank" in out), out[-3000:]


@needs_mpirun
def test_petsc_use_on_one_rank_only_in_a_fresh_process(shared_job):
    """Rank 0 alone makes the first PETSc use of a fresh process (the torch backend's
    ILU(0) is factored by PETSc) while rank 1 has already moved on to the next
    collective. PETSc's start-up is collective; it happened at import, so this is a
    purely local operation and the job goes on (lazily it hung): the first scenario of
    ``shared_job``, which every rank finishes."""
    pytest.importorskip("petsc4py")
    rc, out, hung = shared_job
    assert not hung, f"the job hung (killed by timeout):\n{out[-3000:]}"
    assert "END petsc_use_on_one_rank" in out and \
        "petsc_use_on_one_rank: converged on every rank: True" in out, out[-3000:]


# ------------------------------------------------------------------ opt-outs
HOOKS = """
    import sys, time, slasolve
    from slasolve import _faults
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    print(f"rank {rank}: hook={sys.excepthook is _faults._excepthook} exit={sys.exit is _faults._exit} "
          f"watchdog={_faults._state.watchdog} timeout={_faults._state.timeout:g}", flush=True)
    slasolve.abort_on_unhandled_exception(False)
    print(f"rank {rank}: after False: hook={sys.excepthook is _faults._excepthook} "
          f"exit={sys.exit is _faults._exit}", flush=True)
    slasolve.abort_on_unhandled_exception(True)
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        time.sleep(2)       # ranks may finish a little apart, also with a non-zero status
    sys.exit(3)
"""


@needs_mpirun
def test_hooks_installed_by_default_and_removable(tmp_path):
    """Default: hooks on, removable and re-installable; ranks that all call sys.exit(3),
    2 s apart, end the job cleanly with status 3 (no abort)."""
    rc, out, hung = mpirun(2, HOOKS, tmp_path=tmp_path)
    assert_ended(rc, out, hung)
    assert rc == 3 and "MPI_ABORT" not in out, out[-3000:]
    for r in range(2):
        assert f"rank {r}: hook=True exit=True watchdog=True timeout=600" in out
        assert f"rank {r}: after False: hook=False exit=False" in out


@needs_mpirun
def test_opt_out_env_vars(tmp_path):
    rc, out, hung = mpirun(2, HOOKS, tmp_path=tmp_path, SLASOLVE_ABORT_ON_EXCEPTION=0, SLASOLVE_EXIT_TIMEOUT=0)
    assert_ended(rc, out, hung)
    assert rc == 3, out[-3000:]
    for r in range(2):
        assert f"rank {r}: hook=False exit=False watchdog=True timeout=0" in out


# One plain process (no mpirun) with PETSc options on its command line: what import slasolve
# installed (nothing, at one rank) and what PETSc read from the command line.
ONE_PROCESS = """
import sys, slasolve
from slasolve import _faults
print("installed:", sys.excepthook is sys.__excepthook__, _faults._state.watchdog, sys.exit is _faults._exit)
try:
    from petsc4py import PETSc
except ImportError:
    PETSc = None
if PETSc is not None:
    ksp = PETSc.KSP().create(PETSc.COMM_SELF)
    ksp.setFromOptions()
    print("petsc:", PETSc.Options().getString("ksp_type"), ksp.getType(), PETSc.Options().getReal("ksp_rtol"),
          PETSc.Options().hasName("n"))
"""


@pytest.fixture(scope="module")
def one_process():
    """``ONE_PROCESS`` run as ``python -c ... -ksp_type gmres --n 5 -ksp_rtol 1e-3``:
    {"installed": [...], "petsc": [...]} (the words after each label)."""
    out = subprocess.run([sys.executable, "-c", ONE_PROCESS, "-ksp_type", "gmres", "--n", "5", "-ksp_rtol", "1e-3"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in out.stdout.splitlines() if ":" in line}


def test_one_rank_installs_nothing(one_process):
    assert one_process["installed"] == ["True", "False", "False"], one_process


def test_previous_excepthook_is_chained():
    from slasolve import _faults

    seen = []
    previous = _faults._state.previous_hook
    try:
        _faults._state.previous_hook = lambda *a: seen.append(a[0])
        abort = _faults._state.abort
        _faults._state.abort = False        # chain only; do not abort this pytest process
        _faults._excepthook(KeyError, KeyError("x"), None)
        _faults._state.abort = abort
    finally:
        _faults._state.previous_hook = previous
    assert seen == [KeyError]


# ------------------------------------------------------------------ PETSc command line
def test_petsc_sees_command_line_options(one_process):
    pytest.importorskip("petsc4py")
    assert one_process["petsc"] == ["gmres", "gmres", "0.001", "False"], one_process


def test_petsc_initialised_by_the_user_first_is_left_alone():
    pytest.importorskip("petsc4py")
    code = textwrap.dedent("""
        import sys, petsc4py
        petsc4py.init(["prog", "-ksp_type", "bcgs"])
        import slasolve
        from petsc4py import PETSc
        print(PETSc.Options().getString("ksp_type"), PETSc.Options().hasName("ksp_monitor"))
    """)
    out = subprocess.run([sys.executable, "-c", code, "-ksp_monitor"], capture_output=True, text=True,
                         timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["bcgs", "False"]


def test_split_petsc_args():
    from slasolve._process import split_petsc_args

    args = ["--n", "8", "-ksp_monitor", "-ksp_type", "gmres", "--check", "-ksp_rtol", "1e-8", "-log_view",
            "--young", "-1", "-pc_type=gamg", "-help"]
    petsc, rest = split_petsc_args(args, ["--n", "--check", "--young", "-h"])
    assert petsc == ["-ksp_monitor", "-ksp_type", "gmres", "-ksp_rtol", "1e-8", "-log_view", "-pc_type=gamg",
                     "-help"]
    assert rest == ["--n", "8", "--check", "--young", "-1"]
    assert split_petsc_args(["-h", "-x"], ["-h", "-x"]) == ([], ["-h", "-x"])


def test_petsc_argv_leaves_out_long_options():
    from slasolve._process import petsc_argv

    argv = ["prog", "--n", "8", "-ksp_monitor", "--check", "-ksp_type", "gmres", "--version", "--out=x",
            "-log_view", "--young", "-1", "-pc_type", "gamg"]
    assert petsc_argv(argv) == ["prog", "-ksp_monitor", "-ksp_type", "gmres", "-log_view", "-pc_type", "gamg"]
    # PETSc reads the single-dash options exactly as in the full command line
    assert petsc_argv(["p", "-ksp_monitor", "--n", "8", "-a", "1"]) == ["p", "-ksp_monitor", "-a", "1"]


# ------------------------------------------------------------------ examples' command lines
@needs_mpirun
def test_example_passes_petsc_options_through(tmp_path):
    pytest.importorskip("petsc4py")
    rc, out, hung = mpirun(2, open(os.path.join(ROOT, "examples", "fem_solve.py")).read(), "--n", "8",
                           "-ksp_monitor", "-ksp_converged_reason", tmp_path=tmp_path, timeout=60)
    assert rc == 0, out[-3000:]
    assert "KSP Residual norm" in out and "L2 error" in out


def test_example_rejects_unknown_options():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fem_solve.py"), "--n", "8", "--bogus",
                          "-ksp_monitor"], capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 2, out.stderr[-3000:]
    assert "unrecognized arguments: --bogus" in out.stderr and "single dash" in out.stderr
