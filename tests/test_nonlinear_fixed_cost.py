"""Fixed cost of ``nonlinear_solve``: the results of callables that raise collectively
(``slasolve.fem`` problems' ``residual`` / ``jacobian``, marked ``raises_collectively``) are checked
with no reduction of the solver's own inside the Newton iterations; plain callables keep the
collective check; errors of either kind still raise on every rank with their messages."""
import pytest
import torch

import slasolve
from slasolve.fem import Assembler, DirichletBC, NeoHookean, NonlinearDiffusion, boundary_dofs, box_mesh
from slasolve.nonlinear import problem as problem_mod
from slasolve.nonlinear.problem import raises_collectively

pytestmark = pytest.mark.mpi
F64 = torch.float64


def _diffusion(comm, n=8):
    sp = Assembler(box_mesh(n, cell="triangle", comm=comm))
    bd = boundary_dofs(sp)
    return sp, NonlinearDiffusion(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), source=10.0)


class _Counting:
    """Counts the calls of ``slasolve.nonlinear.problem``'s ``check_collective``."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = problem_mod.check_collective

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(problem_mod, "check_collective", counted)


def test_fem_methods_are_marked():
    assert raises_collectively(NonlinearDiffusion.residual) and raises_collectively(NonlinearDiffusion.jacobian)
    assert raises_collectively(NeoHookean.residual) and raises_collectively(NeoHookean.jacobian)
    assert not raises_collectively(NeoHookean.energy) and not raises_collectively(lambda u: u)


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_fem_results_checked_without_reduction_plain_callables_with(comm, monkeypatch, backend):
    sp, P = _diffusion(comm)
    ls = dict(method="gmres", pc="gamg" if backend == "petsc" else "jacobi", rtol=1e-10)
    ref, info_ref = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                             linear_solver=ls, backend=backend, return_info=True)
    count = _Counting(monkeypatch)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                       linear_solver=ls, backend=backend, return_info=True)
    # none: the deferred check of F(u0) is the same on every rank too (the residual raises collectively)
    assert count.calls == 0
    assert torch.equal(u, ref) and info.iterations == info_ref.iterations
    count.calls = 0
    u2, info2 = slasolve.nonlinear_solve(lambda v: P.residual(v), sp.zeros(), jacobian=lambda v: P.jacobian(v),
                                         rtol=1e-10, linear_solver=ls, backend=backend, return_info=True)
    assert torch.equal(u2, ref)
    assert count.calls >= info2.function_evaluations + info2.jacobian_evaluations - 1


def test_fem_error_mid_solve_raises_on_every_rank(comm):
    # a neo-Hookean solid pushed until cells invert, on_inversion="raise": the fem's own collective
    # check raises inside a Newton iteration, on every rank, and the solver re-raises it
    sp = Assembler(box_mesh(4, cell="triangle", comm=comm), 2)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), mu=1.0, lmbda=1.5,
                   body_force=torch.tensor([0.0, -200.0], dtype=F64), on_inversion="raise")
    with pytest.raises(ValueError, match="invert"):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, line_search="basic",
                                 linear_solver=dict(method="direct"))


def test_fem_bad_param_on_one_rank_raises_on_every_rank(comm):
    sp, P = _diffusion(comm)
    kappa = torch.ones(sp.mesh.n_local_cells + (1 if comm.rank == 0 else 0), dtype=F64)
    with pytest.raises(ValueError, match="kappa"):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian,
                                 linear_solver=dict(method="gmres", pc="gamg"))


def test_plain_callable_bad_output_mid_solve_raises_on_every_rank(comm):
    sp, P = _diffusion(comm)
    calls = [0]

    def residual(u):
        calls[0] += 1
        r = P.residual(u)
        return r[:-1] if (calls[0] == 3 and comm.rank == comm.size - 1) else r
    with pytest.raises(ValueError, match="residual must return this rank's"):
        slasolve.nonlinear_solve(residual, sp.zeros(), jacobian=P.jacobian, rtol=1e-10,
                                 linear_solver=dict(method="gmres", pc="gamg"))
