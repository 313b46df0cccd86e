"""``nonlinear_solve``'s per-step checks of ``slasolve.fem`` problems done once per solve: inside the
Newton iterations (the solver's own iterates, ``solver_iterate``) a problem's residual checks nothing
again and its Jacobian checks only its values, in one reduction; the answers are those of the
fully checked evaluations, and every error still raises on every rank."""
import math

import pytest
import torch

import slasolve
from mpi4py import MPI
from slasolve.fem import nonlinear as fem_nonlinear
from slasolve.nonlinear.problem import solver_iterate

from nl_problems import F64, LU, diffusion, solid

pytestmark = pytest.mark.mpi
LS = dict(method="gmres", pc="gamg", rtol=1e-10)


def _close(u, ref, comm, rel=1e-10):
    err = comm.allreduce(float((u - ref).abs().max()) if u.numel() else 0.0, op=MPI.MAX)
    scale = comm.allreduce(float(ref.abs().max()) if ref.numel() else 0.0, op=MPI.MAX)
    return err <= rel * scale


class _Counting:
    """Counts the calls of ``slasolve.fem.nonlinear``'s ``check_collective`` (one reduction each)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = fem_nonlinear.check_collective

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(fem_nonlinear, "check_collective", counted)


def test_checks_once_per_solve_same_answers(comm, monkeypatch):
    sp, P = diffusion(comm)
    kappa = 1.0 + 0.5 * torch.rand(sp.mesh.n_local_cells, dtype=F64, generator=torch.Generator().manual_seed(comm.rank))
    # reference: every evaluation fully checked (a copy of u is not the solver's iterate)
    ref, iref = slasolve.nonlinear_solve(lambda v, k: P.residual(v.clone(), k), sp.zeros(), kappa,
                                         jacobian=lambda v, k: P.jacobian(v.clone(), k), rtol=1e-10,
                                         linear_solver=LU, return_info=True)
    count = _Counting(monkeypatch)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian, rtol=1e-10,
                                       linear_solver=LU, return_info=True)
    assert info.iterations == iref.iterations and _close(u, ref, comm)
    # the histories agree to rounding (the last entries sit at the rounding floor of ||F||)
    h, href = torch.tensor(info.residual_history), torch.tensor(iref.residual_history)
    assert float((h - href).abs().max()) <= 1e-10 * float(href[0])
    # each Jacobian's values check only: the check of u0 and the coefficients before F(u0) and J(u0)
    # rides on nonlinear_solve's own argument check (tests/test_nlwrap_check.py: it still raises
    # on every rank)
    assert count.calls == info.jacobian_evaluations
    assert count.calls < iref.function_evaluations + 2 * iref.jacobian_evaluations


def test_gradient_unchanged(comm):
    sp, P = diffusion(comm)
    grads = []
    for wrap in (False, True):
        kappa = torch.full((sp.mesh.n_local_cells,), 1.5, dtype=F64, requires_grad=True)
        res = (lambda v, k: P.residual(v.clone(), k)) if wrap else P.residual
        jac = (lambda v, k: P.jacobian(v.clone(), k)) if wrap else P.jacobian
        u = slasolve.nonlinear_solve(res, sp.zeros(), kappa, jacobian=jac, rtol=1e-10, linear_solver=LU)
        slasolve.global_sum((u * u).sum(), comm).backward()
        grads.append(kappa.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-9, atol=1e-14)


def test_outside_a_solve_every_call_is_checked(comm):
    sp, P = diffusion(comm)
    u = sp.zeros()
    assert not solver_iterate(u, ())
    if comm.rank == 0 and u.numel():
        u[0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        P.residual(u)
    with pytest.raises(ValueError, match="NaN"):
        P.jacobian(u)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_overflowing_tangent_on_one_rank_raises_on_every_rank(comm):
    sp, P = diffusion(comm)
    kappa = torch.ones(sp.mesh.n_local_cells, dtype=F64)
    if comm.rank == 0:
        kappa[:] = 1e308          # finite, but the tangent's sums overflow
    with pytest.raises(ValueError, match="NaN or infinite"):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian, linear_solver=LS)
    # the next call solves
    u = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10, linear_solver=LS)
    assert bool(torch.isfinite(u).all())


def test_solid_with_inverting_trial_steps_matches_checked_run(comm):
    # a large load: full Newton steps invert cells, the residual there is NaN (on_inversion="nan",
    # at the solver's iterates on the inverted ranks only) and the line search backtracks alike
    sp, P = solid(comm, load=4.0)
    kw = dict(rtol=1e-9, maxiter=60, linear_solver=dict(method="direct"), return_info=True)
    ref, iref = slasolve.nonlinear_solve(lambda v: P.residual(v.clone()), sp.zeros(),
                                         jacobian=lambda v: P.jacobian(v.clone()), **kw)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, **kw)
    assert info.converged and iref.converged and abs(info.iterations - iref.iterations) <= 1
    assert _close(u, ref, comm, 1e-8)


def test_jacobian_refill_in_place_matches_setvaluescsr(comm, monkeypatch):
    """The SNES's Jacobian Mat refilled in PETSc's arrays (the linear path's AIJ writer) gives the
    same Newton iterations and solution as MatSetValuesCSR (the writer switched off), and the
    writer is used on every Jacobian after the first."""
    pytest.importorskip("petsc4py")
    from slasolve import petsc as sla_petsc

    sp, P = solid(comm, 0.05)
    made, writes = [], []
    real = sla_petsc.aij_value_writer

    def counting(mat, dA):
        w = real(mat, dA)
        made.append(w)
        if w is not None:
            orig = w.write
            w.write = lambda v: writes.append(1) or orig(v)
        return w
    monkeypatch.setattr(sla_petsc, "aij_value_writer", counting)
    # small Mats are refilled by MatSetValuesCSR (faster below _CSR_BELOW entries): the writer always here
    from slasolve.nonlinear import petsc_snes
    monkeypatch.setattr(petsc_snes, "_CSR_BELOW", 0)
    runs, counts = [], []
    for writer in (True, False):
        if not writer:
            monkeypatch.setattr(sla_petsc, "aij_value_writer", lambda mat, dA: None)
        # other (harmless) options: a SNES of its own, so the second run builds its Mat filler anew
        u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                           linear_solver=LU, return_info=True, backend="petsc",
                                           petsc_options={"snes_max_fail": 1 if writer else 2})
        runs.append((u, info))
        counts.append(len(writes))
    assert len(made) == 1 and made[0] is not None and counts[0] >= runs[0][1].iterations
    assert counts[1] == counts[0], "the second run must fill through MatSetValuesCSR"
    assert runs[0][1].iterations == runs[1][1].iterations
    assert _close(runs[0][0], runs[1][0], comm)
