"""On several ranks the Jacobian Mat of ``nonlinear_solve``'s kept SNES carries
``MAT_NO_OFF_PROC_ENTRIES``: every write into it is of the writing rank's own rows (the tangent's
values in its CSR, the backward's tangent at the solution), so each assembly skips the off-process
stash's reduction (one per Jacobian). The answers, residual histories and Newton / linear iteration
counts equal a raw petsc4py SNES's on the same NumPy kernels whose Mat lacks the option, for the
``slasolve.fem`` kernels and for the problems' own methods; a write to another rank's row raises on
that rank (PETSc's check: never dropped); the backward, which writes into the same Mat, agrees with
central differences. One rank: the option is not set (no stash there)."""
import math

import numpy as np
import pytest
import torch

import slasolve
from mpi4py import MPI

from nl_problems import F64, diffusion

pytestmark = [pytest.mark.mpi, pytest.mark.petsc]
GAMG = dict(method="gmres", pc="gamg", rtol=1e-10)


def _kept(sp):
    """The SNES solvers kept on the layout of the space's Jacobian."""
    return sp.template._layout.cache("nonlinear_solvers")


def _raw_snes(P, u0, comm):
    """``(u, residual history, Newton steps, linear iterations)`` of a raw petsc4py SNES (newtonls +
    bt, GMRES + GAMG as ``nonlinear_solve`` configures them; its Mat without the option) whose
    callbacks run the problem's NumPy kernels."""
    from slasolve.petsc import PETSc, create_petsc_mat
    residual_into, tangent_values = P.iterate_kernels(P.residual, P.jacobian, ())
    J0 = P.jacobian(u0)
    A = create_petsc_mat(J0, "aij")
    assert not (comm.Get_size() > 1 and A.getOption(PETSc.Mat.Option.NO_OFF_PROC_ENTRIES))
    indptr = J0.local.indptr.numpy().astype(PETSc.IntType)
    indices = J0.local.indices.numpy().astype(PETSc.IntType)
    X = PETSc.Vec().createMPI((u0.shape[0], PETSc.DECIDE), comm=comm)
    F = X.duplicate()

    def function(snes, x, f):
        out = f.getArray()
        residual_into(x.getArray(readonly=True).copy(), out)
        del out

    def jacobian(snes, x, J, Pm):
        Pm.setValuesCSR(indptr, indices, tangent_values(x.getArray(readonly=True).copy()),
                        PETSc.InsertMode.INSERT_VALUES)
        Pm.assemble()

    snes = PETSc.SNES().create(comm=comm)
    snes.setType("newtonls")
    snes.setFunction(function, F)
    snes.setJacobian(jacobian, A)
    snes.setTolerances(rtol=1e-10, atol=0.0, stol=0.0, max_it=50)
    snes.setMaxFunctionEvaluations(-1)
    snes.setConvergenceHistory()
    ksp = snes.getKSP()
    ksp.setType("gmres")
    ksp.setPCSide(PETSc.PC.Side.RIGHT)
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.getPC().setType("gamg")
    ksp.setTolerances(rtol=1e-10, atol=0.0, divtol=1e300, max_it=10000)
    opts = PETSc.Options()
    opts["snes_linesearch_type"] = "bt"
    try:
        snes.setFromOptions()
    finally:
        opts.delValue("snes_linesearch_type")
    X.setArray(u0.numpy())
    snes.solve(None, X)
    assert snes.getConvergedReason() > 0
    hist, lits = snes.getConvergenceHistory()
    out = (torch.from_numpy(X.getArray(readonly=True).copy()), [float(h) for h in hist],
           snes.getIterationNumber(), snes.getLinearSolveIterations())
    for obj in (snes, A, X, F):
        obj.destroy()
    return out


def _rel(comm, a, b):
    num = comm.allreduce(float(((a - b) ** 2).sum()), op=MPI.SUM)
    den = comm.allreduce(float((b ** 2).sum()), op=MPI.SUM)
    return math.sqrt(num / den)


@pytest.mark.parametrize("kernels", [True, False])
def test_same_answers_and_counts_as_a_raw_snes(comm, kernels, monkeypatch):
    """The kernels' path and the methods' path (``iterate_kernels`` switched off) on the kept SNES,
    twice (the second call on the kept SNES and Mat), against a raw SNES on the kernels."""
    from slasolve.fem import NonlinearDiffusion
    from slasolve.petsc import PETSc
    sp, P = diffusion(comm)
    u0 = sp.zeros()
    ref, ref_hist, ref_its, ref_lits = _raw_snes(P, u0, comm)
    if not kernels:   # the methods' path: SNES calls P.residual / P.jacobian (checked, torch)
        monkeypatch.setattr(NonlinearDiffusion, "iterate_kernels", lambda self, *a: None)
        monkeypatch.setattr(NonlinearDiffusion, "start_error", lambda self, *a: (False, None))
    _kept(sp).clear()
    for _ in range(2):
        u, info = slasolve.nonlinear_solve(P.residual, u0, jacobian=P.jacobian, rtol=1e-10, linear_solver=GAMG,
                                           return_info=True)
        assert info.converged and info.iterations == ref_its == 4
        assert info.function_evaluations == 5 and info.jacobian_evaluations == 4
        # the second call's GAMG keeps the first's prolongators: its linear solves differ at their
        # tolerance (1e-10), so the iterates agree to about that, not bit for bit
        assert _rel(comm, u, ref) <= 1e-8
        assert np.allclose(info.residual_history, ref_hist, rtol=1e-6, atol=1e-9 * ref_hist[0])
        (solver,) = _kept(sp).values()
        assert solver.Jmat.getOption(PETSc.Mat.Option.NO_OFF_PROC_ENTRIES) == (comm.Get_size() > 1)
    assert abs(info.linear_iterations - ref_lits) <= 1   # GAMG kept from the first call's last tangent
    _kept(sp).clear()


def test_a_write_to_another_ranks_row_raises(comm):
    """Every rank writes one entry of the next rank's first row into the kept Mat: PETSc raises on
    each rank at the write (a local check: nothing is sent, nothing dropped)."""
    from slasolve.petsc import PETSc
    if comm.Get_size() == 1:
        pytest.skip("no other rank's rows on one rank")
    sp, P = diffusion(comm)
    _kept(sp).clear()
    slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10, linear_solver=GAMG)
    (solver,) = _kept(sp).values()
    A = solver.Jmat
    n = A.getSize()[0]
    row = A.getOwnershipRange()[1] % n    # the next rank's first row (the last rank: rank 0's)
    PETSc.Sys.pushErrorHandler("ignore")
    try:
        with pytest.raises(PETSc.Error):
            A.setValue(row, row, 1.0, PETSc.InsertMode.INSERT_VALUES)
    finally:
        PETSc.Sys.popErrorHandler()
    _kept(sp).clear()   # drop that SNES: its Mat saw a rejected write
    comm.Barrier()


def test_backward_through_the_kept_mat_matches_central_differences(comm):
    """``J = sum u^2`` over the ranks as a function of a per-cell conductivity: the backward (the
    tangent at the solution written into the kept Mat, the transposed solve on the Newton KSP)
    against central differences along a fixed direction."""
    sp, P = diffusion(comm)
    _kept(sp).clear()
    x = sp.cell_coords.mean(1)
    kappa = (1.0 + 0.5 * x[:, 0] + 0.25 * x[:, 1]).to(F64)
    d = torch.cos(3.0 * x[:, 0]) * torch.sin(2.0 * x[:, 1] + 0.3)

    def loss(k):
        u = slasolve.nonlinear_solve(P.residual, sp.zeros(), k, jacobian=P.jacobian, rtol=1e-12,
                                     linear_solver=GAMG)
        return slasolve.global_sum((u ** 2).sum(), comm)

    k = kappa.clone().requires_grad_()
    loss(k).backward()
    slope = comm.allreduce(float((k.grad * d).sum()), op=MPI.SUM)
    h = 1e-5
    with torch.no_grad():
        fd = (float(loss(kappa + h * d)) - float(loss(kappa - h * d))) / (2 * h)
    assert abs(slope - fd) <= 1e-6 * abs(fd)
    _kept(sp).clear()
