"""``nonlinear_solve`` on a ``slasolve.fem`` problem's own methods checks ``u0`` and the parameters for
the problem's NumPy kernels (``Problem.start_error``) in its own one collective check of the
arguments: no second check before ``F(u0)``; whether the kernels apply is a setting every rank must
agree on, and a bad ``u0`` / parameter on one rank still raises on every rank."""
import math

import pytest
import torch

import slasolve
from slasolve.fem import nonlinear as fem_nonlinear
from slasolve.nonlinear import solve as solve_mod

from nl_problems import F64, LU, diffusion

pytestmark = pytest.mark.mpi


def _count(monkeypatch, module):
    calls = []
    real = module.check_collective

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(module, "check_collective", counted)
    return calls


def test_one_check_per_call(comm, monkeypatch):
    sp, P = diffusion(comm)
    kappa = 1.0 + 0.1 * torch.arange(sp.mesh.n_local_cells, dtype=F64) / max(sp.mesh.n_local_cells, 1)
    ref = slasolve.nonlinear_solve(lambda v, k: P.residual(v, k), sp.zeros(), kappa,
                                   jacobian=lambda v, k: P.jacobian(v, k), rtol=1e-10, linear_solver=LU)
    in_solve, in_fem = _count(monkeypatch, solve_mod), _count(monkeypatch, fem_nonlinear)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian, rtol=1e-10,
                                       linear_solver=LU, return_info=True)
    # the fem module's only checks: each tangent's finiteness (none for u0 and kappa before F(u0))
    assert len(in_solve) == 1 and len(in_fem) == info.jacobian_evaluations and info.converged
    err = comm.allreduce(float((u - ref).abs().max()) if u.numel() else 0.0, op=_max())
    assert err <= 1e-10 * comm.allreduce(float(ref.abs().max()) if ref.numel() else 0.0, op=_max())


def _max():
    from mpi4py import MPI
    return MPI.MAX


@pytest.mark.parametrize("where", ["u0", "kappa"])
def test_bad_input_on_one_rank_raises_on_every_rank(comm, where):
    sp, P = diffusion(comm)
    u0 = sp.zeros()
    kappa = torch.ones(sp.mesh.n_local_cells, dtype=F64)
    last = comm.rank == comm.size - 1
    if last and where == "u0":
        u0 = torch.full_like(u0, math.nan) if u0.numel() else torch.zeros(1, dtype=F64)
    if last and where == "kappa":
        kappa = torch.ones(sp.mesh.n_local_cells + 1, dtype=F64)
    with pytest.raises(ValueError):
        slasolve.nonlinear_solve(P.residual, u0, kappa, jacobian=P.jacobian, linear_solver=LU)
    # the next call solves
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                       linear_solver=LU, return_info=True)
    assert info.converged


@pytest.mark.mpi(min_size=2)
def test_kernels_applying_on_some_ranks_only_raises_on_every_rank(comm):
    sp, P = diffusion(comm)
    # a callable coefficient takes the methods, a number the kernels: the ranks would part ways
    kappa = (lambda x: 1.0 + 0 * x[:, 0]) if comm.rank == 0 else 1.0
    with pytest.raises(ValueError, match="NumPy kernels"):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian, linear_solver=LU)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), 1.0, jacobian=P.jacobian, rtol=1e-10,
                                       linear_solver=LU, return_info=True)
    assert info.converged
