"""CG + GAMG under the default ``reuse_pc`` (``"interpolation"``): GAMG keeps its prolongators *and*
its smoothers' eigenvalue estimates across value changes (PETSc's default, as DOLFINx), and a
kept preconditioner that the new values defeat is rebuilt and the solve redone.

Checks: a reusing solve makes no eigenvalue estimate (PETSc's ``KSPSetUp`` does no
floating-point work: the estimates are the Lanczos steps made there), every answer is SciPy's
``spsolve`` on the current values (small changes, a large SIMP-like change that the kept
estimates were not made for, and back), and the reported residual passes the stopping test.
Run serially and under mpirun -n 2 / 3 with --with-mpi.
"""
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.testing import simp_mbb_system, spsolve_reference

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD


def _rel_err(x, ref, comm):
    err = comm.allreduce(float(((x - ref) ** 2).sum()))
    nrm = comm.allreduce(float((ref ** 2).sum()))
    return (err / nrm) ** 0.5


def _setup_flops():
    """PETSc's KSPSetUp floating-point work so far, over every log stage (slasolve logs its
    solves in stages of its own)."""
    from petsc4py import PETSc
    ev = PETSc.Log.Event("KSPSetUp")
    total = 0.0
    for st in range(64):
        try:
            total += ev.getPerfInfo(st)["flops"]
        except Exception:
            break
    return COMM.allreduce(total)


def test_default_reuse_keeps_estimates_and_stays_right():
    from petsc4py import PETSc
    PETSc.Log.begin()
    system, mesh = simp_mbb_system(COMM, 60, 20)
    nc = mesh.n_local_cells
    off = sum(COMM.allgather(nc)[:COMM.rank])
    n = COMM.allreduce(nc)
    g = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)[off:off + nc]
    rough = 0.05 + 0.95 * g ** 2        # SIMP (rho^3): stiffness over four decades
    designs = [torch.full((nc,), 0.5), torch.full((nc,), 0.55), 0.5 + 0.1 * g, rough, 0.9 * rough,
               torch.full((nc,), 0.5)]
    kept_setup_flops = []
    for k, rho in enumerate(designs):
        K, f = system(rho)
        before = _setup_flops()
        u, info = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, return_info=True)
        reuse = info.pc_reuse or {}
        assert info.converged, info.summary()
        assert reuse.get("mode") == "interpolation"
        if k > 0 and not reuse.get("rebuilt"):
            kept_setup_flops.append(_setup_flops() - before)
        ref = spsolve_reference(K, f, COMM)
        # rtol 1e-10 on a matrix with condition number < 1e7 here: 1e-3 leaves room for any BLAS
        assert _rel_err(u, ref, COMM) <= 1e-3, (k, info.summary())
        r = f - K @ u
        rn = COMM.allreduce(float((r ** 2).sum())) ** 0.5
        fn = COMM.allreduce(float((f ** 2).sum())) ** 0.5
        assert rn <= max(1e-10 * fn, info.floor or 0.0) * 1.0001, (k, rn / fn)
    # the small changes right after the first build reuse it, and no reusing set-up estimated
    assert kept_setup_flops, "no solve kept the preconditioner"
    assert all(fl == 0.0 for fl in kept_setup_flops), kept_setup_flops
