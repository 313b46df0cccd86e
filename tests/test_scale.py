"""Correctness at scale: a Poisson solve (and its adjoint gradient) at 8 ranks, oversubscribed,
matches the 1-rank one.

Two tests, the same computation (``poisson_solves``):

* ``test_poisson_solve_matches_1_rank`` (marked ``mpi`` and ``scale``) runs in this process at
  the communicator's size, against the same solve on ``MPI.COMM_SELF``: at 1, 2 and 4 ranks in
  the ordinary runs and at 8 ranks in ``scripts/test.sh``'s scale step, whose ranks are already
  up (no job of its own to start: docs/testing.md);
* ``test_poisson_solve_8_ranks_matches_1_rank`` (serial pass only) launches ``mpirun -n 8
  --oversubscribe`` and a 1-rank job itself (with a timeout), for a plain ``pytest`` run;
  ``scripts/test.sh`` deselects it when its scale step runs the in-process test at 8 ranks.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

NX = 48
KEYS = ("petsc", "torch", "petsc_grad", "torch_grad")


def poisson_solves(comm, nx: int = NX) -> dict:
    """Collective. CG + Jacobi solves of a variable-coefficient 2-D Poisson matrix built from
    each rank's contiguous rows, with both backends, and the gradients of ``sum(x**2)`` with
    respect to ``b`` (adjoint solves); every result gathered on every rank (NumPy arrays)."""
    import torch
    from slasolve.dsparse import DSparseTensor
    from slasolve.krylov import solve

    n = nx * nx
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = np.full(size, n // size)
    counts[: n % size] += 1
    offs = np.concatenate([[0], np.cumsum(counts)])
    i = np.arange(offs[rank], offs[rank + 1])
    ix, iy = i % nx, i // nx
    cand = np.stack([i - nx, i - 1, i, i + 1, i + nx], 1)
    ok = np.stack([iy > 0, ix > 0, np.ones_like(ix, bool), ix < nx - 1, iy < nx - 1], 1)
    # symmetric, diagonally dominant, variable coefficient: off-diagonal -(a_i + a_j)/2
    a = lambda j: 1.0 + 0.5 * np.sin(j)  # noqa: E731
    off = np.where(ok & (cand != i[:, None]), -0.5 * (a(i)[:, None] + a(cand)), 0.0)
    vals = np.where(cand == i[:, None], -off.sum(1)[:, None] + 0.05, off)
    indptr = np.concatenate([[0], np.cumsum(ok.sum(1))])
    A = DSparseTensor.from_local_rows(torch.from_numpy(indptr), torch.from_numpy(cand[ok]),
                                      torch.from_numpy(vals[ok]), (n, n), comm)
    b = torch.from_numpy(np.cos(0.1 * i) + 1.0)
    out = {}
    for backend in ("petsc", "torch"):
        x = solve(A, b, "cg", backend=backend, pc="jacobi", rtol=1e-10)
        out[backend] = A.gather(x, root=None).numpy()
        bb = b.clone().requires_grad_(True)
        y = solve(A, bb, "cg", backend=backend, pc="jacobi", rtol=1e-10)
        (y * y).sum().backward()
        out[backend + "_grad"] = A.gather(bb.grad, root=None).numpy()
    return out


def _compare(r1: dict, rp: dict) -> None:
    for k in KEYS:
        a, b = r1[k], rp[k]
        assert a.shape == b.shape == (NX * NX,)
        assert np.linalg.norm(a - b) <= 1e-7 * np.linalg.norm(a), k
    # backends agree with each other too
    assert np.linalg.norm(rp["petsc"] - rp["torch"]) <= 1e-7 * np.linalg.norm(rp["petsc"])


@pytest.mark.mpi
@pytest.mark.scale
def test_poisson_solve_matches_1_rank(comm):
    pytest.importorskip("petsc4py")
    from mpi4py import MPI
    _compare(poisson_solves(MPI.COMM_SELF), poisson_solves(comm))


SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[2])
    from test_scale import poisson_solves
    out = poisson_solves(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 0:
        np.savez(sys.argv[1], **out)
''')


def _under_mpi(config) -> bool:
    """True inside an mpirun job (the serial pass runs with --with-mpi at size 1 too)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def _run(n, script, out, timeout):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, str(script), str(out),
           os.path.dirname(os.path.abspath(__file__))]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpirun -n {n} did not finish in {timeout} s (hang?)")
    assert p.returncode == 0, f"mpirun -n {n} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return dict(np.load(out))


@pytest.mark.timeout(600)
def test_poisson_solve_8_ranks_matches_1_rank(tmp_path, request):
    if _under_mpi(request.config):
        pytest.skip("serial pass only: this test launches its own mpirun -n 8")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found on PATH: cannot launch the 8-rank job")
    pytest.importorskip("petsc4py")
    script = tmp_path / "solve.py"
    script.write_text(SCRIPT)
    _compare(_run(1, script, tmp_path / "r1.npz", 240), _run(8, script, tmp_path / "r8.npz", 300))
