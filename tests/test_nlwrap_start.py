"""``nonlinear_solve`` on a ``slasolve.fem`` problem's own methods evaluates ``F(u0)`` and ``J(u0)`` by
the problem's NumPy kernels after one collective check of ``u0`` and the parameters
(``Problem.start_kernels``): the answers, histories and counts are those of the methods' path, and
every bad input on one rank still raises on every rank."""
import math

import pytest
import torch

import slasolve
from mpi4py import MPI
from slasolve.nonlinear import problem as problem_mod

from nl_problems import F64, LU, diffusion, solid

pytestmark = pytest.mark.mpi


def _kappa(sp, comm):
    g = torch.Generator().manual_seed(7 + comm.rank)
    return 1.0 + 0.5 * torch.rand(sp.mesh.n_local_cells, dtype=F64, generator=g)


def _started(monkeypatch):
    """Records whether ``Problem.start_kernels`` gave the kernels (True) or not (False)."""
    seen = []
    real = problem_mod.Problem.start_kernels

    def spy(self, u0, **kw):
        out = real(self, u0, **kw)
        seen.append(out is not None)
        return out
    monkeypatch.setattr(problem_mod.Problem, "start_kernels", spy)
    return seen


@pytest.mark.parametrize("which", ["diffusion", "neohookean"])
def test_same_answers_counts_and_history_as_the_methods(comm, monkeypatch, which):
    sp, P = diffusion(comm) if which == "diffusion" else solid(comm, 0.05)
    params = (_kappa(sp, comm),) if which == "diffusion" else ()
    # the neo-Hookean solve stops at rtol 1e-8 (3 Newton steps): a 4th step's energy decrease is at the
    # energy's rounding, where the line search's full-step test follows the direct solver's last bits
    # (MUMPS at 3 ranks need not repeat them), so the step counts could differ by one at 1e-10
    extra = dict(rtol=1e-10) if which == "diffusion" else dict(objective=P.energy, rtol=1e-8)
    ref, iref = slasolve.nonlinear_solve(lambda v, *p: P.residual(v, *p), sp.zeros(), *params,
                                         jacobian=lambda v, *p: P.jacobian(v, *p),
                                         linear_solver=LU, return_info=True, **extra)
    seen = _started(monkeypatch)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), *params, jacobian=P.jacobian,
                                       linear_solver=LU, return_info=True, **extra)
    assert seen and seen[0]
    assert info.converged and iref.converged
    assert info.iterations == iref.iterations
    assert (info.function_evaluations, info.jacobian_evaluations) == \
        (iref.function_evaluations, iref.jacobian_evaluations)
    # F(u0) by the kernel is the method's bit for bit (a reference computed here, by the method)
    with torch.no_grad():
        r0 = P.residual(sp.zeros(), *params)
    n0 = math.sqrt(comm.allreduce(float((r0 * r0).sum()), op=MPI.SUM))
    assert abs(info.residual_history[0] - n0) <= 1e-14 * n0
    assert info.residual_history[0] == iref.residual_history[0]
    err = comm.allreduce(float((u - ref).abs().max()) if u.numel() else 0.0, op=MPI.MAX)
    scale = comm.allreduce(float(ref.abs().max()) if ref.numel() else 0.0, op=MPI.MAX)
    assert err <= 1e-10 * scale


def test_bad_coefficient_on_one_rank_raises_on_every_rank(comm, monkeypatch):
    sp, P = diffusion(comm)
    kappa = _kappa(sp, comm)
    if comm.rank == comm.size - 1:
        kappa = kappa[:-1] if kappa.numel() else torch.ones(3, dtype=F64)   # the wrong length
    seen = _started(monkeypatch)
    with pytest.raises(Exception):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian, linear_solver=LU)
    assert seen == []   # raised by nonlinear_solve's check before it (Problem.start_error), on every rank
    # the next call solves
    u = slasolve.nonlinear_solve(P.residual, sp.zeros(), _kappa(sp, comm), jacobian=P.jacobian, rtol=1e-10,
                                 linear_solver=LU)
    assert bool(torch.isfinite(u).all())


def test_nan_u0_on_one_rank_raises_on_every_rank(comm):
    sp, P = diffusion(comm)
    u0 = sp.zeros()
    if comm.rank == 0 and u0.numel():
        u0[0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        slasolve.nonlinear_solve(P.residual, u0, jacobian=P.jacobian, linear_solver=LU)


def test_callable_coefficient_takes_the_methods(comm, monkeypatch):
    sp, P = diffusion(comm)
    seen = _started(monkeypatch)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), lambda x: 1.0 + x[:, 0], jacobian=P.jacobian,
                                       rtol=1e-10, linear_solver=LU, return_info=True)
    assert seen == [False] and info.converged
    with torch.no_grad():
        r = P.residual(u, lambda x: 1.0 + x[:, 0])
    n = math.sqrt(comm.allreduce(float((r * r).sum()), op=MPI.SUM))
    assert n <= 1e-9 * info.residual_history[0]
